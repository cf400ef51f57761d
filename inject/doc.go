// Package inject is detour's pod injection: the mutation that adds the validator and the proxy
// to an opted-in pod and writes the redirect annotations the CNI plugin reads, with the
// configuration it is parameterised by.
//
// [Mutate] is pure (a pod, its namespace's annotations and a [Config] in; the mutated pod,
// warnings and the decisions out), so the admission webhook (package webhook) and the offline
// CLI (`detour inject`) apply exactly the same code. docs/webhook.md and docs/annotations.md
// describe the configuration, the decisions and every message.
package inject
