//go:build cluster

package e2e

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/internal/clustercheck"
	"github.com/detourmesh/detour/test/e2e/framework"
)

// TestE2ECilium runs the cluster stories on Cilium (issue 35): Cilium v1.20 is the primary CNI
// of three nodes (framework/cilium.go), installed from its chart with cni.exclusive off, and
// detour chains after it by its network's name, cilium, through the drop-in. Every node is
// registered with detour's startup taint, as docs/operations.md tells admins to.
//
// `make e2e-cluster` runs it (build tag cluster), with TestE2ECluster, TestE2EFlannel and
// TestE2ECiliumKPR; each starts a cluster of its own and stops it when it ends.
func TestE2ECilium(t *testing.T) {
	start := time.Now()
	e, ctx := ciliumCluster(t, framework.CiliumConfig{}, 45*time.Minute)
	b := e.Join(t, ctx, "e2e-node-b")
	third := e.Join(t, ctx, "e2e-node-e")
	nodes := []*framework.Node{e.Node, b, third}
	t.Logf("three Cilium nodes Ready, detour's agent on each, %s after the start", time.Since(start).Round(time.Second))
	for _, s := range []struct {
		name string
		run  func(*testing.T)
	}{
		{"chained-after-cilium", func(t *testing.T) { ciliumChained(t, ctx, e, nodes) }},
		{"cross-node", func(t *testing.T) { ciliumCrossNode(t, ctx, e, b) }},
		{"pod-start", func(t *testing.T) { ciliumPodStart(t, ctx, e) }},
		{"cilium-restarts-on-every-node", func(t *testing.T) { ciliumRestarts(t, ctx, e, nodes) }},
		{"cni-exclusive", func(t *testing.T) { ciliumExclusive(t, ctx, e, nodes) }},
		// The last: the third node leaves first, so that the scale-out's nodes make three.
		{"seed000-scale-out", func(t *testing.T) {
			e.Remove(t, third)
			e.UseRegistry(t, ctx)
			clusterScaleOut(t, ctx, e, b)
		}},
	} {
		if !t.Run(s.name, s.run) && ctx.Err() != nil {
			return
		}
	}
}

// TestE2ECiliumKPR runs the story of Cilium's kube-proxy replacement (issue 35): a cluster of
// its own, since the replacement is chosen when a cluster starts (its nodes run no
// kube-proxy), of one node, where Cilium serves the Services itself with socket load balancing
// in the pods' namespaces, as its chart does with kubeProxyReplacement true and
// socketLB.hostNamespaceOnly left false; detour chains after it through the drop-in.
//
// `make e2e-cluster` runs it after TestE2ECilium (its -run pattern matches both names).
func TestE2ECiliumKPR(t *testing.T) {
	e, ctx := ciliumCluster(t, framework.CiliumConfig{KubeProxyReplacement: true}, 20*time.Minute)
	t.Run("socket-lb-host-namespace-only", func(t *testing.T) { ciliumSocketLB(t, ctx, e) })
}

// ciliumCluster starts a Cilium cluster of the test's own with cfg, its control-plane node
// registered with detour's startup taint, installs detour and its node agent there, and
// returns once the agent has removed the taint. The context it returns ends after want (see
// [framework.Context]), or when the test does.
func ciliumCluster(t *testing.T, cfg framework.CiliumConfig, want time.Duration) (*framework.Env, context.Context) {
	t.Helper()
	framework.RequireCilium(t)
	start := time.Now()
	e := framework.OwnEnv(t, framework.Options{Cilium: &cfg, Taints: []string{framework.StartupTaint + ":NoSchedule"}})
	ctx, cancel := framework.Context(t, e.Node, want)
	t.Cleanup(cancel)
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
	return e, ctx
}

// ciliumChained: on every node, cilium-agent wrote its conflist, which detour left as it was,
// and detour's configuration is the drop-in of Cilium's network. A pod of an injected namespace
// gets its address and its endpoint from Cilium (a CiliumEndpoint, ready, with the pod's IP
// from the node's range, which the controller-manager allocated), then its rules from
// detour-cni, and its traffic goes through its proxy both ways.
func ciliumChained(t *testing.T, ctx context.Context, e *framework.Env, nodes []*framework.Node) {
	for _, n := range nodes {
		var conf struct {
			Name    string                   `json:"name"`
			Plugins []map[string]interface{} `json:"plugins"`
		}
		data, err := os.ReadFile(n.PrimaryConfigPath())
		if err != nil {
			t.Fatalf("node %s: Cilium's conflist: %v", n.Name, err)
		}
		if err := json.Unmarshal(data, &conf); err != nil {
			t.Fatalf("node %s: Cilium's conflist: %v\n%s", n.Name, err, data)
		}
		var kinds []string
		for _, p := range conf.Plugins {
			kinds = append(kinds, fmt.Sprint(p["type"]))
		}
		if conf.Name != framework.CiliumNetwork || strings.Join(kinds, ",") != "cilium-cni" {
			t.Errorf("node %s: the conflist names network %q with plugins %v, want Cilium's %s with cilium-cni (detour changed it?)\n%s",
				n.Name, conf.Name, kinds, framework.CiliumNetwork, data)
		}
		if _, err := os.Stat(framework.NodeDropIn(n)); err != nil {
			t.Errorf("node %s: detour's drop-in for network %s: %v", n.Name, framework.CiliumNetwork, err)
		}
		if !framework.ClusterCIDR.Contains(n.PodSubnet.Addr()) {
			t.Errorf("node %s: the pod range %s is not in the cluster's %s", n.Name, n.PodSubnet, framework.ClusterCIDR)
		}
	}

	n := e.Node
	const ns = "mesh-cilium"
	e.Namespace(t, ctx, ns, true)
	defer e.DropNamespaces(t, ctx, ns)
	created := time.Now()
	if _, err := n.Client.AppsV1().Deployments(ns).Create(ctx, framework.OnNodeDeployment(e.Deployment("web", ns, 1), n.Name), metav1.CreateOptions{}); err != nil {
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

// ciliumCrossNode is the cross-node story (clusterCrossNode) between pods of Cilium's network:
// each node routes the other's pod range into Cilium's datapath (cilium_host), which carries it
// over VXLAN (cilium_vxlan) to the other node.
func ciliumCrossNode(t *testing.T, ctx context.Context, e *framework.Env, b *framework.Node) {
	for _, c := range []struct{ from, to *framework.Node }{{e.Node, b}, {b, e.Node}} {
		if out, err := c.from.Run(ctx, "ip", "-d", "link", "show", "cilium_vxlan"); err != nil || !strings.Contains(out, "vxlan") {
			t.Errorf("node %s has no VXLAN device cilium_vxlan: %v\n%s", c.from.Name, err, out)
		}
		framework.WaitFor(t, ctx, fmt.Sprintf("node %s to route %s's pods %s into Cilium's datapath", c.from.Name, c.to.Name, c.to.PodSubnet), time.Minute, func() (bool, error) {
			out, err := c.from.Run(ctx, "ip", "route", "get", c.to.PodSubnet.Addr().Next().String())
			return err == nil && strings.Contains(out, "dev cilium_host"), framework.Seen("ip route get: %v %s", err, out)
		})
	}
	clusterCrossNode(t, ctx, e, b)
}

// ciliumPodStart measures how long a pod takes from its creation to Ready on Cilium, as
// BenchmarkPodStartLatency's rows 1 and 5 do on the bridge: the mesh without detour (the test
// proxy a native sidecar with its startup probe, added by hand) and detour with its chart's
// defaults (the check at the proxy's start, the hook gate), DETOUR_E2E_BENCH_PODS of each
// (default 15), alternating. The figures are for docs/benchmarks.md; it fails only when a pod
// does not become Ready.
func ciliumPodStart(t *testing.T, ctx context.Context, e *framework.Env) {
	n := 15
	if v := os.Getenv("DETOUR_E2E_BENCH_PODS"); v != "" {
		fmt.Sscan(v, &n)
	}
	e.Namespace(t, ctx, "start-plain", false)
	e.Namespace(t, ctx, "start-detour", true)
	defer e.DropNamespaces(t, ctx, "start-plain", "start-detour")
	rows := []struct {
		name, ns string
		plain    func(*corev1.Pod)
		took     []time.Duration
	}{
		{name: "no detour, the proxy a native sidecar", ns: "start-plain", plain: func(p *corev1.Pod) { nativeProxy(e, p) }},
		{name: "detour, chart defaults (hook gate)", ns: "start-detour"},
	}
	for i := range n {
		for k := range rows {
			pt, err := podStart(ctx, e, rows[k].ns, fmt.Sprintf("p%d", i), rows[k].plain)
			if err != nil {
				t.Fatal(err)
			}
			rows[k].took = append(rows[k].took, pt.ready.Sub(pt.created))
		}
	}
	var b strings.Builder
	for _, r := range rows {
		p50, p99 := percentiles(r.took)
		fmt.Fprintf(&b, "\n%s: p50 %s, p99 %s (%d pods)", r.name, p50.Round(time.Millisecond), p99.Round(time.Millisecond), len(r.took))
	}
	t.Logf("creation → Ready on Cilium, alternating:%s", b.String())
}

// ciliumWrites counts the times cilium-agent on n wrote its conflist, from its log (appended to
// across restarts).
func ciliumWrites(n *framework.Node) int {
	return strings.Count(n.Log("cilium-agent"), "Wrote CNI configuration file")
}

// ciliumRestarts: with cni.exclusive off, cilium-agent restarts on every node at once, six
// times, 5 s apart, while injected pods are created on all nodes. At each start the agent
// writes its conflist again when its content differs from what it would write (v1.20.2's
// daemon/cmd/cni/config.go). With detour's drop-in, the content never differs and the drop-in is
// not Cilium's to touch: not one pod may start without its rules. With detour's entry in the
// conflist (cniConfigMode: chained-entry), every start rewrites the file without the entry until
// the node agent puts it back: the figure, for the record.
func ciliumRestarts(t *testing.T, ctx context.Context, e *framework.Env, nodes []*framework.Node) {
	writes := ciliumWritesAll(nodes)
	dropIn := ciliumChurn(t, ctx, e, "churn-cilium", nodes)
	dropInWrites := ciliumWritesAll(nodes) - writes
	if dropIn.failed != 0 {
		t.Errorf("with the drop-in, %d of %d pods started without rules while cilium-agent restarted on every node", dropIn.failed, dropIn.pods)
	}
	if dropInWrites != 0 {
		t.Errorf("cilium-agent wrote its conflist %d times in %d restarts with detour's drop-in beside it, want 0 (the content did not change)", dropInWrites, dropIn.rewrites)
	}
	for _, n := range nodes {
		if _, err := os.Stat(framework.NodeDropIn(n)); err != nil {
			t.Errorf("node %s: detour's drop-in is gone after cilium-agent's restarts: %v", n.Name, err)
		}
	}

	e.InstallDetour(t, ctx, "nodeAgent: {cniConfigMode: chained-entry}\n")
	defer func() {
		e.InstallDetour(t, ctx, "")
		waitDropIn(t, ctx, e, nodes)
	}()
	waitInFile(t, ctx, nodes)
	writes = ciliumWritesAll(nodes)
	entry := ciliumChurn(t, ctx, e, "churn-cilium-entry", nodes)
	entryWrites := ciliumWritesAll(nodes) - writes
	if entryWrites < entry.rewrites*len(nodes) {
		t.Errorf("cilium-agent wrote its conflist %d times in %d restarts on %d nodes with detour's entry in it, want one a restart and node", entryWrites, entry.rewrites, len(nodes))
	}
	t.Logf("cilium-agent restarted on %d nodes (cni.exclusive false): with the drop-in %d of %d pods started without rules (%d restarts, %d conflist writes by Cilium), with the in-file entry %d of %d (%d restarts, %d conflist writes by Cilium)",
		len(nodes), dropIn.failed, dropIn.pods, dropIn.rewrites, dropInWrites, entry.failed, entry.pods, entry.rewrites, entryWrites)
}

func ciliumWritesAll(nodes []*framework.Node) int {
	sum := 0
	for _, n := range nodes {
		sum += ciliumWrites(n)
	}
	return sum
}

// ciliumChurn creates injected pods in waves on nodes, in namespace ns, while cilium-agent
// restarts on every node at once, six times, 5 s apart.
func ciliumChurn(t *testing.T, ctx context.Context, e *framework.Env, ns string, nodes []*framework.Node) churnResult {
	const restarts = 6
	defer e.DropNamespaces(t, ctx, ns)
	return podWaves(t, ctx, e, ns, nodes, func() int {
		for i := range restarts {
			began := time.Now()
			if err := e.Node.RestartCilium(ctx); err != nil {
				t.Errorf("restart %d of cilium-agent: %v", i+1, err)
				return i
			}
			t.Logf("restart %d: cilium-agent healthy again on every node %s after it was stopped", i+1, time.Since(began).Round(100*time.Millisecond))
			if !framework.SleepCtx(ctx, 5*time.Second) {
				return i + 1
			}
		}
		return restarts
	})
}

// waitInFile waits until detour's configuration is its entry in Cilium's conflist on every
// node, and no drop-in.
func waitInFile(t *testing.T, ctx context.Context, nodes []*framework.Node) {
	t.Helper()
	for _, n := range nodes {
		framework.WaitFor(t, ctx, "chained-entry to put detour into Cilium's conflist on "+n.Name, 2*time.Minute, func() (bool, error) {
			_, err := os.Stat(framework.NodeDropIn(n))
			return strings.Contains(framework.ReadFile(n.PrimaryConfigPath()), "detour-cni") && os.IsNotExist(err), framework.Seen("drop-in: %v", err)
		})
	}
}

// waitDropIn waits until detour's configuration is its drop-in on every node, and nothing in
// Cilium's conflist.
func waitDropIn(t *testing.T, ctx context.Context, e *framework.Env, nodes []*framework.Node) {
	t.Helper()
	for _, n := range nodes {
		framework.WaitFor(t, ctx, "auto to put detour's drop-in in place on "+n.Name, 2*time.Minute, func() (bool, error) {
			_, err := os.Stat(framework.NodeDropIn(n))
			return err == nil && !strings.Contains(framework.ReadFile(n.PrimaryConfigPath()), "detour-cni"), framework.Seen("drop-in: %v", err)
		})
	}
}

// ciliumExclusive: cni.exclusive on, Cilium's default, set with a helm upgrade of Cilium's
// values and the agents' restart. The agent renames every configuration file in the conf dir
// but its own to *.cilium_bak, and watches the directory to do it again. detour's drop-in lives
// in a subdirectory, which Cilium leaves alone: the drop-in stays, nothing of detour's is
// renamed, and pods created while the agents restart all get their rules. detour's entry in
// Cilium's conflist is another matter: each time the node agent writes it, Cilium sees the
// directory change and writes its own content again.
func ciliumExclusive(t *testing.T, ctx context.Context, e *framework.Env, nodes []*framework.Node) {
	if err := e.Node.SetCilium(ctx, framework.CiliumConfig{Exclusive: true}); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := e.Node.SetCilium(ctx, framework.CiliumConfig{}); err != nil {
			t.Errorf("set cni.exclusive back to false: %v", err)
		}
	}()
	for _, n := range nodes {
		if !strings.Contains(framework.ReadFile(filepath.Join(n.Dir, "cilium", "config-map", "cni-exclusive")), "true") {
			t.Fatalf("node %s: the agent's configuration does not say cni-exclusive true", n.Name)
		}
	}
	writes := ciliumWritesAll(nodes)
	dropIn := ciliumChurn(t, ctx, e, "churn-exclusive", nodes)
	dropInWrites := ciliumWritesAll(nodes) - writes
	if dropIn.failed != 0 {
		t.Errorf("cni.exclusive true, with the drop-in: %d of %d pods started without rules while cilium-agent restarted on every node", dropIn.failed, dropIn.pods)
	}
	for _, n := range nodes {
		if _, err := os.Stat(framework.NodeDropIn(n)); err != nil {
			t.Errorf("node %s: detour's drop-in is gone with cni.exclusive: %v", n.Name, err)
		}
		if baks, _ := filepath.Glob(filepath.Join(n.CNIConfDir, "*.cilium_bak")); len(baks) != 0 {
			t.Errorf("node %s: Cilium renamed %v away", n.Name, baks)
		}
	}
	t.Logf("cni.exclusive true, cilium-agent restarted on %d nodes: with the drop-in %d of %d pods started without rules (%d restarts, %d conflist writes by Cilium)",
		len(nodes), dropIn.failed, dropIn.pods, dropIn.rewrites, dropInWrites)

	// The in-file entry under cni.exclusive: each time the node agent writes its entry, Cilium
	// writes its own content again. The agent notices the war and refuses (no more writes, an
	// Event with the fix); after that the file is Cilium's alone.
	writes = ciliumWritesAll(nodes)
	start := time.Now()
	e.InstallDetourRefused(t, ctx, "nodeAgent: {cniConfigMode: chained-entry}\n")
	defer func() {
		e.InstallDetour(t, ctx, "")
		waitDropIn(t, ctx, e, nodes)
	}()
	// The DaemonSet's rolling update replaces the agents a node at a time; one that refuses
	// never becomes Ready, so the rollout stops there and the other nodes keep the drop-in.
	refused := map[string]time.Duration{}
	readRefusals := func() error {
		refusals, err := entryWarRefusals(ctx, e, start)
		for _, r := range refusals {
			if _, ok := refused[r.Node]; !ok && strings.Contains(r.Message, "cni.exclusive=false") {
				refused[r.Node] = r.At.Sub(start)
			}
		}
		return err
	}
	framework.WaitFor(t, ctx, "the node agent to refuse Cilium's cni.exclusive on "+e.Node.Name, 3*time.Minute, func() (bool, error) {
		_, ok := refused[e.Node.Name]
		return ok, cmp.Or(readRefusals(), framework.Seen("refused on %v", refused))
	})
	// Every node ends either refused or untouched, with detour's drop-in (the rollout stopped
	// before it); none is left without either.
	var refusing, kept []*framework.Node
	framework.WaitFor(t, ctx, "every node refused or still with detour's drop-in", 2*time.Minute, func() (bool, error) {
		if err := readRefusals(); err != nil {
			return false, err
		}
		refusing, kept = nil, nil
		var neither []string
		for _, n := range nodes {
			_, err := os.Stat(framework.NodeDropIn(n))
			switch _, ok := refused[n.Name]; {
			case ok:
				refusing = append(refusing, n)
			case err == nil:
				kept = append(kept, n)
			default:
				neither = append(neither, n.Name)
			}
		}
		pods, _ := e.Pods(ctx, framework.DetourNamespace, "app.kubernetes.io/component=node-agent")
		var states []string
		for _, p := range pods {
			states = append(states, fmt.Sprintf("%s on %s: %s %s", p.Name, p.Spec.NodeName, p.Status.Phase, framework.ContainerStates(&p)))
		}
		return len(neither) == 0, framework.Seen("neither refused nor with the drop-in: %v; agents: %v", neither, states)
	})
	warWrites := ciliumWritesAll(nodes) - writes
	n := e.Node
	writes = ciliumWrites(n)
	deadline := time.Now().Add(20 * time.Second)
	samples, with := 0, 0
	for time.Now().Before(deadline) && ctx.Err() == nil {
		samples++
		if strings.Contains(framework.ReadFile(n.PrimaryConfigPath()), "detour-cni") {
			with++
		}
		time.Sleep(20 * time.Millisecond)
	}
	quiet := ciliumWrites(n) - writes
	t.Logf("cni.exclusive true, in-file entry: refused after %v (from the chart's upgrade; %d conflist writes by Cilium until then), the rollout stopped there (%d nodes kept the drop-in); the next 20 s on %s: %d Cilium writes, detour's entry in the file in %d of %d samples",
		refused, warWrites, len(kept), n.Name, quiet, with, samples)
	if quiet > 2 || with != 0 {
		t.Errorf("after the refusal Cilium still wrote its conflist %d times in 20 s, and detour's entry was in it in %d of %d samples: the war goes on", quiet, with, samples)
	}
	t.Logf("the node agent's log ends with:\n%s", framework.Tail(e.AgentLog(t, ctx), 15))
	// Pods created on a refusing node start without detour (fail closed: their check says so,
	// exit 42).
	entry := podWaves(t, ctx, e, "exclusive-entry", refusing, func() int {
		framework.SleepCtx(ctx, 30*time.Second)
		return 0
	})
	e.DropNamespaces(t, ctx, "exclusive-entry")
	t.Logf("cni.exclusive true, in-file entry, refused on %d nodes, 30 s: %d of %d pods there started without rules, each caught by its check", len(refusing), entry.failed, entry.pods)
	if entry.failed != entry.pods {
		t.Errorf("%d of %d pods passed their check on nodes where detour refused", entry.pods-entry.failed, entry.pods)
	}
}

// ciliumSocketLB: with kube-proxy replacement, Cilium load-balances a Service at connect(), in
// the namespace of the process that connects. In a meshed pod that comes before detour's
// redirect: the client's connection to a ClusterIP reaches its proxy with a backend pod's IP as
// the original destination, and the proxy cannot route by Service. `detour check --cluster`
// reads it from cilium-config and fails its primary-cni check with the fix,
// socketLB.hostNamespaceOnly=true. With the fix (a helm upgrade of Cilium's values and the
// agents' restart), the check passes, and a new client's connection to the same ClusterIP
// reaches its proxy with the ClusterIP as the original destination; Cilium translates it
// after the pod, on the packets the proxy sends.
func ciliumSocketLB(t *testing.T, ctx context.Context, e *framework.Env) {
	n := e.Node
	if mode := kubeProxyMode(ctx, n); mode == "nftables" || mode == "iptables" || mode == "ipvs" {
		t.Errorf("kube-proxy runs on %s in mode %s beside Cilium's kube-proxy replacement", n.Name, mode)
	}
	ciliumSetting(t, n, "kube-proxy-replacement", "true")
	ciliumSetting(t, n, "bpf-lb-sock-hostns-only", "false")

	const ns = "socket-lb"
	e.Namespace(t, ctx, ns, true)
	defer e.DropNamespaces(t, ctx, ns)
	if _, err := n.Client.CoreV1().Pods(ns).Create(ctx, e.Pod("web", ns), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	svc, err := n.Client.CoreV1().Services(ns).Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: ns},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"name": "web"},
			Ports:    []corev1.ServicePort{{Port: 80, TargetPort: intstr.FromInt32(8080)}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	clusterIP := net.JoinHostPort(svc.Spec.ClusterIP, "80")
	web := e.WaitReady(t, ctx, ns, "name=web", 1)[0]
	backend := net.JoinHostPort(web.Status.PodIP, "8080")

	// Socket LB in the pods' namespaces: the check fails with the fix, and the proxy sees the
	// backend.
	report, failed := e.CheckCluster(t, ctx)
	framework.WantCheck(t, report, "primary-cni", clustercheck.Error, "load-balances Services at connect() inside the pods")
	res, _ := report.Result("primary-cni")
	if !strings.Contains(res.Fix, "socketLB.hostNamespaceOnly=true") {
		t.Errorf("check primary-cni: the fix %q does not say socketLB.hostNamespaceOnly=true", res.Fix)
	}
	if !failed {
		t.Errorf("detour check --cluster exited 0 with socket load balancing in the pods' namespaces: %+v", report.Results)
	}
	t.Logf("socket LB in the pods' namespaces: detour check --cluster %s %s\n    fix: %s", res.Status.Symbol(), res.Message, res.Fix)
	before := ciliumClientDests(t, ctx, e, ns, "client-before", clusterIP)
	if !slices.Contains(before, backend) || slices.Contains(before, clusterIP) {
		t.Errorf("socket LB in the pods' namespaces: the client's proxy saw original destinations %v for its connection to the ClusterIP %s, want the backend %s and not the ClusterIP", before, clusterIP, backend)
	}

	began := time.Now()
	if err := n.SetCilium(ctx, framework.CiliumConfig{KubeProxyReplacement: true, SocketLBHostNamespaceOnly: true}); err != nil {
		t.Fatal(err)
	}
	t.Logf("socketLB.hostNamespaceOnly=true: cilium-agent healthy again %s after the helm upgrade", time.Since(began).Round(100*time.Millisecond))
	ciliumSetting(t, n, "bpf-lb-sock-hostns-only", "true")

	// Socket LB in the host's namespace only: the check passes, and the proxy sees the
	// ClusterIP.
	report, failed = e.CheckCluster(t, ctx)
	framework.WantCheck(t, report, "primary-cni", clustercheck.OK, "socket load balancing stays in the host's namespace")
	if failed {
		t.Errorf("detour check --cluster failed with socketLB.hostNamespaceOnly=true: %+v", report.Results)
	}
	res, _ = report.Result("primary-cni")
	t.Logf("socketLB.hostNamespaceOnly=true: detour check --cluster %s %s (%d errors, %d warnings)", res.Status.Symbol(), res.Message, report.Errors, report.Warnings)
	after := ciliumClientDests(t, ctx, e, ns, "client-after", clusterIP)
	if !slices.Contains(after, clusterIP) || slices.Contains(after, backend) {
		t.Errorf("socketLB.hostNamespaceOnly=true: the client's proxy saw original destinations %v for its connection to the ClusterIP %s, want the ClusterIP and not the backend %s", after, clusterIP, backend)
	}
	t.Logf("a meshed client's connection to the ClusterIP %s (backend %s) reached its proxy with original destination %v with socket LB in the pods' namespaces, %v with socketLB.hostNamespaceOnly=true",
		clusterIP, backend, before, after)
}

// ciliumSetting fails t unless the agent on n reads key of cilium-config as want (its config
// dir, as the kubelet would project the ConfigMap into its pod).
func ciliumSetting(t *testing.T, n *framework.Node, key, want string) {
	t.Helper()
	if got := strings.TrimSpace(framework.ReadFile(filepath.Join(n.Dir, "cilium", "config-map", key))); got != want {
		t.Fatalf("node %s: the agent's configuration says %s %q, want %q", n.Name, key, got, want)
	}
}

// ciliumClientDests creates a meshed client pod, name in ns, whose app dials target once, and
// returns the original destinations its proxy logged for the app's outbound connections (the
// test server's, which the pod's init container dials, left out).
func ciliumClientDests(t *testing.T, ctx context.Context, e *framework.Env, ns, name, target string) []string {
	t.Helper()
	client := e.Pod(name, ns)
	client.Spec.Containers[0].Args = []string{"dial", "-must", "-retry", "60s", "-addr", target, "then", "sleep"}
	client.Spec.Containers[0].ReadinessProbe = nil
	client.Spec.RestartPolicy = corev1.RestartPolicyNever
	if _, err := e.Node.Client.CoreV1().Pods(ns).Create(ctx, client, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	framework.WaitFor(t, ctx, name+" to reach "+target, 2*time.Minute, func() (bool, error) {
		p, err := e.Node.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if p.Status.Phase == corev1.PodFailed {
			return false, fmt.Errorf("%s failed: %s", name, e.Logs(ctx, ns, name, "app"))
		}
		log := e.Logs(ctx, ns, name, "app")
		return strings.Contains(log, "dial "+target+" ok: web"), framework.Seen("%s is %s; its app logged %q", name, p.Status.Phase, log)
	})
	p, err := e.Node.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !annotations.IsInjected(p.Annotations) {
		t.Fatalf("%s is not injected: %v", name, p.Annotations)
	}
	var dests []string
	framework.WaitFor(t, ctx, "the proxy of "+name+" to log the app's connection", 30*time.Second, func() (bool, error) {
		proxyLog := e.LogsAll(ctx, ns, name, "detour-proxy")
		dests = proxyDests(proxyLog, e.Server)
		return len(dests) > 0, framework.Seen("its log:\n%s", proxyLog)
	})
	return dests
}

// proxyDests are the original destinations of the outbound connections in a test proxy's log
// ("proxy outbound <peer> -> <destination>[ failed: ...]"), each once, in the order of the
// log, but skip.
func proxyDests(log, skip string) []string {
	var dests []string
	for line := range strings.SplitSeq(log, "\n") {
		rest, ok := strings.CutPrefix(line, "proxy outbound ")
		if !ok {
			continue
		}
		_, dst, ok := strings.Cut(rest, " -> ")
		if !ok {
			continue
		}
		dst, _, _ = strings.Cut(dst, " ")
		if dst != skip && !slices.Contains(dests, dst) {
			dests = append(dests, dst)
		}
	}
	return dests
}
