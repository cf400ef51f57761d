// Package upstream runs Kubernetes' own network tests — the [sig-network] tests of
// k8s.io/kubernetes/test/e2e, built as e2e.test by hack/test-binaries.sh — against the e2e
// cluster (package framework), and reports them per test.
//
// What it provides:
//   - Images: the test images under the names the e2e framework gives them, built here (no
//     container registry is reachable from the machines this runs on): agnhost and CoreDNS
//     from their Go modules on a Debian userland (mmdebstrap, in hack/test-binaries.sh),
//     glibc-dns-testing and nginx on the same userland, pause as the caller's pause image;
//     and, beside them, flannel's image (flanneld and its CNI plugin on that userland), the
//     primary CNI of package framework's flannel cluster.
//   - Run: one run of e2e.test inside a node's namespaces, with a focus, and its JUnit report
//     read back into Results.
//   - Recorder: every pod the run creates, as the API shows it, to count the pods detour
//     injected.
//   - Compare and Table: the two runs of `make conformance` (without detour, with it) side by
//     side.
package upstream
