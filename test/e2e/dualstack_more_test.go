//go:build dualstack

package e2e

import (
	"cmp"
	"context"
	"fmt"
	"net/netip"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/google/nftables"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/utils/ptr"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/internal/nsutil"
	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/test/e2e/framework"
	"github.com/detourmesh/detour/test/e2e/upstream"
	"github.com/detourmesh/detour/validator"
)

// make e2e-dualstack: the dual-stack node's stories beyond CI's smoke, and the IPv6-only node.

func init() {
	dualStackMore = []story{
		{"dualstack/init-containers-keep-egress", initContainersKeepEgress},
		{"dualstack/ipv6-socket-lookup", ipv6SocketLookup},
		{"dualstack/one-family-missing-is-never-ready", oneFamilyMissing},
		{"dualstack/one-family-missing-at-the-init-container", oneFamilyMissingAtTheInitContainer},
		{"seed003/demo-container-mode", seed003Demo},
		{"validator/in-the-proxys-start", validatorInTheProxysStart},
		{"check/cluster-healthy", checkClusterHealthy},
		{"seed000/repair-after-the-node-broke", seed000Repair},
		{"dualstack/cross-node", crossNode},
		// Last: it leaves detour injecting every pod.
		{"conformance/dual-stack", dualStackConformance},
	}
}

// TestE2EIPv6Only runs the core stories on a node whose pods and Services are IPv6 only
// (framework.IPv6Only): the kubelet's probes reach the apps through the proxy over IPv6, the
// init containers reach the test server over IPv6, and the checks find the IPv6 redirect.
func TestE2EIPv6Only(t *testing.T) {
	e := framework.OwnEnv(t, framework.Options{Families: framework.IPv6Only, Taints: []string{framework.StartupTaint + ":NoSchedule"}})
	runFamilyStories(t, e, []story{
		{"ipv6only/every-family-captured", everyFamilyCaptured},
		{"ipv6only/service-of-every-family", serviceOfEveryFamily},
		{"ipv6only/init-containers-keep-egress", initContainersKeepEgress},
		{"ipv6only/ipv6-socket-lookup", ipv6SocketLookup},
		{"ipv6only/one-family-missing-is-never-ready", oneFamilyMissing},
		{"ipv6only/one-family-missing-at-the-init-container", oneFamilyMissingAtTheInitContainer},
		{"inbound/probes-meet-the-app", inboundProbesMeetTheApp},
		{"seed003/demo-container-mode", seed003Demo},
		{"validator/in-the-proxys-start", validatorInTheProxysStart},
		{"check/cluster-healthy", checkClusterHealthy},
		{"seed000/repair-after-the-node-broke", seed000Repair},
	})
}

// TestE2EIPv4ToDualStack changes a running IPv4-only cluster with detour installed into a
// dual-stack one (framework.Env.AddIPv6): the meshed pod created before keeps its IPv4
// address, its redirect and its proxy, untouched; the pods created after get both families'
// rules, captured on each; a Service of both families works; `detour check --cluster` passes.
func TestE2EIPv4ToDualStack(t *testing.T) {
	e := framework.OwnEnv(t, framework.Options{Taints: []string{framework.StartupTaint + ":NoSchedule"}})
	var before *corev1.Pod
	runFamilyStories(t, e, []story{
		{"ipv4-to-dual/pod-before", func(t *testing.T, ctx context.Context, e *framework.Env) {
			before = podBeforeIPv6(t, ctx, e)
		}},
		{"ipv4-to-dual/add-ipv6", addIPv6},
		{"ipv4-to-dual/pod-before-keeps-working", func(t *testing.T, ctx context.Context, e *framework.Env) {
			podBeforeKeepsWorking(t, ctx, e, before)
		}},
		{"ipv4-to-dual/every-family-captured", everyFamilyCaptured},
		{"ipv4-to-dual/service-of-every-family", serviceOfEveryFamily},
		{"check/cluster-healthy", checkClusterHealthy},
	})
}

// podBeforeIPv6 creates meshed pod "before" in namespace upgrade on the IPv4-only cluster and
// returns it Ready, its connection to the test server captured.
func podBeforeIPv6(t *testing.T, ctx context.Context, e *framework.Env) *corev1.Pod {
	e.Namespace(t, ctx, "upgrade", true)
	p := e.Pod("before", "upgrade")
	p.Spec.Containers[0].Args = dialEach(e.Servers, []string{"-retry", "30s"}, "serve", "-listen", ":8080")
	if _, err := e.Node.Client.CoreV1().Pods("upgrade").Create(ctx, p, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pod := e.WaitReady(t, ctx, "upgrade", "name=before", 1)[0]
	podIPs(t, &pod, framework.IPv4Only)
	waitProxyLog(t, ctx, e, &pod, func(log string) error {
		if !e.Proxy.OutboundLogged(log, e.Server) {
			return fmt.Errorf("no outbound connection to %s", e.Server)
		}
		return nil
	})
	return &pod
}

// addIPv6: the cluster becomes dual-stack while detour runs; the Node reports an address of
// each family and detour's node agent stays Ready.
func addIPv6(t *testing.T, ctx context.Context, e *framework.Env) {
	start := time.Now()
	if err := e.AddIPv6(ctx); err != nil {
		t.Fatal(err)
	}
	t.Logf("the cluster became dual-stack in %s (the API server, controller manager, kubelet and kube-proxy restarted)", time.Since(start).Round(time.Millisecond))
	framework.WaitFor(t, ctx, "the Node to report its IPv6 address", time.Minute, func() (bool, error) {
		node, err := e.Node.Client.CoreV1().Nodes().Get(ctx, e.Node.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		var addrs []string
		for _, a := range node.Status.Addresses {
			addrs = append(addrs, a.Address)
			if a.Type == corev1.NodeInternalIP && a.Address == e.Node.IPs()[1].String() {
				return true, nil
			}
		}
		return false, framework.Seen("addresses %v", addrs)
	})
	framework.WaitFor(t, ctx, "detour's node agent to be Ready", time.Minute, func() (bool, error) {
		p, err := e.AgentPod(ctx, e.Node.Name)
		return err == nil && p != nil && framework.PodReady(p), framework.Seen("%s, %v", framework.AgentState(p), err)
	})
}

// podBeforeKeepsWorking: the pod created before the cluster had IPv6 is the same pod, Ready,
// no container restarted, with its IPv4 address alone; a connection to it still reaches its
// app through its proxy, a meshed pod created since reaches it through both proxies, and
// `detour check` finds its IPv4 rules exactly as detour-cni installs them.
func podBeforeKeepsWorking(t *testing.T, ctx context.Context, e *framework.Env, before *corev1.Pod) {
	if before == nil {
		t.Fatal("no pod from before the change (ipv4-to-dual/pod-before failed)")
	}
	pod, err := e.Node.Client.CoreV1().Pods("upgrade").Get(ctx, "before", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if pod.UID != before.UID || !framework.PodReady(pod) {
		t.Fatalf("pod before is %s (uid %s, was %s), want the same pod Ready", framework.ContainerStates(pod), pod.UID, before.UID)
	}
	for _, s := range append(pod.Status.InitContainerStatuses, pod.Status.ContainerStatuses...) {
		if s.RestartCount != 0 {
			t.Errorf("container %s of pod before restarted %d times across the change", s.Name, s.RestartCount)
		}
	}
	ip := podIPs(t, pod, framework.IPv4Only)[0]
	addr := netip.AddrPortFrom(ip, 8080)
	if reply := greetApp(t, ctx, e, addr); !e.Proxy.Proxied(reply) || !strings.Contains(reply, "local=127.0.0.1:8080") {
		t.Errorf("a connection to %s reached the app as %q, want it through the proxy, on 127.0.0.1", addr, reply)
	}

	client := e.Pod("after", "upgrade")
	client.Spec.InitContainers = nil
	client.Spec.Containers[0].Args = dialEach([]string{addr.String()}, []string{"-must", "-retry", "60s"}, "serve", "-listen", ":8080")
	if _, err := e.Node.Client.CoreV1().Pods("upgrade").Create(ctx, client, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	after := e.WaitReady(t, ctx, "upgrade", "name=after", 1)[0]
	afterIPs := podIPs(t, &after, framework.DualStack)
	if app := e.Logs(ctx, "upgrade", "after", "app"); !strings.Contains(app, "dial "+addr.String()+" ok: before ") {
		t.Errorf("the new pod's dial of %s did not reach the pod from before:\n%s", addr, app)
	}
	waitProxyLog(t, ctx, e, &after, func(log string) error {
		if !e.Proxy.OutboundLogged(log, addr.String()) {
			return fmt.Errorf("no outbound connection to %s", addr)
		}
		return nil
	})
	waitProxyLog(t, ctx, e, pod, func(log string) error {
		if !strings.Contains(log, "proxy inbound "+hostPart(afterIPs[0])) {
			return fmt.Errorf("no inbound connection from the new pod's %s", afterIPs[0])
		}
		return nil
	})

	out, err := e.CheckPodRules(ctx, pod, "")
	if err != nil {
		t.Fatalf("detour check on the pod from before: %v\n%s", err, out)
	}
	if !regexp.MustCompile(`the ipv4 rules in \S+ are exactly what detour-cni installs`).MatchString(out) {
		t.Errorf("detour check does not find the pod from before's IPv4 rules exactly as detour-cni installs them:\n%s", out)
	}
	t.Logf("detour check on the pod from before:\n%s", out)
}

// initContainersKeepEgress: in container mode (the proxy a regular container, started after
// the init containers), an init container reaches the test server over each family of the
// node directly — its exemption holds for IPv6 as for IPv4: without it, its IPv6 connection
// would go to the proxy's port, where nothing listens yet, and the pod would never start. The
// proxy's log then shows the app's connections only.
func initContainersKeepEgress(t *testing.T, ctx context.Context, e *framework.Env) {
	e.Namespace(t, ctx, "initegress", true)
	p := e.Pod("early", "initegress")
	p.Annotations = map[string]string{annotations.SidecarMode: string(annotations.SidecarContainer)}
	p.Spec.InitContainers[0].Args = dialEach(e.Servers, []string{"-must"})
	p.Spec.Containers[0].Args = dialEach(e.Servers, []string{"-retry", "30s"}, "serve", "-listen", ":8080")
	if _, err := e.Node.Client.CoreV1().Pods("initegress").Create(ctx, p, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pod := e.WaitReady(t, ctx, "initegress", "name=early", 1)[0]
	init := e.Logs(ctx, "initegress", "early", "init")
	for _, server := range e.Servers {
		if !strings.Contains(init, "dial "+server+" ok") {
			t.Errorf("the init container did not reach %s:\n%s", server, init)
		}
	}
	waitProxyLog(t, ctx, e, &pod, func(log string) error {
		for _, server := range e.Servers {
			if n := e.Proxy.OutboundCount(log, server); n != 1 {
				return fmt.Errorf("%d connections to %s, want 1 (the app's; the init container's went directly)", n, server)
			}
		}
		return nil
	})
}

// dualStackConformance: Kubernetes' own dual-stack tests ([Feature:IPv6DualStack] of e2e.test,
// upstream.SelectDualStack) and the conformance smoke, on the dual-stack node without detour
// injecting, then with detour injecting every pod: each test that passes without passes with,
// and at least 95% of their pod-network pods are injected. The table goes to
// $DETOUR_CONFORMANCE_DIR/report.md (default bin/conformance-dualstack/).
func dualStackConformance(t *testing.T, ctx context.Context, e *framework.Env) {
	// Most of the dual-stack tests need a second node (across nodes over each family).
	e.JoinNode(t, ctx, "e2e-node-b", framework.Options{})
	tests := append(upstream.SelectDualStack(listUpstreamTests(t, ctx, e)), upstream.Smoke...)
	withAndWithout(t, ctx, e, reportDir(t, e, "DETOUR_CONFORMANCE_DIR", "conformance-dualstack"),
		"Kubernetes' dual-stack tests and the conformance smoke on a dual-stack node, with and without detour", tests)
}

// crossNode: a meshed client on a second node dials a meshed server's address of each family
// on the control-plane node. The client's proxy carries each connection to that original
// destination, and the server's proxy takes each in from the client's address of the same
// family: the nodes route each other's pods of both families over the underlay.
func crossNode(t *testing.T, ctx context.Context, e *framework.Env) {
	b := e.JoinNode(t, ctx, "e2e-node-b", framework.Options{})
	e.SetNodeAgent(t, ctx, b, true)
	e.Namespace(t, ctx, "crossnode", true)
	pods := e.Node.Client.CoreV1().Pods("crossnode")
	if _, err := pods.Create(ctx, framework.OnNode(e.Pod("server", "crossnode"), e.Node.Name), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	server := e.WaitReady(t, ctx, "crossnode", "name=server", 1)[0]
	var addrs []string
	for _, ip := range podIPs(t, &server, e.Node.Families()) {
		addrs = append(addrs, netip.AddrPortFrom(ip, 8080).String())
	}
	client := framework.OnNode(e.Pod("client", "crossnode"), b.Name)
	client.Spec.InitContainers = nil
	client.Spec.Containers[0].Args = dialEach(addrs, []string{"-must", "-retry", "60s"}, "serve", "-listen", ":8080")
	if _, err := pods.Create(ctx, client, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	c := e.WaitReady(t, ctx, "crossnode", "name=client", 1)[0]
	app := e.Logs(ctx, "crossnode", "client", "app")
	for _, addr := range addrs {
		if !strings.Contains(app, "dial "+addr+" ok: server ") {
			t.Errorf("the client on %s did not reach the server at %s:\n%s", b.Name, addr, app)
		}
	}
	waitProxyLog(t, ctx, e, &c, func(log string) error {
		for _, addr := range addrs {
			if !e.Proxy.OutboundLogged(log, addr) {
				return fmt.Errorf("no outbound connection to %s", addr)
			}
		}
		return nil
	})
	waitProxyLog(t, ctx, e, &server, func(log string) error {
		for _, ip := range podIPs(t, &c, e.Node.Families()) {
			if !strings.Contains(log, "proxy inbound "+hostPart(ip)) {
				return fmt.Errorf("no inbound connection from the client's %s", ip)
			}
		}
		return nil
	})
	e.DropNamespaces(t, ctx, "crossnode")
}

// ipv6SocketLookup: the inbound socket lookup over IPv6 — a port the app binds on ::1 only is
// refused from another pod and still served to the pod's own process; its port listening on
// every address ([::]) reaches the proxy, which hands the connection over on ::1.
func ipv6SocketLookup(t *testing.T, ctx context.Context, e *framework.Env) {
	e.Namespace(t, ctx, "lookup6", true)
	e.Namespace(t, ctx, "lookup6-client", false)
	p := e.Pod("local", "lookup6")
	app := p.Spec.Containers[0]
	p.Spec.Containers = append(p.Spec.Containers, corev1.Container{
		Name: "admin", Image: app.Image, ImagePullPolicy: app.ImagePullPolicy,
		Args:            []string{"serve", "-name", "admin", "-listen", "[::1]:9090"},
		SecurityContext: &corev1.SecurityContext{RunAsUser: ptr.To[int64](1000)},
	}, corev1.Container{
		Name: "self", Image: app.Image, ImagePullPolicy: app.ImagePullPolicy,
		Args:            []string{"dial", "-must", "-retry", "30s", "-addr", "[::1]:9090", "then", "sleep"},
		SecurityContext: &corev1.SecurityContext{RunAsUser: ptr.To[int64](1000)},
	})
	if _, err := e.Node.Client.CoreV1().Pods("lookup6").Create(ctx, p, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	server := e.WaitReady(t, ctx, "lookup6", "name=local", 1)[0]
	framework.WaitFor(t, ctx, "the app's own process to reach its loopback port", time.Minute, func() (bool, error) {
		log := e.Logs(ctx, "lookup6", "local", "self")
		return strings.Contains(log, "dial [::1]:9090 ok: admin"), framework.Seen("%s", log)
	})
	var ip6 netip.Addr
	for _, ip := range podIPs(t, &server, e.Node.Families()) {
		if ip.Is6() {
			ip6 = ip
		}
	}
	if reply := greetApp(t, ctx, e, netip.AddrPortFrom(ip6, 8080)); !e.Proxy.Proxied(reply) || !strings.Contains(reply, "local=[::1]:8080") {
		t.Errorf("a connection to [%s]:8080 reached the app as %q, want it through the proxy, on [::1]", ip6, reply)
	}
	addr := netip.AddrPortFrom(ip6, 9090).String()
	if log := dialOutsideMesh(t, ctx, e, "lookup6-client", "client", addr); !strings.Contains(log, "connection refused") {
		t.Errorf("a client in another pod dialled %s, bound on ::1 only: %q, want connection refused", addr, log)
	}
}

// oneFamilyMissing: for each family of the node, a meshed pod of a Deployment loses that
// family's redirect behind its back (dropFamilyRedirect, as a node-level cleanup of one family
// would) while the other family's stays, and its proxy crashes. The check at the proxy's next
// start fails naming that family alone (exit 42), the pod leaves Ready and does not come back;
// `detour check` names the family too. Repair then deletes the pod, and its replacement is Ready
// with every family's rules.
func oneFamilyMissing(t *testing.T, ctx context.Context, e *framework.Env) {
	e.Namespace(t, ctx, "onefamily", true)
	families := familiesOf(e.Node.Families())
	for _, f := range families {
		t.Run(f.String(), func(t *testing.T) {
			name := "lose-" + f.String()
			if _, err := e.Node.Client.AppsV1().Deployments("onefamily").Create(ctx, e.Deployment(name, "onefamily", 1), metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			p := e.WaitReady(t, ctx, "onefamily", "app="+name, 1)[0]
			netns, err := e.PodNetns(&p)
			if err != nil {
				t.Fatal(err)
			}
			dropFamilyRedirect(t, ctx, netns, f)
			out, err := e.CheckPodRules(ctx, &p, "")
			if err == nil || strings.Contains(out, "the "+f.String()+" rules in") {
				t.Errorf("detour check of the pod without its %s rules: %v, want it to fail on them:\n%s", f, err, out)
			}
			for _, g := range families {
				if g != f && !strings.Contains(out, "the "+g.String()+" rules in") {
					t.Errorf("detour check does not find the %s rules the pod kept:\n%s", g, out)
				}
			}
			// Every state of the pod from now on, so that none is missed before repair deletes
			// it: the check fails at the proxy's restart, the proxy restarts and fails again,
			// and the pod is not Ready before repair replaces it.
			w := watchPod(t, ctx, e, &p)
			defer w.Stop()
			if n, err := e.KillInPod(&p, "testproxy"); err != nil || n != 1 {
				t.Fatalf("kill the proxy: %d killed, %v", n, err)
			}
			msg := awaitCheckFailure(t, w, annotations.ProxyContainer, f, families, func(q *corev1.Pod) bool { return proxyRestarts(q) > 0 })
			t.Logf("without its %s redirect, the check at the proxy's restart: %s", f, msg)
			awaitRepair(t, ctx, e, &p, name, f)
		})
	}
}

// oneFamilyMissingAtTheInitContainer: the check in the detour-validator init container
// (validator mode init-container) fails a pod that lost one family's redirect between
// detour-cni's ADD and the check, naming that family alone; the pod is never Ready and repair
// replaces it. The check runs once, right after the ADD that installed both families, so the
// pod loses one while the kubelet pulls the validator's image, which the cluster's registry
// serves late: a copy of detour's image of the family's own, so that each pull is a whole one.
func oneFamilyMissingAtTheInitContainer(t *testing.T, ctx context.Context, e *framework.Env) {
	r := e.Registry
	if r == nil {
		var err error
		if r, err = e.Node.StartRegistry(); err != nil {
			t.Fatal(err)
		}
		defer r.Close()
	}
	e.Namespace(t, ctx, "initcheck", true)
	// The chart's validator image again, however the story ends.
	defer e.InstallDetour(t, ctx, "")
	const repo = "detour-validator"
	families := familiesOf(e.Node.Families())
	for _, f := range families {
		t.Run(f.String(), func(t *testing.T) {
			ref := r.Host + "/" + repo + ":" + f.String()
			if err := e.PushDetourCopy(ctx, r, ref, f.String()); err != nil {
				t.Fatal(err)
			}
			r.Slow(repo, 40*time.Second)
			defer r.Slow(repo, 0)
			e.InstallDetour(t, ctx, fmt.Sprintf("webhook:\n  config:\n    validator:\n      image: %s\n      imagePullPolicy: IfNotPresent\n", ref))
			name := "init-lose-" + f.String()
			dep := e.Deployment(name, "initcheck", 1)
			dep.Spec.Template.Annotations = map[string]string{annotations.ValidatorMode: string(annotations.ValidatorInitContainer)}
			if _, err := e.Node.Client.AppsV1().Deployments("initcheck").Create(ctx, dep, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
			// The kubelet reports nothing of the pod while it pulls the validator's image: the
			// pod's sandbox is seen on the node, complete once detour check finds the rules of
			// every family the pod has.
			var p corev1.Pod
			framework.WaitFor(t, ctx, "the pod's sandbox with detour-cni's rules, its validator's image still pulling", time.Minute, func() (bool, error) {
				pods, err := e.Pods(ctx, "initcheck", "app="+name)
				if err != nil || len(pods) != 1 {
					return false, err
				}
				p = pods[0]
				if v := containerStatus(&p, annotations.ValidatorContainer); v != nil && v.State.Waiting == nil {
					return false, fmt.Errorf("the validator of pod %s started before its redirect was broken: %s", p.Name, framework.ContainerStates(&p))
				}
				out, err := e.CheckPodRules(ctx, &p, "")
				return err == nil, framework.Seen("%v: %s", err, out)
			})
			netns, err := e.PodNetns(&p)
			if err != nil {
				t.Fatal(err)
			}
			broken := time.Now()
			dropFamilyRedirect(t, ctx, netns, f)
			w := watchPod(t, ctx, e, &p)
			defer w.Stop()
			r.Slow(repo, 0)
			msg := awaitCheckFailure(t, w, annotations.ValidatorContainer, f, families, func(*corev1.Pod) bool { return true })
			if p, err := e.Node.Client.CoreV1().Pods("initcheck").Get(ctx, p.Name, metav1.GetOptions{}); err == nil {
				// The check's start, to the second: after the rules were broken.
				if first := firstStart(p, annotations.ValidatorContainer); first.Before(broken.Truncate(time.Second)) {
					t.Errorf("the validator started at %s, before its %s redirect was broken at %s", first, f, broken)
				}
			}
			t.Logf("without its %s redirect, the check in the detour-validator init container: %s", f, msg)
			awaitRepair(t, ctx, e, &p, name, f)
		})
	}
}

// familiesOf are the families of the pods of a node with families, IPv4 first.
func familiesOf(families framework.Families) []iptables.Family {
	var out []iptables.Family
	if families.Has4() {
		out = append(out, iptables.IPv4)
	}
	if families.Has6() {
		out = append(out, iptables.IPv6)
	}
	return out
}

// watchPod watches every state of p from its resource version on.
func watchPod(t *testing.T, ctx context.Context, e *framework.Env, p *corev1.Pod) watch.Interface {
	t.Helper()
	w, err := e.Node.Client.CoreV1().Pods(p.Namespace).Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + p.Name, ResourceVersion: p.ResourceVersion})
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// awaitCheckFailure reads w until the check in container fails ("no redirect") and returns
// its message, failing the test when the pod is Ready after checked(pod) says the check ran
// again, when the check exits with another code than no redirect's, or when its message does
// not name f, and f alone of families, as the family that lost its redirect.
func awaitCheckFailure(t *testing.T, w watch.Interface, container string, f iptables.Family, families []iptables.Family, checked func(*corev1.Pod) bool) string {
	t.Helper()
	var msg string
	var code int32
	timeout := time.After(2 * time.Minute)
	for !strings.Contains(msg, "no redirect") {
		select {
		case ev, ok := <-w.ResultChan():
			q, isPod := ev.Object.(*corev1.Pod)
			if !ok || !isPod {
				t.Fatalf("the pod's watch ended (%v) before its check's failure was seen", ev.Type)
			}
			if framework.PodReady(q) && checked(q) {
				t.Fatalf("pod %s is Ready after its check ran without the %s redirect: %s", q.Name, f, framework.ContainerStates(q))
			}
			code, msg = termination(q, container)
		case <-timeout:
			t.Fatalf("the check in %s did not fail within 2 minutes (last termination: %d %q)", container, code, msg)
		}
	}
	if code != validator.ExitNoRedirect {
		t.Errorf("the check in %s exited %d, want %d (no redirect)", container, code, validator.ExitNoRedirect)
	}
	for _, g := range families {
		if failed := strings.Contains(msg, "the "+g.String()+" connection to"); failed != (g == f) {
			t.Errorf("the check's message names %s as failed: %v, want %v: %s", g, failed, g == f, msg)
		}
	}
	if len(families) == 2 && !strings.Contains(msg, "one IP family only") {
		t.Errorf("the check's message does not say one family's rules are missing: %s", msg)
	}
	return msg
}

// awaitRepair waits until repair replaced p, never Ready again meanwhile, by a pod of
// Deployment name that is Ready with its rules exactly as detour-cni installs them.
func awaitRepair(t *testing.T, ctx context.Context, e *framework.Env, p *corev1.Pod, name string, f iptables.Family) {
	t.Helper()
	framework.WaitFor(t, ctx, "repair to replace the pod", 3*time.Minute, func() (bool, error) {
		pods, err := e.Pods(ctx, p.Namespace, "app="+name)
		if err != nil {
			return false, err
		}
		for _, q := range pods {
			if q.Name == p.Name && framework.PodReady(&q) {
				return false, fmt.Errorf("pod %s is Ready again without its %s redirect: %s", q.Name, f, framework.ContainerStates(&q))
			}
		}
		return len(pods) == 1 && pods[0].Name != p.Name && framework.PodReady(&pods[0]), framework.Seen("%d pods", len(pods))
	})
	replacement := e.WaitReady(t, ctx, p.Namespace, "app="+name, 1)[0]
	if out, err := e.CheckPodRules(ctx, &replacement, ""); err != nil {
		t.Errorf("the replacement %s: %v\n%s", replacement.Name, err, out)
	}
}

// dropFamilyRedirect takes family f's redirect out of the pod's network namespace at netns and
// leaves the other family's: with the nftables backend it flushes f's chains of detour's table
// (one inet table holds both families), with the iptables backends it removes f's rules.
func dropFamilyRedirect(t *testing.T, ctx context.Context, netns string, f iptables.Family) {
	t.Helper()
	var inTable bool
	err := nsutil.Do(netns, func() error {
		c, err := nftables.New()
		if err != nil {
			return err
		}
		tables, err := c.ListTablesOfFamily(nftables.TableFamilyINet)
		if err != nil {
			return err
		}
		for _, tbl := range tables {
			if tbl.Name != iptables.NFTTable {
				continue
			}
			inTable = true
			for _, chain := range []string{iptables.NFTOutboundChain(f), iptables.NFTInboundChain(f)} {
				c.FlushChain(&nftables.Chain{Table: tbl, Name: chain})
			}
			return c.Flush()
		}
		return nil
	})
	if err != nil {
		t.Fatalf("flush the pod's %s chains: %v", f, err)
	}
	if !inTable {
		if err := iptables.NewExecutor().Remove(ctx, netns, f); err != nil {
			t.Fatalf("remove the pod's %s rules: %v", f, err)
		}
	}
}

// termination is the exit code and message of container's last termination (current or
// previous state).
func termination(p *corev1.Pod, container string) (int32, string) {
	if s := containerStatus(p, container); s != nil {
		if t := cmp.Or(s.State.Terminated, s.LastTerminationState.Terminated); t != nil {
			return t.ExitCode, t.Message
		}
	}
	return 0, ""
}

// firstStart is the earliest start of container of p that its status still shows: its
// previous termination's, else its current state's.
func firstStart(p *corev1.Pod, container string) time.Time {
	s := containerStatus(p, container)
	switch {
	case s == nil:
		return time.Time{}
	case s.LastTerminationState.Terminated != nil:
		return s.LastTerminationState.Terminated.StartedAt.Time
	case s.State.Terminated != nil:
		return s.State.Terminated.StartedAt.Time
	case s.State.Running != nil:
		return s.State.Running.StartedAt.Time
	}
	return time.Time{}
}

// containerStatus is the status of p's container (init or not) name, or nil.
func containerStatus(p *corev1.Pod, name string) *corev1.ContainerStatus {
	for _, s := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
		if s.Name == name {
			return &s
		}
	}
	return nil
}
