//go:build cluster

package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/test/e2e/framework"
	"github.com/detourmesh/detour/test/testenv"
)

// TestE2ECilium is the smoke of the Cilium cluster (issue 35): Cilium v1.20 is the primary CNI
// (framework/cilium.go), cilium-agent on the node compiles and loads its datapath and writes its
// own conflist, and detour chains after it by its network's name, cilium, through the drop-in.
// One node, registered with detour's startup taint as docs/operations.md tells admins to.
//
// `make e2e-cluster` runs it (build tag cluster), with TestE2ECluster and TestE2EFlannel; each
// starts a cluster of its own and stops it when it ends.
func TestE2ECilium(t *testing.T) {
	for _, name := range []string{"cilium/cilium-agent", "cilium/cilium-cni", "cilium/bpf", "cilium/crds"} {
		if _, err := os.Stat(filepath.Join(testenv.BinDir(), name)); err != nil {
			t.Fatalf("Cilium is not built (%v): make e2e-cluster builds it (DETOUR_BINARIES=cluster bash hack/test-binaries.sh)", err)
		}
	}
	if _, err := os.Stat("/usr/lib/llvm-19/bin/clang"); err != nil {
		t.Fatalf("cilium-agent needs clang 19 (%v): make e2e-cluster installs it (DETOUR_HOST_DEPS=cluster bash hack/host-deps.sh)", err)
	}
	start := time.Now()
	e := framework.OwnEnv(t, framework.Options{Cilium: true, Taints: []string{framework.StartupTaint + ":NoSchedule"}})
	ctx, cancel := framework.Context(t, e.Node, 15*time.Minute)
	defer cancel()
	t.Logf("the Cilium node is Ready with cilium-agent healthy %s after the start", time.Since(start).Round(time.Second))
	e.InstallDetour(t, ctx, "")
	e.SetNodeAgent(t, ctx, e.Node, true)
	framework.WaitFor(t, ctx, "the node agent to remove the startup taint", 2*time.Minute, func() (bool, error) {
		node, err := e.Node.Client.CoreV1().Nodes().Get(ctx, e.Node.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		return !framework.HasStartupTaint(node), framework.Seen("taints %v", node.Spec.Taints)
	})
	t.Run("chained-after-cilium", func(t *testing.T) { ciliumChained(t, ctx, e) })
}

// ciliumChained: cilium-agent wrote its conflist, which detour left as it was, and detour's
// configuration is the drop-in of Cilium's network. A pod of an injected namespace gets its
// address and its endpoint from Cilium (a CiliumEndpoint, ready, with the pod's IP from the
// node's range, which the controller-manager allocated), then its rules from detour-cni, and
// its traffic goes through its proxy both ways.
func ciliumChained(t *testing.T, ctx context.Context, e *framework.Env) {
	n := e.Node
	var conf struct {
		Name    string                   `json:"name"`
		Plugins []map[string]interface{} `json:"plugins"`
	}
	data, err := os.ReadFile(n.PrimaryConfigPath())
	if err != nil {
		t.Fatalf("Cilium's conflist: %v", err)
	}
	if err := json.Unmarshal(data, &conf); err != nil {
		t.Fatalf("Cilium's conflist: %v\n%s", err, data)
	}
	var kinds []string
	for _, p := range conf.Plugins {
		kinds = append(kinds, fmt.Sprint(p["type"]))
	}
	if conf.Name != framework.CiliumNetwork || strings.Join(kinds, ",") != "cilium-cni" {
		t.Errorf("the conflist names network %q with plugins %v, want Cilium's %s with cilium-cni (detour changed it?)\n%s",
			conf.Name, kinds, framework.CiliumNetwork, data)
	}
	if _, err := os.Stat(framework.NodeDropIn(n)); err != nil {
		t.Errorf("detour's drop-in for network %s: %v", framework.CiliumNetwork, err)
	}
	if !framework.ClusterCIDR.Contains(n.PodSubnet.Addr()) {
		t.Errorf("the node's pod range %s is not in the cluster's %s", n.PodSubnet, framework.ClusterCIDR)
	}

	const ns = "mesh-cilium"
	e.Namespace(t, ctx, ns, true)
	defer e.DropNamespaces(t, ctx, ns)
	created := time.Now()
	if _, err := n.Client.AppsV1().Deployments(ns).Create(ctx, e.Deployment("web", ns, 1), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p := e.WaitReady(t, ctx, ns, "app=web", 1)[0]
	t.Logf("the injected pod %s was ready %s after its Deployment, with IP %s", p.Name, time.Since(created).Round(100*time.Millisecond), p.Status.PodIP)
	if !annotations.IsInjected(p.Annotations) {
		t.Errorf("pod %s is not injected: %v", p.Name, p.Annotations)
	}
	if code := framework.CheckExit(&p); code != 0 {
		t.Errorf("pod %s: the validator exited %d, want 0", p.Name, code)
	}
	if ip, err := netip.ParseAddr(p.Status.PodIP); err != nil || !n.PodSubnet.Contains(ip) {
		t.Errorf("pod %s has IP %q, not one of the node's range %s", p.Name, p.Status.PodIP, n.PodSubnet)
	}
	// Cilium's endpoint for the pod: its identity and policy are Cilium's.
	framework.WaitFor(t, ctx, "Cilium's endpoint for "+p.Name+" to be ready", time.Minute, func() (bool, error) {
		out, stderr, err := n.Kubectl(ctx, "get", "ciliumendpoint", "-n", ns, p.Name,
			"-o", `jsonpath={.status.state} {.status.networking.addressing[0].ipv4}`)
		return err == nil && out == "ready "+p.Status.PodIP, framework.Seen("%q %v %s", out, err, stderr)
	})
	var added bool
	for _, l := range framework.PluginLogAt(framework.NodePluginLog(n), "ADD", "") {
		if l.Pod == ns+"/"+p.Name {
			added = l.Decision == "redirected" && l.Error == ""
		}
	}
	if !added {
		t.Errorf("detour-cni's log has no ADD of %s/%s that redirected:\n%s", ns, p.Name, framework.Tail(framework.ReadFile(framework.NodePluginLog(n)), 10))
	}
	e.AssertCaptured(t, ctx, p, "web")
}
