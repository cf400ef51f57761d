package framework

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Kubernetes releases. A node and its control plane run the release hack/test-binaries.sh
// builds (kube-apiserver, ... in the binaries' directory, links to NAME-vX.Y.Z) unless
// Options.Kubernetes names another one that hack/kubernetes-versions.sh built into the same
// directory as NAME-vX.Y.Z: its kube-apiserver, kube-controller-manager, kube-scheduler,
// kube-proxy and kubelet (kubectl, etcd, containerd, runc and CoreDNS stay the default ones).
// Options.Kubelet gives the kubelet a release of its own (a node that lags its control plane),
// and [Node.ReplaceKubelet] swaps it in place, as an admin upgrading a node without a reboot
// does.

// KubernetesComponents are the commands of a Kubernetes release that Options.Kubernetes
// selects.
var KubernetesComponents = []string{"kube-apiserver", "kube-controller-manager", "kube-scheduler", "kube-proxy", "kubelet"}

// DefaultKubernetes is the release of the default binaries in binDir (hack/test-binaries.sh):
// the version its kubelet link names, such as "v1.37.2".
func DefaultKubernetes(binDir string) (string, error) {
	target, err := os.Readlink(filepath.Join(binDir, "kubelet"))
	if err != nil {
		return "", fmt.Errorf("the default Kubernetes release: %w", err)
	}
	v, ok := strings.CutPrefix(filepath.Base(target), "kubelet-")
	if !ok {
		return "", fmt.Errorf("the default Kubernetes release: %s links to %s, not kubelet-<version>", filepath.Join(binDir, "kubelet"), target)
	}
	return v, nil
}

// KubernetesVersion is the release of the node's control plane and kube-proxy.
func (n *Node) KubernetesVersion() string {
	if v := n.root().opts.Kubernetes; v != "" {
		return v
	}
	v, _ := DefaultKubernetes(n.BinDir)
	return v
}

// KubeletVersion is the release of the node's kubelet: the one [Node.ReplaceKubelet] put in
// place last, else Options.Kubelet, else the control plane's.
func (n *Node) KubeletVersion() string {
	if v := n.kubeletRelease(); v != "" {
		return v
	}
	return n.KubernetesVersion()
}

// kubeletRelease is the kubelet's release when one was chosen (ReplaceKubelet, Options.Kubelet,
// Options.Kubernetes), or "" for the default binary.
func (n *Node) kubeletRelease() string {
	n.mu.Lock()
	v := n.kubelet
	n.mu.Unlock()
	if v != "" {
		return v
	}
	if n.opts.Kubelet != "" {
		return n.opts.Kubelet
	}
	return n.root().opts.Kubernetes
}

// kubeBin is the binary a Kubernetes component of the node runs: the kubelet's release for the
// kubelet, the control plane's for the others.
func (n *Node) kubeBin(name string) string {
	version := n.root().opts.Kubernetes
	if name == "kubelet" {
		version = n.kubeletRelease()
	}
	if version == "" {
		return n.Bin(name)
	}
	return n.Bin(name + "-" + version)
}

// checkKubernetesBinaries says which binaries of the node's releases are missing, and how to
// build them.
func (n *Node) checkKubernetesBinaries() error {
	var missing []string
	for _, c := range KubernetesComponents {
		if _, err := os.Stat(n.kubeBin(c)); err != nil {
			missing = append(missing, filepath.Base(n.kubeBin(c)))
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%s has no %s: run hack/kubernetes-versions.sh (make e2e-versions does)", n.BinDir, strings.Join(missing, ", "))
	}
	return nil
}

// ReplaceKubelet replaces the node's kubelet in place with release version, as an admin
// upgrading (or downgrading) a node without a reboot does: the kubelet stops (SIGTERM), its
// binary is swapped, and it starts again with the same configuration, directories and
// certificates; the pods, containerd and everything else keep running. It returns once the
// new kubelet is healthy and the Node reports it (status.nodeInfo.kubeletVersion) and Ready.
func (n *Node) ReplaceKubelet(ctx context.Context, version string) error {
	bin := n.Bin("kubelet-" + version)
	if _, err := os.Stat(bin); err != nil {
		return fmt.Errorf("replace the kubelet with %s: %w (run hack/kubernetes-versions.sh)", version, err)
	}
	if err := n.StopComponent("kubelet"); err != nil {
		return fmt.Errorf("replace the kubelet with %s: stop the running one: %w", version, err)
	}
	n.mu.Lock()
	n.kubelet = version
	n.mu.Unlock()
	if err := n.StartComponent(ctx, "kubelet"); err != nil {
		return fmt.Errorf("replace the kubelet with %s: %w", version, err)
	}
	var reported string
	err := Poll(ctx, time.Minute, func() (bool, error) {
		node, err := n.Client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		reported = node.Status.NodeInfo.KubeletVersion
		return reported == version, Seen("the Node reports kubelet %s", reported)
	})
	if err != nil {
		return errors.Join(fmt.Errorf("replace the kubelet with %s: the Node does not report it", version), err)
	}
	return nil
}
