// Package webhook is detour's pod injection: the mutation that adds the validator and the proxy
// to an opted-in pod and writes the redirect annotations the CNI plugin reads, and the admission
// webhook server that applies it.
//
// [Mutate] is pure (a pod, its namespace's annotations and a [Config] in; the mutated pod,
// warnings and the decisions out), so the webhook ([Run]) and the offline CLI ([InjectStream],
// `detour inject`) apply exactly the same code. docs/webhook.md and docs/annotations.md
// describe the configuration, the decisions and every message.
package webhook
