package e2e

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/mutate"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/test/images"
)

// useRegistry moves the e2e to the cluster's registry, starting it on first use: the test
// images are pushed there, detour's image by `make image-push` and its chart by `helm push`
// (both run on the control-plane node, where the registry's address is reachable); detour is
// then installed from the OCI chart with every image pulled (pull policy IfNotPresent).
// useImported moves it back.
func (e *env) useRegistry(t testing.TB, ctx context.Context) {
	t.Helper()
	if e.registry == nil {
		r, err := e.node.StartRegistry()
		if err != nil {
			t.Fatal(err)
		}
		// Closed at the end of the run (TestMain), or now if it never holds every image.
		ready := false
		defer func() {
			if !ready {
				r.Close()
			}
		}()
		// The registry's images are not the imported ones: the kubelet (with
		// KubeletEnsureSecretPulledImages, on by default) treats an image it once pulled as
		// pulled, not preloaded, under every name it has, and then refuses it to the pods that
		// name it with pull policy Never — as it would on a real node.
		for ref, img := range e.art.testImages {
			cfg, err := img.ConfigFile()
			if err != nil {
				t.Fatal(err)
			}
			cfg = cfg.DeepCopy()
			cfg.Config.Labels = map[string]string{"dev.detour.e2e.source": "registry"}
			if img, err = mutate.ConfigFile(img, cfg); err != nil {
				t.Fatal(err)
			}
			if err := r.Push(ctx, r.Ref(ref), img); err != nil {
				t.Fatal(err)
			}
		}
		repo := r.Host + "/detour"
		bin := filepath.Join(e.node.Dir, "image-push-bin")
		out, stderr, err := e.node.RunSplit(ctx, goEnv(t), "make", "-C", e.root, "image-push",
			"IMAGE="+repo+":"+e.art.tag, "VERSION="+e2eVersion+"-registry", "BIN="+bin)
		if err != nil {
			t.Fatalf("make image-push: %v\n%s\n%s", err, out, stderr)
		}
		chartDir := filepath.Join(e.node.Dir, "chart-package")
		out, err = e.node.Helm(ctx, "package", filepath.Join(e.root, "manifests", "charts", "detour"), "--destination", chartDir)
		if err != nil {
			t.Fatalf("helm package: %v\n%s", err, out)
		}
		packaged, err := filepath.Glob(filepath.Join(chartDir, "detour-*.tgz"))
		if err != nil || len(packaged) != 1 {
			t.Fatalf("helm package wrote %v (%v)", packaged, err)
		}
		if out, err := e.node.Helm(ctx, "push", packaged[0], "oci://"+r.Host+"/charts", "--plain-http"); err != nil {
			t.Fatalf("helm push: %v\n%s", err, out)
		}
		version := strings.TrimSuffix(strings.TrimPrefix(filepath.Base(packaged[0]), "detour-"), ".tgz")
		e.registryImages = imageSet{
			repo: repo, tag: e.art.tag, pull: corev1.PullIfNotPresent,
			refs: images.Refs{
				Pause: r.Ref(e.art.refs.Pause), Proxy: r.Ref(e.art.refs.Proxy), Workload: r.Ref(e.art.refs.Workload),
				WorkloadNumeric: r.Ref(e.art.refs.WorkloadNumeric), WorkloadNamed: r.Ref(e.art.refs.WorkloadNamed),
			},
			chart: []string{"oci://" + r.Host + "/charts/detour", "--version", version, "--plain-http"},
		}
		e.registry, ready = r, true
	}
	e.img = e.registryImages
	e.installDetour(t, ctx, "")
}

func (e *env) useImported(t testing.TB, ctx context.Context) {
	t.Helper()
	e.img = e.importedImages()
	e.installDetour(t, ctx, "")
}

// goEnv is the environment a go command run inside a node needs to find this process's
// toolchain, module cache and build cache (the node's HOME is its own directory).
func goEnv(t testing.TB) []string {
	t.Helper()
	out, err := exec.Command("go", "env", "GOROOT", "GOPATH", "GOMODCACHE", "GOCACHE", "GOPROXY", "GOFLAGS").Output()
	if err != nil {
		t.Fatalf("go env: %v", err)
	}
	lines := strings.Split(string(out), "\n")
	names := []string{"GOROOT", "GOPATH", "GOMODCACHE", "GOCACHE", "GOPROXY", "GOFLAGS"}
	env := []string{"PATH=" + os.Getenv("PATH")}
	for i, name := range names {
		if i < len(lines) {
			env = append(env, name+"="+lines[i])
		}
	}
	return env
}

// join starts a node that joins the cluster as an admin following docs/operations.md would
// add one to a node pool: registered with detour's startup taint and labelled for the node
// agent. It returns once the node is Ready, the agent runs on it and has removed the taint.
// The node leaves, and its Node object goes, when the test ends.
func (e *env) join(t testing.TB, ctx context.Context, name string) *Node {
	t.Helper()
	n := e.joinNode(t, ctx, name, Options{
		Taints: []string{StartupTaint + ":NoSchedule"},
		Labels: []string{agentLabel + "=yes"},
	})
	waitFor(t, ctx, "the node agent to run on "+name+" and remove its startup taint", 3*time.Minute, func() (bool, error) {
		node, err := e.node.Client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		agent, err := e.agentPod(ctx, name)
		if err != nil {
			return false, err
		}
		return agent != nil && podReady(agent) && !hasStartupTaint(node), seen("agent %v, taints %v", agentState(agent), node.Spec.Taints)
	})
	return n
}

// joinNode starts a node that joins the cluster with opts (the sandbox image, and the images
// when they are imported rather than pulled from the registry) and makes it leave, and its
// Node object go, when the test ends — also when it failed to join after its kubelet
// registered, so that no agent pod waits on a node that is not there.
func (e *env) joinNode(t testing.TB, ctx context.Context, name string, opts Options) *Node {
	t.Helper()
	if opts.PauseImage == "" {
		opts.PauseImage = e.img.refs.Pause
	}
	if e.img.pull == corev1.PullNever && opts.Images == nil {
		opts.Images = e.art.tarballs // the images come imported, not from the registry
	}
	n, err := e.node.Join(ctx, name, opts)
	if err != nil {
		e.deleteNode(t, name)
		t.Fatalf("node %s did not join: %v", name, err)
	}
	t.Cleanup(func() { e.remove(t, n) })
	return n
}

// remove takes a node that joined out of the cluster: the machine goes, then its Node object.
func (e *env) remove(t testing.TB, n *Node) {
	t.Helper()
	if err := n.Leave(); err != nil {
		t.Errorf("node %s did not leave cleanly: %v", n.Name, err)
	}
	e.deleteNode(t, n.Name)
}

func (e *env) deleteNode(t testing.TB, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := e.node.Client.CoreV1().Nodes().Delete(ctx, name, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		t.Errorf("delete node %s: %v", name, err)
	}
}

// agentPod returns the node agent's pod on node, or nil.
func (e *env) agentPod(ctx context.Context, node string) (*corev1.Pod, error) {
	pods, err := e.node.Client.CoreV1().Pods(detourNamespace).List(ctx, metav1.ListOptions{
		LabelSelector: "app.kubernetes.io/component=node-agent", FieldSelector: "spec.nodeName=" + node,
	})
	if err != nil || len(pods.Items) == 0 {
		return nil, err
	}
	return &pods.Items[0], nil
}

func agentState(p *corev1.Pod) string {
	if p == nil {
		return "absent"
	}
	return fmt.Sprintf("%s %s ready=%v", p.Name, p.Status.Phase, podReady(p))
}

// onNode pins p to node through the scheduler (the hostname label), as a user's node
// selector would.
func onNode(p *corev1.Pod, node string) *corev1.Pod {
	p.Spec.NodeSelector = map[string]string{corev1.LabelHostname: node}
	return p
}

// clusterStory is a story of a cluster rather than a node (issue 22): it runs with node B
// joined (see [env.onCluster]).
type clusterStory struct {
	name string
	run  func(*testing.T, context.Context, *env, *Node)
}

// clusterSmoke is TestE2E's share of the cluster stories, and so CI's: a node joins and the
// cross-node story runs. TestE2ECluster (make e2e-cluster) runs every cluster story; CI's
// time on a fresh machine is the reason for the split (docs/development.md).
func clusterSmoke(t *testing.T, ctx context.Context, e *env) {
	e.onCluster(t, ctx, []clusterStory{{"cross-node", clusterCrossNode}})
}

// onCluster runs stories on a cluster: detour is installed from its OCI chart in the
// cluster's registry, every image is pulled from there, and a second node, B, joins as an
// admin's node pool would add it. The nodes leave at the end, and detour is installed again
// from the chart's directory with the imported images, as the stories after these expect.
func (e *env) onCluster(t *testing.T, ctx context.Context, stories []clusterStory) {
	e.useRegistry(t, ctx)
	defer e.useImported(t, ctx)
	b := e.join(t, ctx, "e2e-node-b")
	// B leaves before detour goes back to the imported images, which B does not have.
	defer e.remove(t, b)
	defer e.uncordon(t, ctx, e.node.Name)
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
func clusterCrossNode(t *testing.T, ctx context.Context, e *env, b *Node) {
	e.namespace(t, ctx, "cross", true)
	e.namespace(t, ctx, "cross-plain", false)
	defer e.dropNamespaces(t, ctx, "cross", "cross-plain")

	// The servers, on node B.
	servers := map[string]*corev1.Pod{}
	for _, s := range []struct{ name, ns string }{{"server", "cross"}, {"server-plain", "cross-plain"}} {
		p := onNode(e.pod(s.name, s.ns), b.Name)
		if _, err := e.node.Client.CoreV1().Pods(s.ns).Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for _, s := range []struct{ name, ns string }{{"server", "cross"}, {"server-plain", "cross-plain"}} {
		p := e.waitReady(t, ctx, s.ns, "name="+s.name, 1)[0]
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
			client := onNode(e.pod(name, c.clientNS), e.node.Name)
			client.Spec.Containers[0].Args = []string{"dial", "-must", "-retry", "30s", "-addr", target, "then", "sleep"}
			client.Spec.Containers[0].ReadinessProbe = nil
			client.Spec.RestartPolicy = corev1.RestartPolicyNever
			if _, err := e.node.Client.CoreV1().Pods(c.clientNS).Create(ctx, client, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			var clientPod *corev1.Pod
			var reply string
			waitFor(t, ctx, name+" to reach "+target, 2*time.Minute, func() (bool, error) {
				p, err := e.node.Client.CoreV1().Pods(c.clientNS).Get(ctx, name, metav1.GetOptions{})
				if err != nil {
					return false, err
				}
				if p.Status.Phase == corev1.PodFailed {
					return false, fmt.Errorf("%s failed: %s", name, e.logs(ctx, c.clientNS, name, "app"))
				}
				clientPod = p
				for line := range strings.SplitSeq(e.logs(ctx, c.clientNS, name, "app"), "\n") {
					if after, ok := strings.CutPrefix(line, "dial "+target+" ok: "); ok {
						reply = after
					}
				}
				return reply != "", seen("%s is %s", name, p.Status.Phase)
			})
			if ip, err := netip.ParseAddr(clientPod.Status.PodIP); err != nil || clientPod.Spec.NodeName != e.node.Name || !e.node.PodSubnet.Contains(ip) {
				t.Fatalf("%s runs on %s with IP %s, not on %s", name, clientPod.Spec.NodeName, clientPod.Status.PodIP, e.node.Name)
			}
			clientInjected, serverInjected := c.clientNS == "cross", c.serverNS == "cross"
			// The client's side.
			clientProxy := e.logs(ctx, c.clientNS, name, "detour-proxy")
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
				serverProxy := e.logs(ctx, c.serverNS, server.Name, "detour-proxy")
				want := fmt.Sprintf("proxy inbound %s:", clientPod.Status.PodIP)
				if !strings.Contains(serverProxy, want) {
					t.Errorf("the server's proxy logged no inbound connection from %s:\n%s", clientPod.Status.PodIP, serverProxy)
				}
			}
		})
	}

	// Each node's plugin handled its own pods: B's redirected B's server and saw no client.
	for _, l := range pluginLogAt(nodePluginLog(b), "ADD", "") {
		if strings.HasPrefix(l.Pod, "cross/client") || strings.HasPrefix(l.Pod, "cross-plain/client") {
			t.Errorf("node B's detour-cni handled %s, a pod of node A", l.Pod)
		}
	}
	if l := pluginLogAt(nodePluginLog(b), "ADD", "redirected"); !slices.ContainsFunc(l, func(l pluginEntry) bool { return l.Pod == "cross/server" }) {
		t.Errorf("node B's detour-cni did not redirect cross/server: %v", l)
	}
	if _, err := os.Stat(b.PrimaryConfigPath()); err != nil {
		t.Errorf("node B has no primary conflist of its own: %v", err)
	}
}

// dropNamespaces deletes namespaces and waits until they are gone, their pods with them: the
// next story drains or removes nodes, which a terminating pod would hold up.
func (e *env) dropNamespaces(t testing.TB, ctx context.Context, names ...string) {
	t.Helper()
	for _, ns := range names {
		if err := e.node.Client.CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete namespace %s: %v", ns, err)
		}
	}
	waitFor(t, ctx, fmt.Sprintf("namespaces %v to be gone", names), 2*time.Minute, func() (bool, error) {
		var left []string
		for _, ns := range names {
			if _, err := e.node.Client.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{}); err == nil {
				left = append(left, ns)
			} else if !apierrors.IsNotFound(err) {
				return false, err
			}
		}
		return len(left) == 0, seen("still there: %v", left)
	})
}

// cordon marks nodes unschedulable; uncordon marks them schedulable again.
func (e *env) cordon(t testing.TB, ctx context.Context, nodes ...string) {
	t.Helper()
	e.setUnschedulable(t, ctx, true, nodes...)
}

func (e *env) uncordon(t testing.TB, ctx context.Context, nodes ...string) {
	t.Helper()
	e.setUnschedulable(t, ctx, false, nodes...)
}

func (e *env) setUnschedulable(t testing.TB, ctx context.Context, unschedulable bool, nodes ...string) {
	t.Helper()
	patch := fmt.Sprintf(`{"spec":{"unschedulable":%v}}`, unschedulable)
	for _, n := range nodes {
		_, err := e.node.Client.CoreV1().Nodes().Patch(ctx, n, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			t.Fatalf("set node %s unschedulable=%v: %v", n, unschedulable, err)
		}
	}
}

// clusterPerNodeScoping: each node agent acts on its own node only. A token of node A's agent
// (bound to its pod, as the kubelet gets it) may patch A but not B, and may not delete B's
// pods: the API refuses with the chart's policy's message. With B broken — its agent gone
// and detour's configuration removed from it — B's new injected pods fail their validators
// and A's repair leaves them alone; A's pods are untouched; B's agent, back, repairs them.
func clusterPerNodeScoping(t *testing.T, ctx context.Context, e *env, b *Node) {
	agentA, err := e.agentPod(ctx, e.node.Name)
	if err != nil || agentA == nil {
		t.Fatalf("no node agent on %s: %v", e.node.Name, err)
	}
	stdout, stderr, err := e.node.Kubectl(ctx, "create", "token", "detour-node-agent", "-n", detourNamespace,
		"--bound-object-kind", "Pod", "--bound-object-name", agentA.Name, "--duration", "10m")
	if err != nil {
		t.Fatalf("create a token bound to %s: %v\n%s", agentA.Name, err, stderr)
	}
	cfg := rest.AnonymousClientConfig(e.node.Config)
	cfg.BearerToken = strings.TrimSpace(stdout)
	asAgentA, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	label := []byte(`{"metadata":{"labels":{"e2e.detour.dev/scoping":"probe"}}}`)
	unlabel := []byte(`{"metadata":{"labels":{"e2e.detour.dev/scoping":null}}}`)
	if _, err := asAgentA.CoreV1().Nodes().Patch(ctx, e.node.Name, types.MergePatchType, label, metav1.PatchOptions{}); err != nil {
		t.Errorf("node A's agent may not patch its own node: %v", err)
	}
	asAgentA.CoreV1().Nodes().Patch(ctx, e.node.Name, types.MergePatchType, unlabel, metav1.PatchOptions{})
	_, err = asAgentA.CoreV1().Nodes().Patch(ctx, b.Name, types.MergePatchType, label, metav1.PatchOptions{})
	wantRefused(t, "node A's agent patching node B", err, "the node agent of node "+e.node.Name+" may not change node "+b.Name)

	e.namespace(t, ctx, "scoping", true)
	defer e.dropNamespaces(t, ctx, "scoping")
	bPod := onNode(e.pod("on-b", "scoping"), b.Name)
	if _, err := e.node.Client.CoreV1().Pods("scoping").Create(ctx, bPod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	e.waitReady(t, ctx, "scoping", "name=on-b", 1)
	err = asAgentA.CoreV1().Pods("scoping").Delete(ctx, "on-b", metav1.DeleteOptions{})
	wantRefused(t, "node A's agent deleting a pod of node B", err, "the node agent of node "+e.node.Name+" may not change pods of another node")

	// B breaks: its agent goes, then detour's configuration (the agent leaves it on purpose
	// when only its pod goes).
	e.setNodeAgent(t, ctx, b, false)
	if err := os.RemoveAll(filepath.Join(b.CNIConfDir, PrimaryNetwork)); err != nil {
		t.Fatal(err)
	}
	if err := b.WritePrimaryConfig(); err != nil {
		t.Fatal(err)
	}
	aPod := onNode(e.pod("on-a", "scoping"), e.node.Name)
	if _, err := e.node.Client.CoreV1().Pods("scoping").Create(ctx, aPod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.node.Client.AppsV1().Deployments("scoping").Create(ctx, onNodeDeployment(e.deployment("broken", "scoping", 2), b.Name), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	failing := map[string]types.UID{}
	waitFor(t, ctx, "B's new pods to fail their validators", 2*time.Minute, func() (bool, error) {
		pods, err := e.pods(ctx, "scoping", "app=broken")
		if err != nil {
			return false, err
		}
		for _, p := range pods {
			if checkExit(&p) == 42 {
				failing[p.Name] = p.UID
			}
		}
		return len(failing) == 2, seen("failed validators: %v", failing)
	})
	// Several of A's repair passes (resync 2 s): B's failing pods stay, A's pod runs.
	sleepCtx(ctx, 15*time.Second)
	pods, err := e.pods(ctx, "scoping", "app=broken")
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
	a := e.waitReady(t, ctx, "scoping", "name=on-a", 1)[0]
	if checkExit(&a) != 0 {
		t.Errorf("pod on-a of node A did not pass its validator while B was broken: %d", checkExit(&a))
	}
	if _, err := os.Stat(e.dropInPath()); err != nil {
		t.Errorf("node A lost detour's configuration while B's agent went: %v", err)
	}

	// B's agent comes back and repairs B's pods.
	e.setNodeAgent(t, ctx, b, true)
	replaced := e.waitReady(t, ctx, "scoping", "app=broken", 2)
	for _, p := range replaced {
		if _, stale := failing[p.Name]; stale {
			t.Errorf("pod %s of node B was not recreated by B's repair", p.Name)
		}
	}
}

// clusterRewrites: the primary rewrites its conflist on every node at once (atomic renames and
// in-place writes, content changed and unchanged, 50 times each) while injected pods are
// created on both nodes: not one starts without its rules.
func clusterRewrites(t *testing.T, ctx context.Context, e *env, b *Node) {
	res := e.churn(t, ctx, "churn-cluster", e.node, b)
	defer e.dropNamespaces(t, ctx, "churn-cluster")
	t.Logf("churn on %s and %s: %d of %d pods started without rules during %d rewrites of each node's conflist",
		e.node.Name, b.Name, res.failed, res.pods, res.rewrites)
	if res.failed != 0 {
		t.Errorf("%d of %d pods started without rules while both nodes' primaries rewrote their conflists", res.failed, res.pods)
	}
	for _, n := range []*Node{e.node, b} {
		dropIn := nodeDropIn(n)
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

// setNodeAgent puts the node agent on node n (present) or takes it away, and waits for its
// pod to be ready, or gone.
func (e *env) setNodeAgent(t testing.TB, ctx context.Context, n *Node, present bool) {
	t.Helper()
	value := "null"
	if present {
		value = `"yes"`
	}
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%s}}}`, agentLabel, value)
	if _, err := e.node.Client.CoreV1().Nodes().Patch(ctx, n.Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, ctx, fmt.Sprintf("the node agent on %s to be present=%v", n.Name, present), 2*time.Minute, func() (bool, error) {
		p, err := e.agentPod(ctx, n.Name)
		if err != nil {
			return false, err
		}
		if !present {
			return p == nil, seen("agent %s", agentState(p))
		}
		return p != nil && podReady(p) && p.DeletionTimestamp == nil, seen("agent %s", agentState(p))
	})
}

// onNodeDeployment pins dep's pods to node.
func onNodeDeployment(dep *appsv1.Deployment, node string) *appsv1.Deployment {
	dep.Spec.Template.Spec.NodeSelector = map[string]string{corev1.LabelHostname: node}
	return dep
}

// clusterDrain: `kubectl drain` node B while injected pods of a Deployment run there: they come
// back on node A with their redirect, proven by a connection through each one's proxy.
func clusterDrain(t *testing.T, ctx context.Context, e *env, b *Node) {
	defer e.uncordon(t, ctx, b.Name)
	e.namespace(t, ctx, "drain", true)
	defer e.dropNamespaces(t, ctx, "drain")
	e.cordon(t, ctx, e.node.Name)
	if _, err := e.node.Client.AppsV1().Deployments("drain").Create(ctx, e.deployment("web", "drain", 2), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, p := range e.waitReady(t, ctx, "drain", "app=web", 2) {
		if p.Spec.NodeName != b.Name {
			t.Fatalf("pod %s runs on %s with A cordoned", p.Name, p.Spec.NodeName)
		}
	}
	e.uncordon(t, ctx, e.node.Name)
	start := time.Now()
	if out, stderr, err := e.node.Kubectl(ctx, "drain", b.Name, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout", "3m"); err != nil {
		t.Fatalf("kubectl drain %s: %v\n%s\n%s", b.Name, err, out, stderr)
	}
	moved := e.waitReady(t, ctx, "drain", "app=web", 2)
	t.Logf("the drained pods were Ready again on %s %s after kubectl drain began", e.node.Name, time.Since(start).Round(100*time.Millisecond))
	for _, p := range moved {
		if p.Spec.NodeName != e.node.Name {
			t.Errorf("pod %s runs on %s after the drain, want %s", p.Name, p.Spec.NodeName, e.node.Name)
		}
		if code := checkExit(&p); code != 0 {
			t.Errorf("pod %s: validator %d after the drain", p.Name, code)
		}
		e.assertCaptured(t, ctx, p, "app")
	}
	// The agent stays on the drained node (DaemonSet pods are not evicted), with detour's
	// configuration: the node is cordoned, not uninstalled.
	if agent, err := e.agentPod(ctx, b.Name); err != nil || agent == nil || agent.DeletionTimestamp != nil {
		t.Errorf("the node agent left the drained node %s: %v", b.Name, agentState(agent))
	}
	if _, err := os.Stat(nodeDropIn(b)); err != nil {
		t.Errorf("the drained node lost detour's configuration: %v", err)
	}
}

// clusterRemoval: node B is drained and its Node object deleted, as a node pool scaling in
// removes a node, its kubelet still running: the agent takes detour off B's disk (drop-in,
// binary, kubeconfig, token) before the pod garbage collector deletes its pod, and the
// control-plane node keeps its configuration.
func clusterRemoval(t *testing.T, ctx context.Context, e *env, b *Node) {
	before, err := detourFiles(b)
	if err != nil || len(before) == 0 {
		t.Fatalf("nothing of detour on %s before its removal (%v): the story proves nothing", b.Name, err)
	}
	if out, stderr, err := e.node.Kubectl(ctx, "drain", b.Name, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout", "3m"); err != nil {
		t.Fatalf("kubectl drain %s: %v\n%s\n%s", b.Name, err, out, stderr)
	}
	if agent, err := e.agentPod(ctx, b.Name); err != nil || agent == nil || !podReady(agent) {
		t.Fatalf("the node agent on %s is %s (%v): nothing would remove detour", b.Name, agentState(agent), err)
	}
	logs, err := e.holdAgentLogs(ctx, b) // read from B's disk: without its Node, no kubectl logs
	if err != nil {
		t.Fatal(err)
	}
	defer logs.Close()
	b.ExpectExit("kube-proxy") // it exits when its Node is deleted
	start := time.Now()
	if out, stderr, err := e.node.Kubectl(ctx, "delete", "node", b.Name); err != nil {
		t.Fatalf("kubectl delete node %s: %v\n%s\n%s", b.Name, err, out, stderr)
	}
	err = poll(ctx, time.Minute, func() (bool, error) {
		left, err := detourFiles(b)
		return err == nil && len(left) == 0, seen("left: %v (%v)", left, err)
	})
	if err != nil {
		t.Fatalf("detour is still on %s's disk a minute after its Node was deleted: %v\nthe agent's log:\n%s", b.Name, err, tail(logs.read(), 30))
	}
	t.Logf("node %s deleted: nothing of detour on its disk %s later (before it: %d files)", b.Name, time.Since(start).Round(100*time.Millisecond), len(before))
	// The agent did it as it saw the Node go: its pod's deletion by the garbage collector comes
	// later, and its SIGTERM, with the DaemonSet in place, would leave everything.
	if log := logs.read(); !strings.Contains(log, "the node's Node object is deleted") || strings.Contains(log, "SIGTERM") {
		t.Errorf("the agent on %s does not say it removed detour because the Node was deleted, or did at SIGTERM:\n%s", b.Name, tail(log, 20))
	}
	if left, err := e.detourConfigs(); err != nil || len(left) == 0 {
		t.Errorf("the control-plane node lost detour's configuration with %s's removal: %v %v", b.Name, left, err)
	}
}

// detourFiles lists what the node agent writes on n's disk that is still there: in the CNI
// conf dir (recursively) a file named for detour or naming detour-cni, in the bin dir the plugin.
func detourFiles(n *Node) ([]string, error) {
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
func clusterScaleOut(t *testing.T, ctx context.Context, e *env, b *Node) {
	e.cordon(t, ctx, e.node.Name, b.Name)
	defer e.uncordon(t, ctx, b.Name)
	// The new node pulls the agent's image as from a remote registry (10 s), not in the
	// milliseconds of the registry beside it: the window in which seed 000's pods slipped in.
	e.registry.Slow("detour", agentPullDelay)
	defer e.registry.Slow("detour", 0)
	for _, c := range []struct {
		node  string
		taint bool
	}{{"e2e-node-c", true}, {"e2e-node-d", false}} {
		t.Run(map[bool]string{true: "with-startup-taint", false: "without-startup-taint"}[c.taint], func(t *testing.T) {
			ns := "scale-" + c.node[len(c.node)-1:]
			e.namespace(t, ctx, ns, true)
			defer e.dropNamespaces(t, ctx, ns)
			const replicas = 20
			// The check in the validator init container: where it runs at the proxy's start
			// (the default here), the pods select detour.dev/image-volumes=true, which only
			// the agent sets, and wait for it without the taint too.
			dep := e.deployment("web", ns, replicas)
			dep.Spec.Template.Annotations = map[string]string{annotations.ValidatorMode: string(annotations.ValidatorInitContainer)}
			if _, err := e.node.Client.AppsV1().Deployments(ns).Create(ctx, dep, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			waitFor(t, ctx, "20 replicas Pending on a full node pool", 2*time.Minute, func() (bool, error) {
				pods, err := e.pods(ctx, ns, "app=web")
				if err != nil {
					return false, err
				}
				pending := 0
				for _, p := range pods {
					if p.Spec.NodeName == "" && p.Status.Phase == corev1.PodPending {
						pending++
					}
				}
				return pending == replicas, seen("%d of %d pending", pending, len(pods))
			})
			var w *podWatcher
			start := time.Now()
			opts := Options{Labels: []string{agentLabel + "=yes"}}
			if c.taint {
				opts.Taints = []string{StartupTaint + ":NoSchedule"}
			}
			w = e.watchPods(ctx, ns)
			defer w.stop()
			n := e.joinNode(t, ctx, c.node, opts)
			defer func() {
				// The pods go first, so that their sandboxes are torn down by the node.
				e.node.Client.AppsV1().Deployments(ns).Delete(ctx, "web", metav1.DeleteOptions{})
				poll(ctx, 2*time.Minute, func() (bool, error) {
					pods, err := e.pods(ctx, ns, "app=web")
					return err == nil && len(pods) == 0, err
				})
				e.remove(t, n)
			}()
			joined := time.Since(start)
			var ready []corev1.Pod
			waitFor(t, ctx, "all 20 replicas Ready on the new node", 6*time.Minute, func() (bool, error) {
				pods, err := e.pods(ctx, ns, "app=web")
				if err != nil {
					return false, err
				}
				ready = ready[:0]
				for _, p := range pods {
					if p.DeletionTimestamp == nil && podReady(&p) && checkExit(&p) == 0 {
						ready = append(ready, p)
					}
				}
				return len(ready) == replicas, seen("%d ready", len(ready))
			})
			allReady := time.Since(start)
			caught, created := w.result()
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
			last := map[string]pluginEntry{}
			for _, l := range pluginLogAt(nodePluginLog(n), "ADD", "") {
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

// podWatcher follows the pods of a namespace: how many were created, and how many of them
// had a validator fail (exit 42).
type podWatcher struct {
	mu      sync.Mutex
	created map[types.UID]bool
	caught  map[types.UID]bool
	stop    context.CancelFunc
}

func (e *env) watchPods(ctx context.Context, ns string) *podWatcher {
	ctx, cancel := context.WithCancel(ctx)
	w := &podWatcher{created: map[types.UID]bool{}, caught: map[types.UID]bool{}, stop: cancel}
	go func() {
		for ctx.Err() == nil {
			if pods, err := e.pods(ctx, ns, ""); err == nil {
				w.mu.Lock()
				for _, p := range pods {
					w.created[p.UID] = true
					if checkExit(&p) == 42 {
						w.caught[p.UID] = true
					}
				}
				w.mu.Unlock()
			}
			sleepCtx(ctx, 250*time.Millisecond)
		}
	}()
	return w
}

func (w *podWatcher) result() (caught, created int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.caught), len(w.created)
}
