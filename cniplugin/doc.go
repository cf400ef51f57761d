// Package cniplugin is detour's chained CNI plugin: for pods the webhook injected, it builds the
// redirect from the pod's annotations and applies it in the pod's network namespace with the
// iptables Executor; every other pod gets the previous plugin's result back untouched.
//
// The annotations come from runtimeConfig (io.kubernetes.cri.pod-annotations) when the runtime
// passes them, else from one bounded GET of the pod. ADD fails closed with a message that says
// what to do; DEL is idempotent; CHECK compares the live rules; STATUS fails only for what breaks every pod and logs only changes; GC has
// nothing to collect. See docs/cni-plugin.md.
package cniplugin
