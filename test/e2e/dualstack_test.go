package e2e

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"regexp"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/detourmesh/detour/test/e2e/framework"
)

// The stories of issue 44: detour on a node whose pods have IPv4 and IPv6 (dual stack) or
// IPv6 only, where a redirect that captures one family and not the other would be a silent
// hole. Each cluster is a node of its own (framework.Options.Families), started before the
// shared node of TestE2E (this file sorts before suite_test.go).

// TestE2EDualStack runs the capture of both families on a dual-stack node: a meshed pod's
// outbound and inbound connections over IPv4 and IPv6, its init container's egress over both,
// and a Service of both families. `make test` runs it as CI's smoke; `make e2e-dualstack`
// (build tag dualstack) adds the stories of dualStackMore and the IPv6-only node
// (TestE2EIPv6Only).
func TestE2EDualStack(t *testing.T) {
	e := framework.OwnEnv(t, framework.Options{Families: framework.DualStack, Taints: []string{framework.StartupTaint + ":NoSchedule"}})
	runFamilyStories(t, e, append([]story{
		{"dualstack/every-family-captured", everyFamilyCaptured},
		{"dualstack/service-of-every-family", serviceOfEveryFamily},
	}, dualStackMore...))
}

// dualStackMore are the dual-stack node's stories beyond CI's smoke (dualstack_more_test.go,
// build tag dualstack).
var dualStackMore []story

// runFamilyStories installs detour with its node agent on e's node and runs stories there.
// They read the test proxy's log, the one proxy that reads both families' original
// destinations (HAProxy 2.6 reads IPv4's only: docs/proxy-contract.md).
func runFamilyStories(t *testing.T, e *framework.Env, stories []story) {
	if e.Proxy != framework.TestProxy {
		t.Fatalf("the run's proxy is %s: the IPv6 stories need the test proxy (unset DETOUR_E2E_PROXY)", e.Proxy.Name)
	}
	ctx, cancel := framework.Context(t, e.Node, 25*time.Minute)
	defer cancel()
	e.InstallDetour(t, ctx, "")
	e.SetAgent(t, ctx, true)
	runStories(t, ctx, e, stories)
}

// everyFamilyCaptured: a meshed pod has an address of each of the node's families; its init
// container reaches the test server over each before the proxy captures anything; its app's
// connection to the server over each goes through the proxy to that original destination; a
// connection to each of its addresses reaches the app through the proxy, which hands it over
// on the loopback address of its family; `detour check` finds each family's rules exactly as
// detour-cni installs them.
func everyFamilyCaptured(t *testing.T, ctx context.Context, e *framework.Env) {
	e.Namespace(t, ctx, "families", true)
	p := e.Pod("both", "families")
	p.Spec.InitContainers[0].Args = dialEach(e.Servers, []string{"-must"})
	p.Spec.Containers[0].Args = dialEach(e.Servers, []string{"-retry", "30s"}, "serve", "-listen", ":8080")
	if _, err := e.Node.Client.CoreV1().Pods("families").Create(ctx, p, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pod := e.WaitReady(t, ctx, "families", "name=both", 1)[0]
	ips := podIPs(t, &pod, e.Node.Families())

	init := e.Logs(ctx, "families", "both", "init")
	for _, server := range e.Servers {
		if !strings.Contains(init, "dial "+server+" ok") {
			t.Errorf("the init container did not reach %s:\n%s", server, init)
		}
	}
	for _, ip := range ips {
		reply := greetApp(t, ctx, e, netip.AddrPortFrom(ip, 8080))
		if want := loopbackOf(ip); !e.Proxy.Proxied(reply) || !strings.Contains(reply, "local="+want+":8080") {
			t.Errorf("a connection to %s reached the app as %q, want it through the proxy, on %s", ip, reply, want)
		}
	}
	log := waitProxyLog(t, ctx, e, &pod, func(log string) error {
		for _, ip := range ips {
			if !inboundTo(log, netip.AddrPortFrom(ip, 8080)) {
				return fmt.Errorf("no inbound connection to %s", netip.AddrPortFrom(ip, 8080))
			}
		}
		for _, server := range e.Servers {
			if !e.Proxy.OutboundLogged(log, server) {
				return fmt.Errorf("no outbound connection to %s", server)
			}
		}
		return nil
	})
	t.Logf("the proxy's log:\n%s", log)
	// The check at the proxy's start checked each family the pod has.
	for fam, has := range map[string]bool{"ipv4": e.Node.Families().Has4(), "ipv6": e.Node.Families().Has6()} {
		if checked := regexp.MustCompile(`redirect in place: .*` + fam + ` connection to`).MatchString(log); checked != has {
			t.Errorf("the check at the proxy's start checked %s: %v, want %v:\n%s", fam, checked, has, log)
		}
	}

	out, err := e.CheckPodRules(ctx, &pod, "")
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	for fam, has := range map[string]bool{"ipv4": e.Node.Families().Has4(), "ipv6": e.Node.Families().Has6()} {
		// detour-cni installs IPv4 rules in every pod (an IPv6-only pod's are idle): the
		// families the pod has are the ones to see.
		exact := regexp.MustCompile(`the ` + fam + ` rules in \S+ are exactly what detour-cni installs`)
		if has && !exact.MatchString(out) {
			t.Errorf("detour check does not find the %s rules exactly as detour-cni installs them:\n%s", fam, out)
		}
	}
}

// serviceOfEveryFamily: a Service with a ClusterIP of each of the node's families
// (ipFamilyPolicy RequireDualStack on a dual-stack node) in front of the meshed server that
// everyFamilyCaptured left (pod "both" of namespace families); a meshed
// client dials each ClusterIP. Its proxy carries each connection to the ClusterIP as the
// original destination (kube-proxy's translation happens on the node, after the pod's
// redirect), and the server's proxy takes each in from the client's address of that family.
func serviceOfEveryFamily(t *testing.T, ctx context.Context, e *framework.Env) {
	e.Namespace(t, ctx, "families", true)
	policy := corev1.IPFamilyPolicySingleStack
	if e.Node.Families() == framework.DualStack {
		policy = corev1.IPFamilyPolicyRequireDualStack
	}
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "both", Namespace: "families"},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"name": "both"}, IPFamilyPolicy: &policy,
			Ports: []corev1.ServicePort{{Port: 80, TargetPort: intstr.FromInt32(8080)}},
		},
	}
	svc, err := e.Node.Client.CoreV1().Services("families").Create(ctx, svc, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var clusterIPs []string
	for _, ip := range svc.Spec.ClusterIPs {
		clusterIPs = append(clusterIPs, net.JoinHostPort(ip, "80"))
	}
	if len(clusterIPs) != len(e.Servers) {
		t.Fatalf("Service %s has ClusterIPs %v (families %v), want one per family of the node", svc.Name, svc.Spec.ClusterIPs, svc.Spec.IPFamilies)
	}
	client := e.Pod("client", "families")
	client.Spec.InitContainers = nil
	client.Spec.Containers[0].Args = dialEach(clusterIPs, []string{"-must", "-retry", "60s"}, "serve", "-listen", ":8080")
	if _, err := e.Node.Client.CoreV1().Pods("families").Create(ctx, client, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	c := e.WaitReady(t, ctx, "families", "name=client", 1)[0]
	app := e.Logs(ctx, "families", "client", "app")
	for _, addr := range clusterIPs {
		if !strings.Contains(app, "dial "+addr+" ok: both ") {
			t.Errorf("the client's dial of %s did not reach the server:\n%s", addr, app)
		}
	}
	waitProxyLog(t, ctx, e, &c, func(log string) error {
		for _, addr := range clusterIPs {
			if !e.Proxy.OutboundLogged(log, addr) {
				return fmt.Errorf("no outbound connection to the ClusterIP %s", addr)
			}
		}
		return nil
	})
	server, err := e.Node.Client.CoreV1().Pods("families").Get(ctx, "both", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	waitProxyLog(t, ctx, e, server, func(log string) error {
		for _, ip := range podIPs(t, &c, e.Node.Families()) {
			if !strings.Contains(log, "proxy inbound "+hostPart(ip)) {
				return fmt.Errorf("no inbound connection from the client's %s", ip)
			}
		}
		return nil
	})
}

// dialEach is the workload's chain that dials each of addrs with flags, then runs then (when
// given).
func dialEach(addrs, flags []string, then ...string) []string {
	var args []string
	for i, addr := range addrs {
		if i > 0 {
			args = append(args, "then")
		}
		args = append(append(append(args, "dial"), flags...), "-addr", addr)
	}
	if len(then) > 0 {
		args = append(append(args, "then"), then...)
	}
	return args
}

// podIPs are p's addresses, one per family of the node (the primary first), or the test
// fails.
func podIPs(t testing.TB, p *corev1.Pod, families framework.Families) []netip.Addr {
	t.Helper()
	var ips []netip.Addr
	for _, ip := range p.Status.PodIPs {
		a, err := netip.ParseAddr(ip.IP)
		if err != nil {
			t.Fatalf("pod %s: address %q: %v", p.Name, ip.IP, err)
		}
		ips = append(ips, a)
	}
	want := []bool{families.Has4(), families.Has6()}
	has := []bool{false, false}
	for _, ip := range ips {
		has[btoi(ip.Is6())] = true
	}
	if len(ips) != btoi(want[0])+btoi(want[1]) || has[0] != want[0] || has[1] != want[1] {
		t.Fatalf("pod %s has addresses %v, want one per family of the node (%q)", p.Name, ips, families)
	}
	return ips
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// loopbackOf is the loopback address of ip's family, as the workload's serve line prints it.
func loopbackOf(ip netip.Addr) string {
	if ip.Is6() {
		return "[::1]"
	}
	return "127.0.0.1"
}

// inboundTo reports whether the test proxy's log shows an inbound connection it handed over
// to the app, whose original destination was dst.
func inboundTo(log string, dst netip.AddrPort) bool {
	return regexp.MustCompile(`proxy inbound \S+ -> ` + regexp.QuoteMeta(dst.String()) + ` app \S+\n`).MatchString(log)
}

// greetApp is the app's first line on a connection from the node to addr (retried while
// the app does not serve yet).
func greetApp(t testing.TB, ctx context.Context, e *framework.Env, addr netip.AddrPort) string {
	t.Helper()
	var reply string
	err := framework.Poll(ctx, 30*time.Second, func() (bool, error) {
		var err error
		reply, err = e.Node.Greeting(ctx, addr.String())
		return err == nil && reply != "", framework.Seen("%q, %v", reply, err)
	})
	if err != nil {
		t.Fatalf("no reply on %s: %v", addr, err)
	}
	return reply
}

// waitProxyLog waits until the log of p's proxy satisfies ok (nil) and returns it; the test
// fails with ok's last error and the log when it never does.
func waitProxyLog(t testing.TB, ctx context.Context, e *framework.Env, p *corev1.Pod, ok func(string) error) string {
	t.Helper()
	var log string
	var last error
	err := framework.Poll(ctx, 30*time.Second, func() (bool, error) {
		log = e.Logs(ctx, p.Namespace, p.Name, "detour-proxy")
		last = ok(log)
		return last == nil, nil
	})
	if err != nil {
		t.Fatalf("the proxy of %s: %v:\n%s", p.Name, last, log)
	}
	return log
}

// hostPart is how ip starts a host:port ("10.88.0.5:", "[fd00:88::5]:").
func hostPart(ip netip.Addr) string {
	s := netip.AddrPortFrom(ip, 0).String()
	return strings.TrimSuffix(s, "0")
}
