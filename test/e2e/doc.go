// Package e2e holds detour's end-to-end stories: each a function that runs on a real
// Kubernetes cluster on this machine, started and driven by package
// [github.com/detourmesh/detour/test/e2e/framework], with detour installed from its image and
// chart. The package has no code but this comment; its tests are one binary (`make e2e`):
//
//   - suite_test.go: TestMain, TestE2E (the stories of the shared node, in order) and TestSoak.
//   - one file per area: injection, runtime, validator, podsecurity, badinput, check, agent
//     (the node agent), dropin, monitoring, repair, jobs, cluster (and cluster_nodes),
//     services, conformance, install; soak_*.go are TestSoak's.
//   - cluster_full_test.go and flannel_test.go (build tag cluster, `make e2e-cluster`),
//     conformance_run_test.go (build tag conformance, `make conformance`): tests on clusters
//     of their own, before the shared node.
//   - harness_*_test.go: the harness on nodes of its own (nothing of them may run beside the
//     shared node, so they are here rather than in the framework's package).
//   - bench_test.go: BenchmarkPodStartLatency, BenchmarkNodeJoin, BenchmarkCrossNode
//     (`make bench-e2e`).
//
// docs/development.md says how to add a story.
package e2e
