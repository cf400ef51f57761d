package cniplugin_test

import (
	"context"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	types100 "github.com/containernetworking/cni/pkg/types/100"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/cniplugin"
	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/test/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// The pod of the seed-003 story: an app, the proxy, an init container with its own UID and one
// running as root with a dedicated GID.
var (
	proxy      = testenv.Identity{UID: 2102, GID: 2102}
	app        = testenv.Identity{UID: 3000, GID: 3000}
	initUID    = testenv.Identity{UID: 1000, GID: 1000}
	initGID    = testenv.Identity{UID: 0, GID: 2601}
	redirect   = annotations.Redirect{Version: "v-test", ProxyUID: proxy.UID, InboundPort: 4143, OutboundPort: 4140, SkipInboundPorts: []annotations.PortRange{{First: 4190, Last: 4191}}, ExemptUIDs: []uint32{initUID.UID}, ExemptGIDs: []uint32{initGID.GID}}
	remotePort = uint16(8080)
)

// fixture is one node: a bridge network as the primary CNI, detour-cni chained after it, and
// the real local API server holding the pods.
type fixture struct {
	t          testing.TB
	cni        *testenv.CNI
	bridge     *testenv.Bridge
	cfg        *rest.Config
	kubeconfig string
	client     kubernetes.Interface
	namespace  string
}

func newFixture(t testing.TB, dualStack bool) *fixture {
	t.Helper()
	f := &fixture{t: t, cni: testenv.NewCNI(t), bridge: testenv.NewBridge(t, dualStack), cfg: testenv.ControlPlane(t)}
	f.kubeconfig = testenv.Kubeconfig(t, f.cfg)
	f.client = kubernetes.NewForConfigOrDie(f.cfg)
	ns, err := f.client.CoreV1().Namespaces().Create(context.Background(),
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "cni-"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	f.namespace = ns.Name
	return f
}

// entry is detour-cni's conflist entry as the node agent writes it, with overrides.
func (f *fixture) entry(overrides map[string]any) map[string]any {
	e := map[string]any{
		"type":         cniplugin.PluginType,
		"kubeconfig":   f.kubeconfig,
		"apiTimeout":   "3s",
		"capabilities": map[string]any{cniplugin.PodAnnotationsCapability: true},
	}
	for k, v := range overrides {
		e[k] = v
	}
	return e
}

func (f *fixture) list(overrides map[string]any) *libcni.NetworkConfigList {
	return testenv.ParseConfList(f.t, testenv.ConfList(f.bridge.Name, append(f.bridge.Plugins(), f.entry(overrides))...))
}

func (f *fixture) primaryOnly() *libcni.NetworkConfigList {
	return testenv.ParseConfList(f.t, testenv.ConfList(f.bridge.Name, f.bridge.Plugins()...))
}

func (f *fixture) createPod(name string, ann map[string]string) *corev1.Pod {
	f.t.Helper()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: f.namespace, Annotations: ann},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "app", Image: "example.invalid/app"}}},
	}
	created, err := f.client.CoreV1().Pods(f.namespace).Create(context.Background(), pod, metav1.CreateOptions{})
	if err != nil {
		f.t.Fatal(err)
	}
	return created
}

// sandbox is a pod's network namespace and its attachment; viaRuntime passes the pod's
// annotations in runtimeConfig as containerd does, else the plugin must GET the pod.
func (f *fixture) sandbox(pod *corev1.Pod, viaRuntime bool) *testenv.Attachment {
	var ann map[string]string
	if viaRuntime {
		ann = pod.Annotations
		if ann == nil {
			ann = map[string]string{}
		}
	}
	return testenv.PodAttachment(testenv.NewNetNS(f.t), pod.Namespace, pod.Name, string(pod.UID), ann)
}

// add runs ADD and returns the sandbox's addresses.
func (f *fixture) add(list *libcni.NetworkConfigList, a *testenv.Attachment) *types100.Result {
	f.t.Helper()
	res, err := f.cni.Add(context.Background(), list, a)
	if err != nil {
		f.t.Fatalf("ADD %s: %v", a.Runtime.ContainerID, err)
	}
	return res
}

func addrOf(t *testing.T, res *types100.Result, v6 bool) netip.Addr {
	t.Helper()
	for _, ip := range res.IPs {
		a, _ := netip.AddrFromSlice(ip.Address.IP)
		a = a.Unmap()
		if a.Is6() == v6 {
			return a
		}
	}
	t.Fatalf("result has no IPv6=%v address: %+v", v6, res.IPs)
	return netip.Addr{}
}

// save is the sandbox's nat table without the lines that change between runs.
func save(t *testing.T, a *testenv.Attachment, backend iptables.Backend, f iptables.Family) string {
	t.Helper()
	out, _, err := iptables.NewExecutor(iptables.WithBackend(backend)).Save(context.Background(), a.NetNS.Path, f)
	if err != nil {
		t.Fatal(err)
	}
	// Comments carry the time, and chain counters ([packets:bytes]) move whenever a packet
	// reaches the namespace; neither is a rule.
	out = regexp.MustCompile(`(?m)^#.*\n`).ReplaceAllString(out, "")
	return regexp.MustCompile(`(?m)^(:\S+ \S+) \[\d+:\d+\]$`).ReplaceAllString(out, "$1")
}

func expect(t *testing.T, ns *testenv.NetNS, id testenv.Identity, addr netip.AddrPort, want string) {
	t.Helper()
	got, err := testenv.Dial(t, ns, id, addr)
	if err != nil || got != want {
		t.Errorf("dial %s as %s = %q, %v; want %q", addr, id, got, err, want)
	}
}

// The seed-003 story, for each backend and for an IPv4 and a dual-stack pod: init containers'
// identities reach the network directly while the app is captured.
func TestIntegrationDelayedRedirect(t *testing.T) {
	for _, tc := range []struct {
		backend   iptables.Backend
		dualStack bool
		viaAPI    bool
	}{
		{iptables.BackendNFT, false, false},
		{iptables.BackendLegacy, false, true},
		{iptables.BackendNFT, true, true},
		{iptables.BackendLegacy, true, false},
		{iptables.BackendNFTables, false, false},
		{iptables.BackendNFTables, true, true},
		{iptables.BackendAuto, false, true},
		{iptables.BackendAuto, true, false},
	} {
		name := string(tc.backend) + map[bool]string{false: "-ipv4", true: "-dualstack"}[tc.dualStack] + map[bool]string{false: "-runtimeconfig", true: "-api"}[tc.viaAPI]
		t.Run(name, func(t *testing.T) {
			f := newFixture(t, tc.dualStack)
			pod := f.createPod("web", redirect.Annotations())
			podSandbox := f.sandbox(pod, !tc.viaAPI)
			res := f.add(f.list(map[string]any{"iptablesBackend": string(tc.backend)}), podSandbox)
			if tc.backend == iptables.BackendAuto {
				if _, used, err := iptables.NewExecutor().Save(context.Background(), podSandbox.NetNS.Path, iptables.IPv4); err != nil || used != iptables.BackendNFTables {
					t.Fatalf("auto wrote a fresh pod's rules with %q (%v), want nftables", used, err)
				}
			}
			remote := testenv.NewNetNS(t)
			remoteRes := f.add(f.primaryOnly(), testenv.PodAttachment(remote, f.namespace, "remote", "", map[string]string{}))

			families := []bool{false}
			if tc.dualStack {
				families = append(families, true)
			}
			for _, v6 := range families {
				network, any := "tcp4", "0.0.0.0"
				if v6 {
					network, any = "tcp6", "::"
				}
				at := func(port uint16) string { return netip.AddrPortFrom(netip.MustParseAddr(any), port).String() }
				testenv.Serve(t, podSandbox.NetNS, "outbound", network, at(4140))
				testenv.Serve(t, podSandbox.NetNS, "inbound", network, at(4143))
				testenv.Serve(t, podSandbox.NetNS, "admin", network, at(4191))
				testenv.Serve(t, remote, "remote", network, at(remotePort))

				dst := netip.AddrPortFrom(addrOf(t, remoteRes, v6), remotePort)
				expect(t, podSandbox.NetNS, initUID, dst, "remote "+dst.String())
				expect(t, podSandbox.NetNS, initGID, dst, "remote "+dst.String())
				expect(t, podSandbox.NetNS, proxy, dst, "remote "+dst.String())
				expect(t, podSandbox.NetNS, app, dst, "outbound "+dst.String())
				podPort := netip.AddrPortFrom(addrOf(t, res, v6), 8081)
				expect(t, remote, testenv.Identity{}, podPort, "inbound "+podPort.String())
				admin := netip.AddrPortFrom(addrOf(t, res, v6), 4191)
				expect(t, remote, testenv.Identity{}, admin, "admin "+admin.String())
			}
			if s := save(t, podSandbox, tc.backend, iptables.IPv6); !tc.dualStack && (strings.Contains(s, "DETOUR") || strings.Contains(s, iptables.NFTOutboundChain(iptables.IPv6))) {
				t.Error("an IPv4-only pod got IPv6 rules")
			}
		})
	}
}

// The runtimeConfig and API paths read the same annotations and install the same rules.
func TestIntegrationAnnotationPathsAgree(t *testing.T) {
	f := newFixture(t, false)
	pod := f.createPod("same", redirect.Annotations())
	viaRuntime, viaAPI := f.sandbox(pod, true), f.sandbox(pod, false)
	f.add(f.list(nil), viaRuntime)
	f.add(f.list(nil), viaAPI)
	a, b := save(t, viaRuntime, iptables.BackendAuto, iptables.IPv4), save(t, viaAPI, iptables.BackendAuto, iptables.IPv4)
	if !strings.Contains(a, iptables.NFTOutboundChain(iptables.IPv4)) || a != b {
		t.Errorf("rules differ between the annotation paths:\n--- runtimeConfig\n%s--- api\n%s", a, b)
	}
}

// A pod without the injected marker gets no rules, and the chain's result is the primary's.
func TestIntegrationNotInjectedPassesThrough(t *testing.T) {
	f := newFixture(t, true)
	for _, viaRuntime := range []bool{true, false} {
		pod := f.createPod("plain-"+map[bool]string{true: "rt", false: "api"}[viaRuntime], map[string]string{"unrelated": "x"})
		a := f.sandbox(pod, viaRuntime)
		res := f.add(f.list(nil), a)
		if len(res.IPs) != 2 || len(res.Interfaces) == 0 {
			t.Errorf("result lost the primary plugin's addresses: %+v", res)
		}
		for _, fam := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
			if s := save(t, a, iptables.BackendNFT, fam); strings.Contains(s, "DETOUR") {
				t.Errorf("a pod that was not injected got %s rules:\n%s", fam, s)
			}
		}
		if err := f.cni.Config.CheckNetworkList(context.Background(), f.list(nil), a.Runtime); err != nil {
			t.Errorf("CHECK of a pod that was not injected: %v", err)
		}
	}
}

// ADD twice gives the same rules, CHECK notices a rule deleted by hand and names it, DEL is
// idempotent and succeeds once the namespace is gone.
func TestIntegrationLifecycle(t *testing.T) {
	f := newFixture(t, false)
	pod := f.createPod("life", redirect.Annotations())
	a := f.sandbox(pod, true)
	list := f.list(map[string]any{"iptablesBackend": "legacy"})
	f.add(list, a)
	first := save(t, a, iptables.BackendLegacy, iptables.IPv4)
	// The runtime re-runs detour-cni alone with the chain's result as prevResult.
	prev, err := f.cni.Config.GetNetworkListCachedResult(list, a.Runtime)
	if err != nil || prev == nil {
		t.Fatalf("cached result: %v", err)
	}
	if _, err := f.cni.AddPlugin(context.Background(), list, len(list.Plugins)-1, a, prev); err != nil {
		t.Fatalf("second ADD: %v", err)
	}
	if second := save(t, a, iptables.BackendLegacy, iptables.IPv4); second != first {
		t.Errorf("a second ADD changed the rules:\n--- first\n%s--- second\n%s", first, second)
	}
	ctx := context.Background()
	if err := f.cni.Config.CheckNetworkList(ctx, list, a.Runtime); err != nil {
		t.Fatalf("CHECK after ADD: %v", err)
	}

	// Delete the exempt-GID rule by hand.
	rule := `-A DETOUR_OUTBOUND -m owner --gid-owner 2601 -m comment --comment "detour/exempt-gid" -j RETURN`
	if err := a.NetNS.Do(func() error {
		_, err := iptables.ExecRunner{}.Run(ctx, "iptables-legacy", append([]string{"-t", "nat", "-D"}, splitRule(rule)[1:]...), nil)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	err = f.cni.Config.CheckNetworkList(ctx, list, a.Runtime)
	if err == nil || !strings.Contains(err.Error(), "--gid-owner 2601") {
		t.Fatalf("CHECK after deleting a rule = %v; want an error naming the missing rule", err)
	}
	t.Logf("CHECK said: %v", err)

	for i := range 2 {
		if err := f.cni.Config.DelNetworkList(ctx, list, a.Runtime); err != nil {
			t.Fatalf("DEL #%d: %v", i+1, err)
		}
	}
	if s := save(t, a, iptables.BackendLegacy, iptables.IPv4); strings.Contains(s, "DETOUR") {
		t.Errorf("rules left after DEL:\n%s", s)
	}
	a.NetNS.Remove()
	if err := f.cni.Config.DelNetworkList(ctx, list, a.Runtime); err != nil {
		t.Fatalf("DEL after the namespace is gone: %v", err)
	}
}

// splitRule splits a rule as iptables-save prints it into arguments, honouring quotes.
func splitRule(rule string) []string {
	var args []string
	for _, m := range regexp.MustCompile(`"[^"]*"|\S+`).FindAllString(rule, -1) {
		args = append(args, strings.Trim(m, `"`))
	}
	return args
}

// ADD fails closed, naming the pod and what to do, when the annotations are malformed or the
// API server cannot be reached within the timeout.
func TestIntegrationFailsClosed(t *testing.T) {
	t.Run("malformed annotation", func(t *testing.T) {
		f := newFixture(t, false)
		bad := redirect.Annotations()
		bad[annotations.ExemptUIDs] = "1000,0"
		pod := f.createPod("bad", bad)
		for _, viaRuntime := range []bool{true, false} {
			_, err := f.cni.Add(context.Background(), f.list(nil), f.sandbox(pod, viaRuntime))
			if err == nil || !strings.Contains(err.Error(), "pod "+f.namespace+"/bad") || !strings.Contains(err.Error(), annotations.ExemptUIDs) || !strings.Contains(err.Error(), "recreate the pod") {
				t.Errorf("ADD with a malformed annotation = %v; want an error naming the pod, the annotation and the fix", err)
			}
		}
	})
	t.Run("api server stopped", func(t *testing.T) {
		testenv.Privileged(t)
		env := testenv.NewEnvironment()
		cfg, err := env.Start()
		if err != nil {
			t.Fatal(err)
		}
		kubeconfig := testenv.Kubeconfig(t, cfg)
		if err := env.Stop(); err != nil {
			t.Fatal(err)
		}
		cni, bridge := testenv.NewCNI(t), testenv.NewBridge(t, false)
		entry := map[string]any{"type": cniplugin.PluginType, "kubeconfig": kubeconfig, "apiTimeout": "1s"}
		list := testenv.ParseConfList(t, testenv.ConfList(bridge.Name, append(bridge.Plugins(), entry)...))
		a := testenv.PodAttachment(testenv.NewNetNS(t), "default", "orphan", "", nil)
		start := time.Now()
		_, err = cni.Add(context.Background(), list, a)
		took := time.Since(start)
		if err == nil || !strings.Contains(err.Error(), "could not read the pod from the API server") || !strings.Contains(err.Error(), "fails closed") {
			t.Fatalf("ADD with the API server down = %v; want the documented fail-closed message", err)
		}
		// Bounded by the configured timeout, not by client-go's defaults (which retry for much
		// longer): a generous bound for a busy 2-core machine.
		if took > 10*time.Second {
			t.Errorf("ADD took %s to fail with apiTimeout 1s", took)
		}
		t.Logf("ADD failed after %s: %v", took.Round(time.Millisecond), err)
	})
}

// Sixteen sandboxes added at once all get their rules.
func TestIntegrationConcurrentAdds(t *testing.T) {
	f := newFixture(t, false)
	pod := f.createPod("many", redirect.Annotations())
	list := f.list(nil)
	want, err := iptables.Build(iptables.ConfigFromRedirect(redirect, iptables.IPv4))
	if err != nil {
		t.Fatal(err)
	}
	sandboxes := make([]*testenv.Attachment, 16)
	for i := range sandboxes {
		sandboxes[i] = f.sandbox(pod, i%2 == 0)
	}
	var wg sync.WaitGroup
	errs := make([]error, len(sandboxes))
	for i, a := range sandboxes {
		wg.Go(func() { _, errs[i] = f.cni.Add(context.Background(), list, a) })
	}
	wg.Wait()
	for i, a := range sandboxes {
		if errs[i] != nil {
			t.Errorf("ADD %d: %v", i, errs[i])
			continue
		}
		if err := iptables.NewExecutor().Check(context.Background(), a.NetNS.Path, want); err != nil {
			t.Errorf("sandbox %d: %v", i, err)
		}
	}
}

// The plugin needs nothing but the iptables tools: no nsenter, no util-linux.
func TestIntegrationNoNsenter(t *testing.T) {
	f := newFixture(t, false)
	pod := f.createPod("talos", redirect.Annotations())
	a := f.sandbox(pod, true)

	dir := t.TempDir()
	for _, tool := range []string{"iptables", "iptables-save", "iptables-restore", "ip6tables", "ip6tables-save", "ip6tables-restore",
		"iptables-nft-save", "iptables-nft-restore", "ip6tables-nft-save", "ip6tables-nft-restore",
		"iptables-legacy-save", "iptables-legacy-restore", "ip6tables-legacy-save", "ip6tables-legacy-restore"} {
		p, err := exec.LookPath(tool)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(p, filepath.Join(dir, tool)); err != nil {
			t.Fatal(err)
		}
	}
	t.Setenv("PATH", dir)
	if p, err := exec.LookPath("nsenter"); err == nil {
		t.Fatalf("nsenter is still reachable at %s", p)
	}
	f.add(f.list(nil), a)
	want, _ := iptables.Build(iptables.ConfigFromRedirect(redirect, iptables.IPv4))
	if err := iptables.NewExecutor().Check(context.Background(), a.NetNS.Path, want); err != nil {
		t.Fatalf("rules after an ADD without nsenter on PATH: %v", err)
	}
}

// The nftables backend, and auto in a fresh namespace, need no tool at all: ADD, CHECK and DEL
// with a PATH that holds no iptables, ip6tables or nft binary, and the app's traffic is captured.
func TestIntegrationNFTablesWithoutTools(t *testing.T) {
	for _, backend := range []iptables.Backend{iptables.BackendNFTables, iptables.BackendAuto} {
		t.Run(string(backend), func(t *testing.T) {
			f := newFixture(t, true)
			pod := f.createPod("bottlerocket", redirect.Annotations())
			a := f.sandbox(pod, true)
			remote := testenv.NewNetNS(t) // before the PATH is emptied: testenv looks for the tools
			t.Setenv("PATH", t.TempDir())
			for _, tool := range []string{"iptables", "ip6tables", "nft", "iptables-nft-restore", "iptables-legacy-restore", "nsenter"} {
				if p, err := exec.LookPath(tool); err == nil {
					t.Fatalf("%s is still on PATH at %s", tool, p)
				}
			}
			list := f.list(map[string]any{"iptablesBackend": string(backend)})
			f.add(list, a)
			if err := f.cni.Config.CheckNetworkList(context.Background(), list, a.Runtime); err != nil {
				t.Fatalf("CHECK: %v", err)
			}
			var want []iptables.Ruleset
			for _, fam := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
				rs, _ := iptables.Build(iptables.ConfigFromRedirect(redirect, fam))
				want = append(want, rs)
			}
			nft := iptables.NewExecutor(iptables.WithBackend(iptables.BackendNFTables))
			if err := nft.Check(context.Background(), a.NetNS.Path, want...); err != nil {
				t.Fatalf("rules after ADD: %v", err)
			}
			remoteRes := f.add(f.primaryOnly(), testenv.PodAttachment(remote, f.namespace, "remote", "", map[string]string{}))
			testenv.Serve(t, a.NetNS, "outbound", "tcp6", "[::]:4140")
			testenv.Serve(t, remote, "remote", "tcp6", "[::]:8080")
			dst := netip.AddrPortFrom(addrOf(t, remoteRes, true), remotePort)
			expect(t, a.NetNS, app, dst, "outbound "+dst.String())
			expect(t, a.NetNS, initGID, dst, "remote "+dst.String())
			for range 2 {
				if err := f.cni.Config.DelNetworkList(context.Background(), list, a.Runtime); err != nil {
					t.Fatalf("DEL: %v", err)
				}
			}
			if s, _, err := nft.Save(context.Background(), a.NetNS.Path, iptables.IPv4); err != nil || s != "" {
				t.Errorf("after DEL: table %q, %v; want none", s, err)
			}
		})
	}
}
