package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/test/e2e/framework"
)

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
