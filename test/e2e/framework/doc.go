// Package framework is the harness of detour's end-to-end tests (the stories in test/e2e). It
// runs a real Kubernetes cluster on this machine: etcd, kube-apiserver, kube-controller-manager,
// kube-scheduler, containerd, runc, the kubelet, kube-proxy and CoreDNS, built from their Go
// modules by hack/test-binaries.sh, with the reference bridge plugin (or flannel) as the
// primary CNI, each node in a network and mount namespace of its own (holder.go), and detour
// installed into it from its own image and chart.
//
// What a story uses, by file:
//   - env.go: [SetUp] (the binary's shared node), [OwnEnv] (a cluster of one test's own), [Env].
//   - install.go: [Env.InstallDetour], [Env.SetAgent], [Env.UseRegistry] and the chart's values.
//   - pods.go: [Env.Namespace], [Env.Pod], [Env.Deployment], [Env.WaitReady], [Env.Logs], ...
//   - wait.go: [WaitFor], [Seen], [Poll], [Context] (a test's deadline and the node's health).
//   - nodepool.go: nodes that join and leave the cluster ([Env.Join], [Env.Remove], cordons).
//   - capture.go, validator.go, agent.go, checkcluster.go: the evidence — a connection through
//     the proxy ([Env.AssertCaptured]), the plugin's log, the validator's outcome
//     ([CheckExit]), detour's configuration on the node, `detour check --cluster`.
//   - node.go, cluster.go, processes.go, exec.go and the rest: the machinery of a [Node].
//
// A test binary that uses it must serve as a node's namespace holder when asked: its TestMain
// is os.Exit([Run](m)), or calls [ServeHolder] first.
package framework
