// Package iptables builds detour's redirect ruleset and applies it inside a pod's network
// namespace.
//
// [Build] is pure: a [Config] in, a [Ruleset] out, rendered as iptables-restore text for the nat
// table by [Ruleset.Restore] and golden-tested. [Executor] is the one place that touches the
// kernel: it enters the namespace in Go (no nsenter), picks the legacy or nft backend, and
// applies, removes or checks a ruleset with one iptables-restore per IP family.
package iptables
