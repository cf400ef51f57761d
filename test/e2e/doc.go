// Package e2e runs a real Kubernetes node on this machine for detour's end-to-end tests:
// etcd, kube-apiserver, kube-controller-manager, kube-scheduler, containerd, runc and the
// kubelet, built from their Go modules by hack/test-binaries.sh, with the reference bridge
// plugin as the primary CNI, in a network and mount namespace of their own (see holder.go),
// and detour installed into it from its own image and chart by the tests. A test binary that
// uses [Start] must serve as the node's namespace holder when asked: its TestMain calls
// [ServeHolder] first.
package e2e
