//go:build cluster

package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/detourmesh/detour/test/e2e/framework"
	"github.com/detourmesh/detour/test/e2e/upstream"
	"github.com/detourmesh/detour/test/testenv"
)

// TestE2EFlannel runs the cluster stories against a primary CNI that nobody here wrote
// (issue 22): flannel v0.28 with the vxlan backend, installed from its DaemonSet, which writes
// its own conflist (framework/flannel.go). detour chains after it by its network's name, cbr0. Two
// nodes: the control-plane node and B, which joins registered with detour's startup taint, as
// docs/operations.md tells admins to register a node pool's nodes.
//
// `make e2e-cluster` runs it (build tag cluster), with TestE2ECluster; each starts a cluster of
// its own and stops it when it ends, and they share the artifacts.
func TestE2EFlannel(t *testing.T) {
	for _, name := range []string{"flanneld", "flannel"} {
		if _, err := os.Stat(filepath.Join(testenv.BinDir(), name)); err != nil {
			t.Fatalf("flannel is not built (%v): make e2e-cluster builds it (DETOUR_BINARIES=cluster bash hack/test-binaries.sh)", err)
		}
	}
	e := framework.OwnEnv(t, framework.Options{FlannelImage: upstream.FlannelRef})
	ctx, cancel := framework.Context(t, e.Node, 20*time.Minute)
	defer cancel()
	e.InstallDetour(t, ctx, "")
	e.SetNodeAgent(t, ctx, e.Node, true)
	b := e.Join(t, ctx, "e2e-node-b")
	for _, s := range []clusterStory{
		{"chained-after-flannel", flannelChained},
		{"cross-node", flannelCrossNode},
		{"flannel-restarts-on-every-node", flannelRestarts},
	} {
		if !t.Run(s.name, func(t *testing.T) { s.run(t, ctx, e, b) }) && ctx.Err() != nil {
			return
		}
	}
}

// flannelChained: on each node, flannel's DaemonSet wrote its conflist, which detour left as
// it was, and detour's configuration is the drop-in of flannel's network; flanneld took the
// node's pod range from its Node and routes the other node's through its vxlan device.
func flannelChained(t *testing.T, ctx context.Context, e *framework.Env, b *framework.Node) {
	for _, n := range []*framework.Node{e.Node, b} {
		var conf struct {
			Name    string                   `json:"name"`
			Plugins []map[string]interface{} `json:"plugins"`
		}
		data, err := os.ReadFile(n.PrimaryConfigPath())
		if err != nil {
			t.Fatalf("node %s: flannel's conflist: %v", n.Name, err)
		}
		if err := json.Unmarshal(data, &conf); err != nil {
			t.Fatalf("node %s: flannel's conflist: %v\n%s", n.Name, err, data)
		}
		var kinds []string
		for _, p := range conf.Plugins {
			kinds = append(kinds, fmt.Sprint(p["type"]))
		}
		if conf.Name != framework.FlannelNetwork || strings.Join(kinds, ",") != "flannel,portmap" {
			t.Errorf("node %s: the conflist names network %q with plugins %v, want flannel's %s with flannel,portmap (detour changed it?)\n%s",
				n.Name, conf.Name, kinds, framework.FlannelNetwork, data)
		}
		if _, err := os.Stat(framework.NodeDropIn(n)); err != nil {
			t.Errorf("node %s: detour's drop-in for network %s: %v", n.Name, framework.FlannelNetwork, err)
		}
		subnet, err := os.ReadFile(n.FlannelSubnetFile())
		if err != nil || !strings.Contains(string(subnet), "FLANNEL_SUBNET="+n.PodSubnet.Addr().Next().String()+"/") {
			t.Errorf("node %s: flanneld's subnet file does not give the node's pod range %s: %v\n%s", n.Name, n.PodSubnet, err, subnet)
		}
	}
	if e.Node.PodSubnet == b.PodSubnet || !framework.ClusterCIDR.Contains(b.PodSubnet.Addr()) {
		t.Errorf("pod ranges %s (%s) and %s (%s), want two of %s", e.Node.PodSubnet, e.Node.Name, b.PodSubnet, b.Name, framework.ClusterCIDR)
	}
	// Each flanneld adds the route to another node's pods once it sees that node's lease.
	for _, c := range []struct{ from, to *framework.Node }{{e.Node, b}, {b, e.Node}} {
		framework.WaitFor(t, ctx, fmt.Sprintf("node %s to route %s's pods %s through flannel's vxlan device flannel.1", c.from.Name, c.to.Name, c.to.PodSubnet), time.Minute, func() (bool, error) {
			out, err := c.from.Run(ctx, "ip", "route", "get", c.to.PodSubnet.Addr().Next().String())
			return err == nil && strings.Contains(out, "dev flannel.1"), framework.Seen("ip route get: %v %s", err, out)
		})
	}
}

// flannelCrossNode is the cross-node story (clusterCrossNode) between pods of flannel's
// network: vxlan-encapsulated between the nodes.
func flannelCrossNode(t *testing.T, ctx context.Context, e *framework.Env, b *framework.Node) {
	clusterCrossNode(t, ctx, e, b)
}

// flannelRestarts: flannel's pods restart on every node at once, four times, while injected
// pods are created on both nodes: each restart's init containers rewrite the node's conflist in
// place (cp -f) and copy the plugin again, and flanneld starts over. With detour's drop-in (the
// default on containerd 2.4), not one pod may start without its rules. The same again with
// detour as an entry in flannel's conflist (cniConfigMode: chained-entry), which each rewrite
// takes out until the agent puts it back: for the record, and to show that the count can be
// other than 0.
func flannelRestarts(t *testing.T, ctx context.Context, e *framework.Env, b *framework.Node) {
	nodes := []*framework.Node{e.Node, b}
	dropIn := flannelChurn(t, ctx, e, "churn-flannel", nodes)
	if dropIn.failed != 0 {
		t.Errorf("with the drop-in, %d of %d pods started without rules while flannel restarted on every node", dropIn.failed, dropIn.pods)
	}
	for _, n := range nodes {
		if _, err := os.Stat(framework.NodeDropIn(n)); err != nil {
			t.Errorf("node %s: detour's drop-in is gone after flannel's restarts: %v", n.Name, err)
		}
	}

	// The last story: the cluster stops after it, with detour left in this mode.
	e.InstallDetour(t, ctx, "nodeAgent: {cniConfigMode: chained-entry}\n")
	for _, n := range nodes {
		framework.WaitFor(t, ctx, "chained-entry to put detour into flannel's conflist on "+n.Name, 2*time.Minute, func() (bool, error) {
			_, err := os.Stat(framework.NodeDropIn(n))
			return strings.Contains(framework.ReadFile(n.PrimaryConfigPath()), "detour-cni") && os.IsNotExist(err), framework.Seen("drop-in: %v", err)
		})
	}
	entry := flannelChurn(t, ctx, e, "churn-flannel-entry", nodes)
	t.Logf("flannel restarted on both nodes: with the drop-in %d of %d pods started without rules (%d restarts), with the in-file entry %d of %d (%d restarts)",
		dropIn.failed, dropIn.pods, dropIn.rewrites, entry.failed, entry.pods, entry.rewrites)
}

// flannelChurn creates injected pods in waves on nodes, in namespace ns, while flannel's pods
// restart on every node at once, four times.
func flannelChurn(t *testing.T, ctx context.Context, e *framework.Env, ns string, nodes []*framework.Node) churnResult {
	const restarts = 4
	defer e.DropNamespaces(t, ctx, ns)
	return podWaves(t, ctx, e, ns, nodes, func() int {
		for i := range restarts {
			if err := restartFlannel(ctx, e, len(nodes)); err != nil {
				t.Errorf("restart %d of flannel: %v", i+1, err)
				return i
			}
		}
		return restarts
	})
}

// restartFlannel deletes flannel's pods on every node at once, as `kubectl delete pods -l
// app=flannel` does, and waits until the DaemonSet's new pods run on all nodes.
func restartFlannel(ctx context.Context, e *framework.Env, nodes int) error {
	pods := e.Node.Client.CoreV1().Pods(framework.FlannelNamespace)
	sel := metav1.ListOptions{LabelSelector: "app=flannel"}
	old, err := pods.List(ctx, sel)
	if err != nil {
		return err
	}
	gone := map[types.UID]bool{}
	for _, p := range old.Items {
		gone[p.UID] = true
	}
	if err := pods.DeleteCollection(ctx, metav1.DeleteOptions{}, sel); err != nil {
		return err
	}
	err = framework.Poll(ctx, 2*time.Minute, func() (bool, error) {
		list, err := pods.List(ctx, sel)
		if err != nil {
			return false, err
		}
		ready := 0
		for i := range list.Items {
			p := &list.Items[i]
			if !gone[p.UID] && p.DeletionTimestamp == nil && p.Status.Phase == corev1.PodRunning && framework.PodReady(p) {
				ready++
			}
		}
		return ready == nodes, framework.Seen("%d of %d new pods ready", ready, nodes)
	})
	if err != nil {
		return fmt.Errorf("flannel's pods did not come back: %w", err)
	}
	return nil
}
