//go:build dualstack

package e2e

import (
	"cmp"
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/google/nftables"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
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
		{"inbound/probes-meet-the-app", inboundProbesMeetTheApp},
		{"seed003/demo-container-mode", seed003Demo},
		{"validator/in-the-proxys-start", validatorInTheProxysStart},
		{"check/cluster-healthy", checkClusterHealthy},
		{"seed000/repair-after-the-node-broke", seed000Repair},
	})
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
	var families []iptables.Family
	if e.Node.Families().Has4() {
		families = append(families, iptables.IPv4)
	}
	if e.Node.Families().Has6() {
		families = append(families, iptables.IPv6)
	}
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
			w, err := e.Node.Client.CoreV1().Pods("onefamily").Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + p.Name, ResourceVersion: p.ResourceVersion})
			if err != nil {
				t.Fatal(err)
			}
			defer w.Stop()
			if n, err := e.KillInPod(&p, "testproxy"); err != nil || n != 1 {
				t.Fatalf("kill the proxy: %d killed, %v", n, err)
			}
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
					if framework.PodReady(q) && proxyRestarts(q) > 0 {
						t.Fatalf("pod %s is Ready after its proxy restarted without the %s redirect: %s", q.Name, f, framework.ContainerStates(q))
					}
					code, msg = proxyTermination(q)
				case <-timeout:
					t.Fatalf("the check at the proxy's restart did not fail within 2 minutes (last termination: %d %q)", code, msg)
				}
			}
			if code != validator.ExitNoRedirect {
				t.Errorf("the check at the proxy's restart exited %d, want %d (no redirect)", code, validator.ExitNoRedirect)
			}
			t.Logf("without its %s redirect, the check at the proxy's restart: %s", f, msg)
			// The check names the family that lost its redirect, and only that one.
			for _, g := range families {
				if failed := strings.Contains(msg, "the "+g.String()+" connection to"); failed != (g == f) {
					t.Errorf("the check's message names %s as failed: %v, want %v: %s", g, failed, g == f, msg)
				}
			}
			if len(families) == 2 && !strings.Contains(msg, "one IP family only") {
				t.Errorf("the check's message does not say one family's rules are missing: %s", msg)
			}
			framework.WaitFor(t, ctx, "repair to replace the pod", 3*time.Minute, func() (bool, error) {
				pods, err := e.Pods(ctx, "onefamily", "app="+name)
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
			replacement := e.WaitReady(t, ctx, "onefamily", "app="+name, 1)[0]
			if out, err := e.CheckPodRules(ctx, &replacement, ""); err != nil {
				t.Errorf("the replacement %s: %v\n%s", replacement.Name, err, out)
			}
		})
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

// proxyTermination is the exit code and message of the proxy container's last termination
// (current or previous state).
func proxyTermination(p *corev1.Pod) (int32, string) {
	for _, s := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
		if s.Name != annotations.ProxyContainer {
			continue
		}
		if t := cmp.Or(s.State.Terminated, s.LastTerminationState.Terminated); t != nil {
			return t.ExitCode, t.Message
		}
	}
	return 0, ""
}
