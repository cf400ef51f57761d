package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/test/e2e/framework"
)

// clusterStory is a story of a cluster rather than a node (issue 22): it runs with node B
// joined (see [env.onCluster]).
type clusterStory struct {
	name string
	run  func(*testing.T, context.Context, *framework.Env, *framework.Node)
}

// clusterSmoke is TestE2E's share of the cluster stories, and so CI's: a node joins and the
// cross-node story runs. TestE2ECluster (make e2e-cluster) runs every cluster story; CI's
// time on a fresh machine is the reason for the split (docs/development.md).
func clusterSmoke(t *testing.T, ctx context.Context, e *framework.Env) {
	onCluster(t, ctx, e, []clusterStory{{"cross-node", clusterCrossNode}})
}

// onCluster runs stories on a cluster: detour is installed from its OCI chart in the
// cluster's registry, every image is pulled from there, and a second node, B, joins as an
// admin's node pool would add it. The nodes leave at the end, and detour is installed again
// from the chart's directory with the imported images, as the stories after these expect.
func onCluster(t *testing.T, ctx context.Context, e *framework.Env, stories []clusterStory) {
	e.UseRegistry(t, ctx)
	defer e.UseImported(t, ctx)
	b := e.Join(t, ctx, "e2e-node-b")
	// B leaves before detour goes back to the imported images, which B does not have.
	defer e.Remove(t, b)
	defer e.Uncordon(t, ctx, e.Node.Name)
	for _, s := range stories {
		if !t.Run(s.name, func(t *testing.T) { s.run(t, ctx, e, b) }) && ctx.Err() != nil {
			return
		}
	}
}

// clusterCrossNode: a second node joins the running cluster; injected and uninjected clients
// on the control-plane node call injected and uninjected servers on the new node by pod IP.
// Each connection is proven from both ends: the client's proxy logs the server's pod IP as the
// original destination, the server's proxy logs the client's pod IP as the peer it accepted
// and hands the connection to its app on loopback; an uninjected end sees the other's pod IP,
// so nothing between the nodes translated the addresses.
func clusterCrossNode(t *testing.T, ctx context.Context, e *framework.Env, b *framework.Node) {
	e.Namespace(t, ctx, "cross", true)
	e.Namespace(t, ctx, "cross-plain", false)
	defer e.DropNamespaces(t, ctx, "cross", "cross-plain")

	// The servers, on node B.
	servers := map[string]*corev1.Pod{}
	for _, s := range []struct{ name, ns string }{{"server", "cross"}, {"server-plain", "cross-plain"}} {
		p := framework.OnNode(e.Pod(s.name, s.ns), b.Name)
		if _, err := e.Node.Client.CoreV1().Pods(s.ns).Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for _, s := range []struct{ name, ns string }{{"server", "cross"}, {"server-plain", "cross-plain"}} {
		p := e.WaitReady(t, ctx, s.ns, "name="+s.name, 1)[0]
		if ip, err := netip.ParseAddr(p.Status.PodIP); err != nil || p.Spec.NodeName != b.Name || !b.PodSubnet.Contains(ip) {
			t.Fatalf("%s runs on %s with IP %s, not on %s in %s", p.Name, p.Spec.NodeName, p.Status.PodIP, b.Name, b.PodSubnet)
		}
		servers[s.ns] = &p
	}

	cases := []struct {
		name, clientNS, serverNS string
	}{
		{"both-injected", "cross", "cross"},
		{"server-uninjected", "cross", "cross-plain"},
		{"client-uninjected", "cross-plain", "cross"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			server := servers[c.serverNS]
			target := server.Status.PodIP + ":8080"
			name := "client-" + c.name
			client := framework.OnNode(e.Pod(name, c.clientNS), e.Node.Name)
			client.Spec.Containers[0].Args = []string{"dial", "-must", "-retry", "30s", "-addr", target, "then", "sleep"}
			client.Spec.Containers[0].ReadinessProbe = nil
			client.Spec.RestartPolicy = corev1.RestartPolicyNever
			if _, err := e.Node.Client.CoreV1().Pods(c.clientNS).Create(ctx, client, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			var clientPod *corev1.Pod
			var reply string
			framework.WaitFor(t, ctx, name+" to reach "+target, 2*time.Minute, func() (bool, error) {
				p, err := e.Node.Client.CoreV1().Pods(c.clientNS).Get(ctx, name, metav1.GetOptions{})
				if err != nil {
					return false, err
				}
				if p.Status.Phase == corev1.PodFailed {
					return false, fmt.Errorf("%s failed: %s", name, e.Logs(ctx, c.clientNS, name, "app"))
				}
				clientPod = p
				for line := range strings.SplitSeq(e.Logs(ctx, c.clientNS, name, "app"), "\n") {
					if after, ok := strings.CutPrefix(line, "dial "+target+" ok: "); ok {
						reply = after
					}
				}
				return reply != "", framework.Seen("%s is %s", name, p.Status.Phase)
			})
			if ip, err := netip.ParseAddr(clientPod.Status.PodIP); err != nil || clientPod.Spec.NodeName != e.Node.Name || !e.Node.PodSubnet.Contains(ip) {
				t.Fatalf("%s runs on %s with IP %s, not on %s", name, clientPod.Spec.NodeName, clientPod.Status.PodIP, e.Node.Name)
			}
			clientInjected, serverInjected := c.clientNS == "cross", c.serverNS == "cross"
			// The client's side.
			clientProxy := e.Logs(ctx, c.clientNS, name, "detour-proxy")
			if clientInjected && !strings.Contains(clientProxy, "proxy outbound "+clientPod.Status.PodIP) || clientInjected && !strings.Contains(clientProxy, "-> "+target) {
				t.Errorf("the client's proxy did not carry its connection to %s:\n%s", target, clientProxy)
			}
			// The server's side: its app sees loopback when its proxy took the connection,
			// the client's pod IP otherwise.
			wantPeer := "peer=" + clientPod.Status.PodIP + ":"
			if serverInjected {
				wantPeer = "peer=127.0.0.1:"
			}
			if !strings.Contains(reply, wantPeer) {
				t.Errorf("the server's app saw %q, want %s", reply, wantPeer)
			}
			if serverInjected {
				serverProxy := e.Logs(ctx, c.serverNS, server.Name, "detour-proxy")
				want := fmt.Sprintf("proxy inbound %s:", clientPod.Status.PodIP)
				if !strings.Contains(serverProxy, want) {
					t.Errorf("the server's proxy logged no inbound connection from %s:\n%s", clientPod.Status.PodIP, serverProxy)
				}
			}
		})
	}

	// Each node's plugin handled its own pods: B's redirected B's server and saw no client.
	for _, l := range framework.PluginLogAt(framework.NodePluginLog(b), "ADD", "") {
		if strings.HasPrefix(l.Pod, "cross/client") || strings.HasPrefix(l.Pod, "cross-plain/client") {
			t.Errorf("node B's detour-cni handled %s, a pod of node A", l.Pod)
		}
	}
	if l := framework.PluginLogAt(framework.NodePluginLog(b), "ADD", "redirected"); !slices.ContainsFunc(l, func(l framework.PluginEntry) bool { return l.Pod == "cross/server" }) {
		t.Errorf("node B's detour-cni did not redirect cross/server: %v", l)
	}
	if _, err := os.Stat(b.PrimaryConfigPath()); err != nil {
		t.Errorf("node B has no primary conflist of its own: %v", err)
	}
}

// clusterPerNodeScoping: each node agent acts on its own node only. A token of node A's agent
// (bound to its pod, as the kubelet gets it) may patch A but not B, and may not delete B's
// pods: the API refuses with the chart's policy's message. With B broken — its agent gone
// and detour's configuration removed from it — B's new injected pods fail their validators
// and A's repair leaves them alone; A's pods are untouched; B's agent, back, repairs them.
func clusterPerNodeScoping(t *testing.T, ctx context.Context, e *framework.Env, b *framework.Node) {
	agentA, err := e.AgentPod(ctx, e.Node.Name)
	if err != nil || agentA == nil {
		t.Fatalf("no node agent on %s: %v", e.Node.Name, err)
	}
	stdout, stderr, err := e.Node.Kubectl(ctx, "create", "token", "detour-node-agent", "-n", framework.DetourNamespace,
		"--bound-object-kind", "Pod", "--bound-object-name", agentA.Name, "--duration", "10m")
	if err != nil {
		t.Fatalf("create a token bound to %s: %v\n%s", agentA.Name, err, stderr)
	}
	cfg := rest.AnonymousClientConfig(e.Node.Config)
	cfg.BearerToken = strings.TrimSpace(stdout)
	asAgentA, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	label := []byte(`{"metadata":{"labels":{"e2e.detour.dev/scoping":"probe"}}}`)
	unlabel := []byte(`{"metadata":{"labels":{"e2e.detour.dev/scoping":null}}}`)
	if _, err := asAgentA.CoreV1().Nodes().Patch(ctx, e.Node.Name, types.MergePatchType, label, metav1.PatchOptions{}); err != nil {
		t.Errorf("node A's agent may not patch its own node: %v", err)
	}
	asAgentA.CoreV1().Nodes().Patch(ctx, e.Node.Name, types.MergePatchType, unlabel, metav1.PatchOptions{})
	_, err = asAgentA.CoreV1().Nodes().Patch(ctx, b.Name, types.MergePatchType, label, metav1.PatchOptions{})
	wantRefused(t, "node A's agent patching node B", err, "the node agent of node "+e.Node.Name+" may not change node "+b.Name)

	e.Namespace(t, ctx, "scoping", true)
	defer e.DropNamespaces(t, ctx, "scoping")
	bPod := framework.OnNode(e.Pod("on-b", "scoping"), b.Name)
	if _, err := e.Node.Client.CoreV1().Pods("scoping").Create(ctx, bPod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	e.WaitReady(t, ctx, "scoping", "name=on-b", 1)
	err = asAgentA.CoreV1().Pods("scoping").Delete(ctx, "on-b", metav1.DeleteOptions{})
	wantRefused(t, "node A's agent deleting a pod of node B", err, "the node agent of node "+e.Node.Name+" may not change pods of another node")

	// B breaks: its agent goes, then detour's configuration (the agent leaves it on purpose
	// when only its pod goes).
	e.SetNodeAgent(t, ctx, b, false)
	if err := os.RemoveAll(filepath.Join(b.CNIConfDir, framework.PrimaryNetwork)); err != nil {
		t.Fatal(err)
	}
	if err := b.WritePrimaryConfig(); err != nil {
		t.Fatal(err)
	}
	aPod := framework.OnNode(e.Pod("on-a", "scoping"), e.Node.Name)
	if _, err := e.Node.Client.CoreV1().Pods("scoping").Create(ctx, aPod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Node.Client.AppsV1().Deployments("scoping").Create(ctx, framework.OnNodeDeployment(e.Deployment("broken", "scoping", 2), b.Name), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	failing := map[string]types.UID{}
	framework.WaitFor(t, ctx, "B's new pods to fail their validators", 2*time.Minute, func() (bool, error) {
		pods, err := e.Pods(ctx, "scoping", "app=broken")
		if err != nil {
			return false, err
		}
		for _, p := range pods {
			if framework.CheckExit(&p) == 42 {
				failing[p.Name] = p.UID
			}
		}
		return len(failing) == 2, framework.Seen("failed validators: %v", failing)
	})
	// Several of A's repair passes (resync 2 s): B's failing pods stay, A's pod runs.
	framework.SleepCtx(ctx, 15*time.Second)
	pods, err := e.Pods(ctx, "scoping", "app=broken")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pods {
		if uid, ok := failing[p.Name]; !ok || uid != p.UID || p.DeletionTimestamp != nil {
			t.Errorf("pod %s of node B was deleted or replaced while B had no agent (A's repair acted on it?)", p.Name)
		}
	}
	if len(pods) != 2 {
		t.Errorf("node B's Deployment has %d pods, want the 2 failing ones", len(pods))
	}
	a := e.WaitReady(t, ctx, "scoping", "name=on-a", 1)[0]
	if framework.CheckExit(&a) != 0 {
		t.Errorf("pod on-a of node A did not pass its validator while B was broken: %d", framework.CheckExit(&a))
	}
	if _, err := os.Stat(e.DropInPath()); err != nil {
		t.Errorf("node A lost detour's configuration while B's agent went: %v", err)
	}

	// B's agent comes back and repairs B's pods.
	e.SetNodeAgent(t, ctx, b, true)
	replaced := e.WaitReady(t, ctx, "scoping", "app=broken", 2)
	for _, p := range replaced {
		if _, stale := failing[p.Name]; stale {
			t.Errorf("pod %s of node B was not recreated by B's repair", p.Name)
		}
	}
}

// clusterRewrites: the primary rewrites its conflist on every node at once (atomic renames and
// in-place writes, content changed and unchanged, 50 times each) while injected pods are
// created on both nodes: not one starts without its rules.
func clusterRewrites(t *testing.T, ctx context.Context, e *framework.Env, b *framework.Node) {
	res := churn(t, ctx, e, "churn-cluster", e.Node, b)
	defer e.DropNamespaces(t, ctx, "churn-cluster")
	t.Logf("churn on %s and %s: %d of %d pods started without rules during %d rewrites of each node's conflist",
		e.Node.Name, b.Name, res.failed, res.pods, res.rewrites)
	if res.failed != 0 {
		t.Errorf("%d of %d pods started without rules while both nodes' primaries rewrote their conflists", res.failed, res.pods)
	}
	for _, n := range []*framework.Node{e.Node, b} {
		dropIn := framework.NodeDropIn(n)
		if _, err := os.Stat(dropIn); err != nil {
			t.Errorf("node %s: detour's drop-in is gone after the rewrites: %v", n.Name, err)
		}
	}
}

// wantRefused checks that err is the API server's refusal carrying message.
func wantRefused(t testing.TB, what string, err error, message string) {
	t.Helper()
	switch {
	case err == nil:
		t.Errorf("%s: allowed, want refused with %q", what, message)
	case !apierrors.IsForbidden(err) && !apierrors.IsInvalid(err):
		t.Errorf("%s: %v, want a refusal with %q", what, err, message)
	case !strings.Contains(err.Error(), message):
		t.Errorf("%s: refused with %q, want %q", what, err, message)
	}
}

// clusterDrain: `kubectl drain` node B while injected pods of a Deployment run there: they come
// back on node A with their redirect, proven by a connection through each one's proxy.
func clusterDrain(t *testing.T, ctx context.Context, e *framework.Env, b *framework.Node) {
	defer e.Uncordon(t, ctx, b.Name)
	e.Namespace(t, ctx, "drain", true)
	defer e.DropNamespaces(t, ctx, "drain")
	e.Cordon(t, ctx, e.Node.Name)
	if _, err := e.Node.Client.AppsV1().Deployments("drain").Create(ctx, e.Deployment("web", "drain", 2), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, p := range e.WaitReady(t, ctx, "drain", "app=web", 2) {
		if p.Spec.NodeName != b.Name {
			t.Fatalf("pod %s runs on %s with A cordoned", p.Name, p.Spec.NodeName)
		}
	}
	e.Uncordon(t, ctx, e.Node.Name)
	start := time.Now()
	if out, stderr, err := e.Node.Kubectl(ctx, "drain", b.Name, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout", "3m"); err != nil {
		t.Fatalf("kubectl drain %s: %v\n%s\n%s", b.Name, err, out, stderr)
	}
	moved := e.WaitReady(t, ctx, "drain", "app=web", 2)
	t.Logf("the drained pods were Ready again on %s %s after kubectl drain began", e.Node.Name, time.Since(start).Round(100*time.Millisecond))
	for _, p := range moved {
		if p.Spec.NodeName != e.Node.Name {
			t.Errorf("pod %s runs on %s after the drain, want %s", p.Name, p.Spec.NodeName, e.Node.Name)
		}
		if code := framework.CheckExit(&p); code != 0 {
			t.Errorf("pod %s: validator %d after the drain", p.Name, code)
		}
		e.AssertCaptured(t, ctx, p, "app")
	}
	// The agent stays on the drained node (DaemonSet pods are not evicted), with detour's
	// configuration: the node is cordoned, not uninstalled.
	if agent, err := e.AgentPod(ctx, b.Name); err != nil || agent == nil || agent.DeletionTimestamp != nil {
		t.Errorf("the node agent left the drained node %s: %v", b.Name, framework.AgentState(agent))
	}
	if _, err := os.Stat(framework.NodeDropIn(b)); err != nil {
		t.Errorf("the drained node lost detour's configuration: %v", err)
	}
}

// clusterRemoval: node B is drained and its Node object deleted, as a node pool scaling in
// removes a node, its kubelet still running: the agent takes detour off B's disk (drop-in,
// binary, kubeconfig, token) before the pod garbage collector deletes its pod, and the
// control-plane node keeps its configuration.
func clusterRemoval(t *testing.T, ctx context.Context, e *framework.Env, b *framework.Node) {
	before, err := detourFiles(b)
	if err != nil || len(before) == 0 {
		t.Fatalf("nothing of detour on %s before its removal (%v): the story proves nothing", b.Name, err)
	}
	if out, stderr, err := e.Node.Kubectl(ctx, "drain", b.Name, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout", "3m"); err != nil {
		t.Fatalf("kubectl drain %s: %v\n%s\n%s", b.Name, err, out, stderr)
	}
	if agent, err := e.AgentPod(ctx, b.Name); err != nil || agent == nil || !framework.PodReady(agent) {
		t.Fatalf("the node agent on %s is %s (%v): nothing would remove detour", b.Name, framework.AgentState(agent), err)
	}
	logs, err := e.HoldAgentLogs(ctx, b) // read from B's disk: without its Node, no kubectl logs
	if err != nil {
		t.Fatal(err)
	}
	defer logs.Close()
	b.ExpectExit("kube-proxy") // it exits when its Node is deleted
	start := time.Now()
	if out, stderr, err := e.Node.Kubectl(ctx, "delete", "node", b.Name); err != nil {
		t.Fatalf("kubectl delete node %s: %v\n%s\n%s", b.Name, err, out, stderr)
	}
	err = framework.Poll(ctx, time.Minute, func() (bool, error) {
		left, err := detourFiles(b)
		return err == nil && len(left) == 0, framework.Seen("left: %v (%v)", left, err)
	})
	if err != nil {
		t.Fatalf("detour is still on %s's disk a minute after its Node was deleted: %v\nthe agent's log:\n%s", b.Name, err, framework.Tail(logs.Read(), 30))
	}
	t.Logf("node %s deleted: nothing of detour on its disk %s later (before it: %d files)", b.Name, time.Since(start).Round(100*time.Millisecond), len(before))
	// The agent did it as it saw the Node go: its pod's deletion by the garbage collector comes
	// later, and its SIGTERM, with the DaemonSet in place, would leave everything.
	if log := logs.Read(); !strings.Contains(log, "the node's Node object is deleted") || strings.Contains(log, "SIGTERM") {
		t.Errorf("the agent on %s does not say it removed detour because the Node was deleted, or did at SIGTERM:\n%s", b.Name, framework.Tail(log, 20))
	}
	if left, err := e.DetourConfigs(); err != nil || len(left) == 0 {
		t.Errorf("the control-plane node lost detour's configuration with %s's removal: %v %v", b.Name, left, err)
	}
}

// detourFiles lists what the node agent writes on n's disk that is still there: in the CNI
// conf dir (recursively) a file named for detour or naming detour-cni, in the bin dir the plugin.
func detourFiles(n *framework.Node) ([]string, error) {
	var found []string
	err := filepath.WalkDir(n.CNIConfDir, func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if strings.Contains(d.Name(), "detour") || strings.Contains(string(data), "detour-cni") {
			found = append(found, path)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	bins, err := filepath.Glob(filepath.Join(n.CNIBinDir, "*detour*"))
	return append(found, bins...), err
}

// clusterScaleOut is seed 000 as its reporter saw it: a node pool at capacity (every node
// cordoned) with 20 injected replicas Pending; a node joins. With detour's startup taint in its
// registration (docs/operations.md), every replica lands on the new node only once the agent
// has chained detour there: no validator fails and repair deletes nothing. Without the taint,
// the replicas that slip through before the agent are caught by their validators and repaired;
// the story reports how many, and how long until all 20 run with their redirect.
func clusterScaleOut(t *testing.T, ctx context.Context, e *framework.Env, b *framework.Node) {
	e.Cordon(t, ctx, e.Node.Name, b.Name)
	defer e.Uncordon(t, ctx, b.Name)
	// The new node pulls the agent's image as from a remote registry (10 s), not in the
	// milliseconds of the registry beside it: the window in which seed 000's pods slipped in.
	e.Registry.Slow("detour", agentPullDelay)
	defer e.Registry.Slow("detour", 0)
	for _, c := range []struct {
		node  string
		taint bool
	}{{"e2e-node-c", true}, {"e2e-node-d", false}} {
		t.Run(map[bool]string{true: "with-startup-taint", false: "without-startup-taint"}[c.taint], func(t *testing.T) {
			ns := "scale-" + c.node[len(c.node)-1:]
			e.Namespace(t, ctx, ns, true)
			defer e.DropNamespaces(t, ctx, ns)
			const replicas = 20
			// The check in the validator init container: where it runs at the proxy's start
			// (the default here), the pods select detour.dev/image-volumes=true, which only
			// the agent sets, and wait for it without the taint too.
			dep := e.Deployment("web", ns, replicas)
			dep.Spec.Template.Annotations = map[string]string{annotations.ValidatorMode: string(annotations.ValidatorInitContainer)}
			if _, err := e.Node.Client.AppsV1().Deployments(ns).Create(ctx, dep, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			framework.WaitFor(t, ctx, "20 replicas Pending on a full node pool", 2*time.Minute, func() (bool, error) {
				pods, err := e.Pods(ctx, ns, "app=web")
				if err != nil {
					return false, err
				}
				pending := 0
				for _, p := range pods {
					if p.Spec.NodeName == "" && p.Status.Phase == corev1.PodPending {
						pending++
					}
				}
				return pending == replicas, framework.Seen("%d of %d pending", pending, len(pods))
			})
			var w *framework.PodWatcher
			start := time.Now()
			opts := framework.Options{Labels: []string{framework.AgentLabel + "=yes"}}
			if c.taint {
				opts.Taints = []string{framework.StartupTaint + ":NoSchedule"}
			}
			w = e.WatchPods(ctx, ns)
			defer w.Stop()
			n := e.JoinNode(t, ctx, c.node, opts)
			defer func() {
				// The pods go first, so that their sandboxes are torn down by the node.
				e.Node.Client.AppsV1().Deployments(ns).Delete(ctx, "web", metav1.DeleteOptions{})
				framework.Poll(ctx, 2*time.Minute, func() (bool, error) {
					pods, err := e.Pods(ctx, ns, "app=web")
					return err == nil && len(pods) == 0, err
				})
				e.Remove(t, n)
			}()
			joined := time.Since(start)
			var ready []corev1.Pod
			framework.WaitFor(t, ctx, "all 20 replicas Ready on the new node", 6*time.Minute, func() (bool, error) {
				pods, err := e.Pods(ctx, ns, "app=web")
				if err != nil {
					return false, err
				}
				ready = ready[:0]
				for _, p := range pods {
					if p.DeletionTimestamp == nil && framework.PodReady(&p) && framework.CheckExit(&p) == 0 {
						ready = append(ready, p)
					}
				}
				return len(ready) == replicas, framework.Seen("%d ready", len(ready))
			})
			allReady := time.Since(start)
			caught, created := w.Result()
			for _, p := range ready {
				if p.Spec.NodeName != c.node {
					t.Errorf("pod %s runs on %s, want %s", p.Name, p.Spec.NodeName, c.node)
				}
			}
			t.Logf("node %s (startup taint %v): joined (containerd and kubelet started, node Ready) in %s; all %d replicas Ready with their redirect %s after it began to join; validators that failed: %d; pods created in all: %d (%d replaced by repair)",
				c.node, c.taint, joined.Round(100*time.Millisecond), replicas, allReady.Round(100*time.Millisecond), caught, created, created-replicas)
			if c.taint && (caught != 0 || created != replicas) {
				t.Errorf("with the startup taint: %d validators failed and %d pods were created for %d replicas, want 0 and %d", caught, created, replicas, replicas)
			}
			// Every replica that runs was given its redirect by the new node's plugin.
			last := map[string]framework.PluginEntry{}
			for _, l := range framework.PluginLogAt(framework.NodePluginLog(n), "ADD", "") {
				last[l.Pod] = l
			}
			for _, p := range ready {
				if l := last[ns+"/"+p.Name]; l.Decision != "redirected" || l.Error != "" {
					t.Errorf("node %s's detour-cni: last ADD of %s decided %q (error %q), want redirected", c.node, p.Name, l.Decision, l.Error)
				}
			}
		})
	}
}

// agentPullDelay is how long a new node's pull of detour's image takes in the scale-out story.
const agentPullDelay = 10 * time.Second
