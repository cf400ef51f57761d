package validator_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/inject"
	"github.com/detourmesh/detour/internal/cli"
	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/test/testenv"
	"github.com/detourmesh/detour/validator"
)

func TestMain(m *testing.M) {
	testenv.MainWithChildren(m, map[string]func([]string) int{"detour": cli.Main, "listen": listenChild})
}

// listenChild is an app's server: it listens on network args[0], address args[1], says so on
// standard output, and holds the port until it is killed.
func listenChild(args []string) int {
	ln, err := net.Listen(args[0], args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer ln.Close()
	fmt.Println("listening")
	// Accept until killed, as an app does. A goroutine parked in Accept also keeps the runtime
	// from ending a CGO_ENABLED=0 build with "all goroutines are asleep" (which `select {}` did
	// in CI, so the check found the port free).
	for {
		c, err := ln.Accept()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		c.Close()
	}
}

// The pod's identities: the validator runs as a UID of its own, never exempt.
var (
	validatorID = testenv.Identity{UID: 2103, GID: 2103}
	proxyID     = testenv.Identity{UID: 2102, GID: 2102}
)

// podNamespace is a pod's network namespace whose default routes lead over a veth to a
// gateway that silently drops everything (a static neighbor entry whose MAC no interface has):
// a connection the redirect does not catch times out, as toward an unrouted address in a
// cluster, and no traffic leaves the test's namespaces.
func podNamespace(t *testing.T, dualStack bool) *testenv.NetNS {
	t.Helper()
	return podNamespaceOf(t, true, dualStack, true)
}

// podNamespaceOf is podNamespace with IPv4 and IPv6 each present or not, and the default routes
// left out when routes is false.
func podNamespaceOf(t *testing.T, ipv4, ipv6, routes bool) *testenv.NetNS {
	t.Helper()
	pod, peer := testenv.NewNetNS(t), testenv.NewNetNS(t)
	var podAddrs, peerAddrs []netip.Prefix
	var gateways []netip.Addr
	if ipv4 {
		podAddrs = append(podAddrs, netip.MustParsePrefix("10.250.0.2/24"))
		peerAddrs = append(peerAddrs, netip.MustParsePrefix("10.250.0.1/24"))
		gateways = append(gateways, netip.MustParseAddr("10.250.0.9"))
	}
	if ipv6 {
		podAddrs = append(podAddrs, netip.MustParsePrefix("fd25::2/64"))
		peerAddrs = append(peerAddrs, netip.MustParsePrefix("fd25::1/64"))
		gateways = append(gateways, netip.MustParseAddr("fd25::9"))
	}
	testenv.Link(t, pod, "eth0", podAddrs, peer, "eth0", peerAddrs)
	err := pod.Handle(func(h *netlink.Handle) error {
		link, err := h.LinkByName("eth0")
		if err != nil {
			return err
		}
		for _, gw := range gateways {
			family := netlink.FAMILY_V4
			if gw.Is6() {
				family = netlink.FAMILY_V6
			}
			neigh := &netlink.Neigh{LinkIndex: link.Attrs().Index, Family: family, State: netlink.NUD_PERMANENT,
				IP: gw.AsSlice(), HardwareAddr: net.HardwareAddr{0x02, 0, 0, 0, 0, 0x09}}
			if err := h.NeighAdd(neigh); err != nil {
				return fmt.Errorf("neighbor %s: %w", gw, err)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("set up the pod namespace: %v", err)
	}
	for _, gw := range gateways {
		if !routes {
			break
		}
		if gw.Is4() {
			testenv.AddRoute(t, pod, netip.MustParsePrefix("0.0.0.0/0"), gw)
		} else {
			testenv.AddRoute(t, pod, netip.MustParsePrefix("::/0"), gw)
		}
	}
	return pod
}

// installRedirect installs the plugin's rules, as detour-cni would for an injected pod whose
// proxy runs as proxyID with outbound port 4140.
func installRedirect(t *testing.T, ns *testenv.NetNS, families ...iptables.Family) {
	t.Helper()
	var rulesets []iptables.Ruleset
	for _, f := range families {
		rs, err := iptables.Build(iptables.Config{Family: f, ProxyUID: proxyID.UID, InboundPort: 4143, OutboundPort: 4140})
		if err != nil {
			t.Fatal(err)
		}
		rulesets = append(rulesets, rs)
	}
	if err := iptables.NewExecutor().Apply(context.Background(), ns.Path, rulesets...); err != nil {
		t.Fatalf("install the redirect: %v", err)
	}
}

// applyRedirect installs the rules of an injected pod's redirect in ns, both families, as
// detour-cni does.
func applyRedirect(t *testing.T, ns *testenv.NetNS, r annotations.Redirect) {
	t.Helper()
	rulesets, err := iptables.BuildFamilies(r, iptables.IPv4, iptables.IPv6)
	if err != nil {
		t.Fatal(err)
	}
	if err := iptables.NewExecutor().Apply(context.Background(), ns.Path, rulesets...); err != nil {
		t.Fatal(err)
	}
}

// validate runs `detour validate args...` in ns as id; the deadline only stops a hung child.
func validate(t *testing.T, ns *testenv.NetNS, id testenv.Identity, args ...string) testenv.ChildResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res, err := testenv.RunChild(ctx, ns, id, "detour", append([]string{"validate"}, args...)...)
	if err != nil {
		t.Fatalf("detour validate: %v (stderr: %s)", err, res.Stderr)
	}
	return res
}

func TestIntegrationValidatorWithRedirect(t *testing.T) {
	ns := podNamespace(t, true)
	installRedirect(t, ns, iptables.IPv4, iptables.IPv6)
	res := validate(t, ns, validatorID, "--port=4140")
	if res.ExitCode != validator.ExitOK {
		t.Fatalf("exit code %d, want 0; stderr: %s", res.ExitCode, res.Stderr)
	}
	for _, want := range []string{"redirect in place:", "ipv4 connection to 203.0.113.254:80 came back to port 4140", "ipv6 connection to [2001:db8::fe]:80 came back to port 4140"} {
		if !strings.Contains(res.Stdout, want) {
			t.Errorf("stdout %q does not contain %q", res.Stdout, want)
		}
	}
}

func TestIntegrationValidatorWithoutRedirect(t *testing.T) {
	ns := podNamespace(t, false)
	res := validate(t, ns, validatorID, "--port=4140", "--timeout=1s")
	if res.ExitCode != validator.ExitNoRedirect {
		t.Fatalf("exit code %d, want %d; stderr: %s", res.ExitCode, validator.ExitNoRedirect, res.Stderr)
	}
	want := "detour: no redirect in this pod's network namespace: expected connections to 203.0.113.254:80 to be redirected to port 4140 of this pod, " +
		"but the ipv4 connection to 203.0.113.254:80 timed out after 1s: the detour CNI plugin did not run for this pod — was the node's CNI config in place when the pod started?"
	if res.Stderr != want {
		t.Errorf("stderr\n%s\nwant\n%s", res.Stderr, want)
	}
}

// The proxy's UID is exempt from the redirect, so a validator running as it finds none when the
// rules do not name its sentinels (a pod injected before they existed): the check is the real
// path of a connection, not a look at the rules. With them, the proxy's probe is redirected
// (TestIntegrationValidatorInTheProxysStart).
func TestIntegrationValidatorExemptIdentityFails(t *testing.T) {
	ns := podNamespace(t, false)
	installRedirect(t, ns, iptables.IPv4)
	res := validate(t, ns, proxyID, "--port=4140", "--timeout=1s")
	if res.ExitCode != validator.ExitNoRedirect {
		t.Fatalf("exit code %d, want %d; stderr: %s", res.ExitCode, validator.ExitNoRedirect, res.Stderr)
	}
}

func TestIntegrationValidatorPortHeld(t *testing.T) {
	ns := podNamespace(t, false)
	installRedirect(t, ns, iptables.IPv4)
	testenv.Serve(t, ns, "unrelated", "tcp4", "0.0.0.0:4140")
	res := validate(t, ns, validatorID, "--port=4140")
	if res.ExitCode != validator.ExitPortInUse {
		t.Fatalf("exit code %d, want %d; stderr: %s", res.ExitCode, validator.ExitPortInUse, res.Stderr)
	}
	if want := "detour: port 4140 is taken by a socket listening on 0.0.0.0:4140 owned by uid 0, not by the validator (uid 2103): the validator must listen on the proxy's outbound port itself"; !strings.HasPrefix(res.Stderr, want) {
		t.Errorf("stderr %q does not start with %q", res.Stderr, want)
	}
}

// appID is an app container's UID, neither the proxy's nor the validator's.
var appID = testenv.Identity{UID: 1000, GID: 1000}

// The check at the proxy's start, run again (the proxy restarted) while an app container of the
// pod listens on the check port without declaring it: exit 43, the proxy never starts, and the
// message names the app's socket — read from the pod namespace's /proc/net/tcp or tcp6 — and
// its UID, and says what to do.
func TestIntegrationValidatorCheckPortHeld(t *testing.T) {
	proxy, r := foldedProxy(t, "echo proxy up; exit 7")
	for _, tc := range []struct {
		network, addr string
	}{
		{"tcp4", "0.0.0.0:4142"},
		{"tcp", "[::]:4142"}, // a dual-stack socket, in tcp6 only
		{"tcp4", "127.0.0.1:4142"},
	} {
		t.Run(tc.addr, func(t *testing.T) {
			ns := podNamespace(t, true)
			applyRedirect(t, ns, r)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			app := testenv.ChildCommand(ctx, appID, "listen", tc.network, tc.addr)
			out, err := app.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			var appErr strings.Builder
			app.Stderr = &appErr
			if err := ns.Do(app.Start); err != nil {
				t.Fatal(err)
			}
			defer func() { app.Process.Kill(); app.Wait() }()
			if line, err := bufio.NewReader(out).ReadString('\n'); line != "listening\n" {
				t.Fatalf("the app did not listen: %q, %v", line, err)
			}
			// The app must hold the port in the pod's namespace: say so when it does not, as
			// the check passing would otherwise read as a check that misses a held port.
			if got, want := netnsID(t, fmt.Sprintf("/proc/%d/ns/net", app.Process.Pid)), netnsID(t, ns.Path); got != want {
				t.Fatalf("the app (pid %d) runs in network namespace %d, not the pod's %d", app.Process.Pid, got, want)
			}

			check := runFolded(ctx, ns, proxy)
			var stdout, stderr strings.Builder
			check.Stdout, check.Stderr = &stdout, &stderr
			if err := ns.Do(check.Start); err != nil {
				t.Fatal(err)
			}
			check.Wait()
			if code := check.ProcessState.ExitCode(); code != validator.ExitPortInUse || strings.Contains(stdout.String(), "proxy up") {
				app.Process.Kill()
				app.Wait()
				t.Fatalf("exit code %d (want %d), or the proxy started; stdout %q, stderr %q; the app's stderr %q", code, validator.ExitPortInUse, stdout.String(), stderr.String(), appErr.String())
			}
			for _, want := range []string{
				"detour: port 4142 is taken by a socket listening on " + tc.addr + " owned by uid 1000, not by the proxy (uid 2102): ",
				"a container of this pod listens on the port where the redirect check at the proxy's start listens (validator.checkPort)",
				"move that container's port, or have the cluster admin set the webhook's validator.checkPort",
			} {
				if !strings.Contains(stderr.String(), want) {
					t.Errorf("stderr\n%s\nlacks\n%s", stderr.String(), want)
				}
			}
		})
	}
}

func TestIntegrationValidatorBadFlags(t *testing.T) {
	ns := podNamespace(t, false)
	for _, args := range [][]string{{"--port=0"}, {"--no-such-flag"}, {"extra-argument"}, {"--sentinel=127.0.0.1:80"}} {
		res := validate(t, ns, validatorID, args...)
		if res.ExitCode != validator.ExitUsage || res.Stderr == "" {
			t.Errorf("validate %v: exit code %d, stderr %q; want %d and a message", args, res.ExitCode, res.Stderr, validator.ExitUsage)
		}
	}
}

// Issue 15.10: in an IPv6-only pod the validator checks IPv6 (the plugin's rules are there) and
// passes, where it checked IPv4 and exited 42 before.
func TestIntegrationValidatorIPv6Only(t *testing.T) {
	ns := podNamespaceOf(t, false, true, true)
	installRedirect(t, ns, iptables.IPv4, iptables.IPv6) // as the plugin does: IPv4 always
	res := validate(t, ns, validatorID, "--port=4140", "--timeout=2s")
	if res.ExitCode != validator.ExitOK {
		t.Fatalf("exit code %d, want 0; stderr: %s", res.ExitCode, res.Stderr)
	}
	for _, want := range []string{"ipv6 connection to [2001:db8::fe]:80 came back to port 4140", "not checked: ipv4: the pod has no IPv4 address"} {
		if !strings.Contains(res.Stdout, want) {
			t.Errorf("stdout %q does not contain %q", res.Stdout, want)
		}
	}
}

// Issue 15.10: a pod that routes none of the sentinels cannot be checked: exit 44, told apart
// from "no redirect" (42).
func TestIntegrationValidatorNoRoute(t *testing.T) {
	ns := podNamespaceOf(t, true, false, false)
	res := validate(t, ns, validatorID, "--port=4140", "--timeout=1s")
	if res.ExitCode != validator.ExitNoRoute || !strings.Contains(res.Stderr, "nothing to check the redirect with") || !strings.Contains(res.Stderr, "no route to 203.0.113.254:80") {
		t.Fatalf("exit code %d, stderr %q; want %d", res.ExitCode, res.Stderr, validator.ExitNoRoute)
	}
}

// Issue 10: a pod whose skip lists cover the validator's probe (port 80, every network) still
// passes its validator, because the webhook names the probe in detour.dev/validator-sentinels
// and the plugin redirects it ahead of the skip lists. The injected validator's own command
// runs against the injected pod's own rules; without the sentinels the same rules fail it.
func TestIntegrationValidatorPassesWhateverTheSkipLists(t *testing.T) {
	cfg, err := inject.ParseConfig([]byte("proxy: {image: proxy:test}\nsidecarMode: container\nvalidator: {timeout: 1s}"))
	if err != nil {
		t.Fatal(err)
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "shop", Annotations: map[string]string{
			annotations.Inject:            "enabled",
			annotations.SkipOutboundPorts: "80",
			annotations.SkipOutboundCIDRs: "0.0.0.0/0,::/0",
		}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "app", Image: "app"}}},
	}
	if _, err := inject.Mutate(pod, inject.Input{}, cfg); err != nil {
		t.Fatal(err)
	}
	r, err := annotations.ParseRedirect(pod.Annotations)
	if err != nil {
		t.Fatal(err)
	}
	command := pod.Spec.InitContainers[0].Command // detour validate --port=4140 --timeout=1s
	for _, tc := range []struct {
		name      string
		sentinels bool
		want      int
	}{
		{"with the sentinels", true, validator.ExitOK},
		{"without them (a pod injected before they existed)", false, validator.ExitNoRedirect},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ns := podNamespace(t, true)
			r := r
			if !tc.sentinels {
				r.Sentinels = nil
			}
			applyRedirect(t, ns, r)
			res := validate(t, ns, validatorID, command[2:]...)
			if res.ExitCode != tc.want {
				t.Fatalf("%v: exit code %d, want %d; stdout %q, stderr %q", command, res.ExitCode, tc.want, res.Stdout, res.Stderr)
			}
		})
	}
}

// foldedProxy injects pod with the validator's check folded into the proxy's start
// (validator.mode image-volume), its proxy command a shell script, and returns the proxy
// container and the pod's redirect.
func foldedProxy(t *testing.T, script string, args ...string) (corev1.Container, annotations.Redirect) {
	t.Helper()
	cfg, err := inject.ParseConfig([]byte(`
proxy:
  image: proxy:test
  command: [/bin/sh, -c, ` + strconv.Quote(script) + `, sh]
  startupProbe: {tcpSocket: {port: 4191}}
sidecarMode: native
validator: {mode: image-volume, timeout: 2s}
`))
	if err != nil {
		t.Fatal(err)
	}
	cfg.Proxy.Args = args
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "shop", Annotations: map[string]string{annotations.Inject: "enabled"}},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "app", Image: "app"}}},
	}
	res, err := inject.Mutate(pod, inject.Input{NativeSidecars: true, Validator: annotations.ValidatorImageVolume}, cfg)
	if err != nil || res.Validator != annotations.ValidatorImageVolume {
		t.Fatalf("inject: %v, validator %q, warnings %v", err, res.Validator, res.Warnings)
	}
	r, err := annotations.ParseRedirect(pod.Annotations)
	if err != nil {
		t.Fatal(err)
	}
	proxy := pod.Spec.InitContainers[0]
	if proxy.Name != annotations.ProxyContainer || proxy.Command[0] != inject.ValidatorBinary {
		t.Fatalf("the first init container is %s running %v, want the proxy running %s", proxy.Name, proxy.Command, inject.ValidatorBinary)
	}
	return proxy, r
}

// runFolded starts the folded proxy container's command line — detour's binary in the image
// volume is this test's `detour` — in ns as the proxy's UID, the way the runtime would.
func runFolded(ctx context.Context, ns *testenv.NetNS, proxy corev1.Container) *exec.Cmd {
	args := append(slices.Clone(proxy.Command[1:]), proxy.Args...)
	cmd := testenv.ChildCommand(ctx, proxyID, "detour", args...)
	cmd.Env = append(cmd.Env, "PROBE=from the pod spec")
	return cmd
}

// Issue 21: the check runs at the start of the proxy container, as the proxy's UID — which the
// rules let out directly, but for the sentinels — and then execs the proxy's command: the same
// process (its PID), its arguments with their spaces, its environment, its exit code, its
// signals. Without the rules the check fails with the validator's code and the proxy never
// starts.
func TestIntegrationValidatorInTheProxysStart(t *testing.T) {
	script := `echo "pid $$"; echo "arg1 [$1]"; echo "arg2 [$2]"; echo "env [$PROBE]"; exit 7`
	proxy, r := foldedProxy(t, script, "two words", "--config=/etc/proxy.yaml")
	ns := podNamespace(t, true)
	applyRedirect(t, ns, r)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	t.Run("exec", func(t *testing.T) {
		cmd := runFolded(ctx, ns, proxy)
		var stdout, stderr strings.Builder
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := ns.Do(cmd.Start); err != nil {
			t.Fatal(err)
		}
		cmd.Wait()
		if code := cmd.ProcessState.ExitCode(); code != 7 {
			t.Fatalf("exit code %d, want the proxy's 7; stdout %q, stderr %q", code, stdout.String(), stderr.String())
		}
		for _, want := range []string{
			"redirect in place: ipv4 connection to 203.0.113.254:80 came back to port 4142",
			"detour validate: starting /bin/sh",
			fmt.Sprintf("pid %d\n", cmd.Process.Pid), // the same process
			"arg1 [two words]\n", "arg2 [--config=/etc/proxy.yaml]\n",
			"env [from the pod spec]\n",
		} {
			if !strings.Contains(stdout.String(), want) {
				t.Errorf("stdout lacks %q:\n%s", want, stdout.String())
			}
		}
	})

	t.Run("signals", func(t *testing.T) {
		proxy, _ := foldedProxy(t, `trap 'echo "got TERM"; exit 143' TERM; echo ready; while :; do sleep 0.05; done`)
		cmd := runFolded(ctx, ns, proxy)
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := ns.Do(cmd.Start); err != nil {
			t.Fatal(err)
		}
		lines := bufio.NewScanner(out)
		var seen []string
		for lines.Scan() {
			seen = append(seen, lines.Text())
			if lines.Text() == "ready" {
				// The PID the runtime (here: the test) signals is the proxy's.
				if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
					t.Fatal(err)
				}
			}
		}
		cmd.Wait()
		if code := cmd.ProcessState.ExitCode(); code != 143 || !slices.Contains(seen, "got TERM") {
			t.Errorf("after SIGTERM: exit code %d, output %q; want the proxy's trap to answer with 143", code, seen)
		}
	})

	// A node whose detour-cni predates the check port (the webhook upgraded first) ignores
	// detour.dev/validator-check-port and sends the proxy's probe to the outbound port: the
	// check, refused on the check port, passes there.
	t.Run("a plugin from before the check port", func(t *testing.T) {
		older := podNamespace(t, false)
		r := r
		r.CheckPort = 0
		applyRedirect(t, older, r)
		cmd := runFolded(ctx, older, proxy)
		var stdout, stderr strings.Builder
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := older.Do(cmd.Start); err != nil {
			t.Fatal(err)
		}
		cmd.Wait()
		if code := cmd.ProcessState.ExitCode(); code != 7 || !strings.Contains(stdout.String(), "came back to port 4140") {
			t.Errorf("exit code %d, want the proxy's 7 after a check that came back to port 4140; stdout %q, stderr %q", code, stdout.String(), stderr.String())
		}
	})

	t.Run("no redirect", func(t *testing.T) {
		bare := podNamespace(t, false)
		cmd := runFolded(ctx, bare, proxy)
		var stdout, stderr strings.Builder
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := bare.Do(cmd.Start); err != nil {
			t.Fatal(err)
		}
		cmd.Wait()
		if code := cmd.ProcessState.ExitCode(); code != validator.ExitNoRedirect {
			t.Fatalf("exit code %d, want %d; stderr %q", code, validator.ExitNoRedirect, stderr.String())
		}
		if strings.Contains(stdout.String(), "pid ") || !strings.Contains(stderr.String(), "no redirect in this pod's network namespace") {
			t.Errorf("the proxy started, or the message is not the validator's: stdout %q, stderr %q", stdout.String(), stderr.String())
		}
	})
}

// gatedProxy is foldedProxy with detour's postStart hook as the proxy's start gate
// (proxy.startGate hook) and a check of timeout: the proxy container and its hook's command line.
func gatedProxy(t *testing.T, script string, timeout time.Duration) (corev1.Container, []string) {
	t.Helper()
	cfg, err := inject.ParseConfig([]byte(fmt.Sprintf(`
proxy:
  image: proxy:test
  command: [/bin/sh, -c, %q, sh]
  startupProbe: {tcpSocket: {port: 4191}, periodSeconds: 1, failureThreshold: 30}
  startGate: hook
sidecarMode: native
validator: {mode: image-volume, timeout: %s}
`, script, timeout)))
	if err != nil {
		t.Fatal(err)
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "shop", Annotations: map[string]string{annotations.Inject: "enabled"}},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "app", Image: "app"}}},
	}
	res, err := inject.Mutate(pod, inject.Input{NativeSidecars: true, Validator: annotations.ValidatorImageVolume}, cfg)
	if err != nil || res.StartGate != annotations.StartGateHook {
		t.Fatalf("inject: %v, start gate %q, warnings %v", err, res.StartGate, res.Warnings)
	}
	proxy := pod.Spec.InitContainers[0]
	hook := proxy.Lifecycle.PostStart.Exec.Command
	if hook[0] != inject.ValidatorBinary || proxy.StartupProbe == nil {
		t.Fatalf("hook %q, startup probe %+v", hook, proxy.StartupProbe)
	}
	return proxy, hook
}

// runHook starts the hook's command line in ns as the proxy's UID, as the runtime execs it in
// the proxy container; its output goes to out.
// waitForTheKubeletsStop asserts that a check which failed and told its hook does not exit by
// itself — the kubelet stops the container once the hook has failed, and a container that ended
// on its own just then can look running to the kubelet's next relist — and that it exits at once
// when stopped, as by the kubelet's SIGTERM.
func waitForTheKubeletsStop(t *testing.T, check *exec.Cmd) {
	t.Helper()
	exited := make(chan struct{})
	go func() { check.Wait(); close(exited) }()
	select {
	case <-exited:
		t.Fatalf("the check exited (%v) after telling its hook, before it was stopped", check.ProcessState)
	case <-time.After(500 * time.Millisecond):
	}
	check.Process.Signal(syscall.SIGTERM)
	select {
	case <-exited:
	case <-time.After(validator.StopWait / 2):
		t.Fatalf("the check did not exit when stopped")
	}
}

func runHook(t *testing.T, ctx context.Context, ns *testenv.NetNS, hook []string, out *strings.Builder) *exec.Cmd {
	t.Helper()
	cmd := testenv.ChildCommand(ctx, proxyID, "detour", hook[1:]...)
	cmd.Stdout, cmd.Stderr = out, out
	if err := ns.Do(cmd.Start); err != nil {
		t.Fatal(err)
	}
	return cmd
}

// Issue 36: the start gate's hook (detour wait-proxy) returns once the proxy — exec'd by the check
// after it passed — listens; when the check fails, the hook fails at once with the check's
// message (the kubelet shows it as the hook's error), long before its own bound; and a hook that
// goes away before the check decided (the kubelet restarted) ends the check, which then exits 1,
// not the validator's "no redirect", so that no kubelet can count a running failing check as a
// started proxy.
func TestIntegrationStartGateHook(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	t.Run("passes once the proxy listens", func(t *testing.T) {
		ns := podNamespace(t, false)
		proxy, hook := gatedProxy(t, "echo proxy up; exec sleep 30", 5*time.Second)
		_, r := foldedProxy(t, "true")
		applyRedirect(t, ns, r)
		check := runFolded(ctx, ns, proxy)
		var checkOut lockedBuffer
		check.Stdout, check.Stderr = &checkOut, &checkOut
		if err := ns.Do(check.Start); err != nil {
			t.Fatal(err)
		}
		defer check.Process.Kill()
		var out strings.Builder
		h := runHook(t, ctx, ns, hook, &out)
		done := make(chan error, 1)
		go func() { done <- h.Wait() }()
		select {
		case err := <-done:
			t.Fatalf("the hook returned before the proxy listened: %v\n%s", err, out.String())
		case <-time.After(time.Second):
		}
		var ln net.Listener
		if err := ns.Do(func() (err error) { ln, err = net.Listen("tcp", ":4191"); return err }); err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		select {
		case err := <-done:
			if err != nil || !strings.Contains(out.String(), "proxy started: 10.") {
				t.Errorf("hook: %v\n%s", err, out.String())
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("the hook did not return once the proxy listened:\n%s", out.String())
		}
		// The hook passed on the test's own listener; the check execs the proxy about then.
		deadline := time.Now().Add(5 * time.Second)
		for !strings.Contains(checkOut.String(), "proxy up") && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if !strings.Contains(checkOut.String(), "proxy up") {
			t.Errorf("the check did not exec the proxy:\n%s", checkOut.String())
		}
	})

	t.Run("fails with the check's message", func(t *testing.T) {
		bare := podNamespace(t, false)
		proxy, hook := gatedProxy(t, "echo proxy up; exec sleep 30", 2*time.Second)
		check := runFolded(ctx, bare, proxy)
		var checkOut strings.Builder
		check.Stdout, check.Stderr = &checkOut, &checkOut
		if err := bare.Do(check.Start); err != nil {
			t.Fatal(err)
		}
		var out strings.Builder
		start := time.Now()
		h := runHook(t, ctx, bare, hook, &out)
		h.Wait()
		if code := h.ProcessState.ExitCode(); code != 1 || time.Since(start) > 10*time.Second {
			t.Errorf("the hook exited %d after %s; want 1 within the check's 2s, not its own 30s", code, time.Since(start))
		}
		waitForTheKubeletsStop(t, check)
		for _, want := range []string{"the redirect check at the proxy's start failed (exit 42)", "no redirect in this pod's network namespace"} {
			if !strings.Contains(out.String(), want) {
				t.Errorf("the hook's output lacks %q:\n%s", want, out.String())
			}
		}
		if code := check.ProcessState.ExitCode(); code != validator.ExitNoRedirect || strings.Contains(checkOut.String(), "proxy up") {
			t.Errorf("the check exited %d (want %d) or started the proxy:\n%s", code, validator.ExitNoRedirect, checkOut.String())
		}
	})

	// A check that fails at once (here: no route to the sentinel, 44) is over before the
	// kubelet's exec of the hook has begun: it waits for the hook (--hook-wait) to tell it.
	t.Run("a hook that comes after the check failed", func(t *testing.T) {
		noRoute := podNamespaceOf(t, true, false, false)
		proxy, hook := gatedProxy(t, "echo proxy up; exec sleep 30", 5*time.Second)
		check := runFolded(ctx, noRoute, proxy)
		var checkOut strings.Builder
		check.Stdout, check.Stderr = &checkOut, &checkOut
		if err := noRoute.Do(check.Start); err != nil {
			t.Fatal(err)
		}
		time.Sleep(300 * time.Millisecond)
		var out strings.Builder
		h := runHook(t, ctx, noRoute, hook, &out)
		h.Wait()
		waitForTheKubeletsStop(t, check)
		if code := h.ProcessState.ExitCode(); code != 1 || !strings.Contains(out.String(), "the redirect check at the proxy's start failed (exit 44)") {
			t.Errorf("the hook exited %d:\n%s", code, out.String())
		}
		if code := check.ProcessState.ExitCode(); code != validator.ExitNoRoute {
			t.Errorf("the check exited %d, want %d:\n%s", code, validator.ExitNoRoute, checkOut.String())
		}
	})

	t.Run("a hook that goes away ends the check", func(t *testing.T) {
		bare := podNamespace(t, false)
		proxy, hook := gatedProxy(t, "echo proxy up; exec sleep 30", 20*time.Second)
		check := runFolded(ctx, bare, proxy)
		var checkOut strings.Builder
		check.Stdout, check.Stderr = &checkOut, &checkOut
		if err := bare.Do(check.Start); err != nil {
			t.Fatal(err)
		}
		var out strings.Builder
		h := runHook(t, ctx, bare, hook, &out)
		time.Sleep(2 * time.Second) // the hook joins the check
		h.Process.Kill()            // as containerd kills it when the kubelet's exec goes away
		h.Wait()
		start := time.Now()
		check.Wait()
		if code := check.ProcessState.ExitCode(); code != validator.ExitFailure || time.Since(start) > 5*time.Second {
			t.Errorf("the check exited %d %s after the hook went away; want %d at once (its own bound is 20s):\n%s", code, time.Since(start), validator.ExitFailure, checkOut.String())
		}
		if !strings.Contains(checkOut.String(), "the start gate's postStart hook ended before the check decided") || strings.Contains(checkOut.String(), "proxy up") {
			t.Errorf("the check's output:\n%s", checkOut.String())
		}
	})
}

// netnsID is the inode of the network namespace at path (a bind mount or /proc/PID/ns/net).
func netnsID(t *testing.T, path string) uint64 {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Sys().(*syscall.Stat_t).Ino
}

// lockedBuffer is a buffer a child process writes to (through exec's copying goroutine) while
// the test reads it.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
