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

	"github.com/detourmesh/detour/test/e2e/framework"
)

// clusterStory is a story of a cluster rather than a node (issue 22): it runs with node B
// joined (see onCluster).
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
