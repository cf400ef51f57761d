// Package annotations is the contract between detour's webhook and its CNI plugin: the pod and
// namespace annotation keys, their formats, and the one parser and formatter both sides use.
//
// Users write the opt-in and tuning keys (inject, init-egress, skip lists, sidecar mode); the
// webhook compiles them, with its own configuration, into the webhook-written keys of [Redirect],
// which the CNI plugin turns into iptables rules. Every parser is strict and its errors name the
// annotation, the bad value and the rule it broke (see docs/annotations.md).
package annotations
