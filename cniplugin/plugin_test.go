package cniplugin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/test/testenv"
)

const prevResult = `{"cniVersion":"1.1.0","interfaces":[{"name":"eth0","mac":"0a:58:0a:f4:00:05","sandbox":"/var/run/netns/x"}],` +
	`"ips":[{"interface":0,"address":"10.244.0.5/24","gateway":"10.244.0.1"}],"routes":[{"dst":"0.0.0.0/0"}],"dns":{"nameservers":["10.96.0.10"],"search":["shop.svc.cluster.local"]}}`

func conf(t *testing.T, extra string) []byte {
	t.Helper()
	s := `{"cniVersion":"1.1.0","name":"k8s","type":"detour-cni","prevResult":` + prevResult + extra + `}`
	if !json.Valid([]byte(s)) {
		t.Fatalf("invalid test config: %s", s)
	}
	return []byte(s)
}

func TestParseConfigDefaults(t *testing.T) {
	c, err := ParseConfig([]byte(`{"cniVersion":"1.1.0","name":"k8s","type":"detour-cni","somethingElse":{"a":1}}`))
	if err != nil {
		t.Fatal(err)
	}
	if c.APITimeout != DefaultAPITimeout || c.IPTablesBackend != iptables.BackendAuto || c.LogLevel != slog.LevelInfo ||
		c.IPv6 != IPv6Auto || len(c.ExcludeNamespaces) != 1 || c.ExcludeNamespaces[0] != "kube-system" || c.PodAnnotations != nil {
		t.Errorf("defaults = %+v", c)
	}
	c, err = ParseConfig([]byte(`{"type":"detour-cni","kubeconfig":"/etc/k","apiTimeout":"750ms","iptablesBackend":"legacy","logLevel":"debug",
		"logFile":"/var/log/d.log","excludeNamespaces":[],"ipv6":"always","runtimeConfig":{"io.kubernetes.cri.pod-annotations":{"a":"b"}}}`))
	if err != nil {
		t.Fatal(err)
	}
	if c.Kubeconfig != "/etc/k" || c.APITimeout != 750*time.Millisecond || c.IPTablesBackend != iptables.BackendLegacy ||
		c.LogLevel != slog.LevelDebug || c.LogFile != "/var/log/d.log" || len(c.ExcludeNamespaces) != 0 || c.IPv6 != IPv6Always || c.PodAnnotations["a"] != "b" {
		t.Errorf("parsed = %+v", c)
	}
}

func TestParseConfigErrors(t *testing.T) {
	for _, tc := range []struct{ json, want string }{
		{`{"kubeconfig":"relative/path"}`, `kubeconfig "relative/path" is not valid: it must be an absolute path`},
		{`{"apiTimeout":"5"}`, `apiTimeout "5" is not valid`},
		{`{"apiTimeout":"10ms"}`, `from 100ms to 2m0s`},
		{`{"iptablesBackend":"iptables"}`, `iptablesBackend "iptables" is not valid: it must be "auto", "legacy", "nft" or "nftables"`},
		{`{"logLevel":"loud"}`, `logLevel "loud"`},
		{`{"logFile":"d.log"}`, `logFile "d.log"`},
		{`{"excludeNamespaces":["Kube_System"]}`, `excludeNamespaces "Kube_System"`},
		{`{"ipv6":"never"}`, `ipv6 "never"`},
		{`{"apiTimeout":5}`, `parse the detour-cni network configuration`},
		{`not json`, `parse the detour-cni network configuration`},
	} {
		_, err := ParseConfig([]byte(tc.json))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ParseConfig(%s) = %v; want an error containing %q", tc.json, err, tc.want)
		}
	}
}

func FuzzParseConfig(f *testing.F) {
	f.Add([]byte(`{"type":"detour-cni","apiTimeout":"5s","excludeNamespaces":["a"],"runtimeConfig":{"io.kubernetes.cri.pod-annotations":{}}}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := ParseConfig(b)
		if err == nil && (c.APITimeout < minAPITimeout || c.IPv6 == "") {
			t.Fatalf("accepted an invalid config: %+v", c)
		}
	})
}

func TestParsePodRef(t *testing.T) {
	r := parsePodRef("IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=u-1")
	if r != (podRef{Namespace: "shop", Name: "web-0", UID: "u-1"}) || r.String() != "shop/web-0" {
		t.Errorf("parsePodRef = %+v", r)
	}
	if r := parsePodRef(""); r.Name != "" || r.String() != "(not a Kubernetes pod)" {
		t.Errorf("parsePodRef(\"\") = %+v", r)
	}
}

// fakeGetter answers GetPod from a map, or with err.
type fakeGetter struct {
	pods  map[string]PodMeta
	err   error
	calls int
}

func (g *fakeGetter) GetPod(_ context.Context, ns, name string) (PodMeta, error) {
	g.calls++
	if g.err != nil {
		return PodMeta{}, g.err
	}
	p, ok := g.pods[ns+"/"+name]
	if !ok {
		return PodMeta{}, errPodNotFound
	}
	return p, nil
}

// testPlugin returns a plugin whose API is g and whose executor must never be used (these
// tests cover the paths that leave a pod alone or fail before touching iptables).
func testPlugin(g *fakeGetter) (*Plugin, *bytes.Buffer, *bytes.Buffer) {
	var out, log bytes.Buffer
	p := &Plugin{
		Stdout:       &out,
		Stderr:       &log,
		NewExecutor:  func(*Config) *iptables.Executor { panic("the executor must not be used on this path") },
		NewPodGetter: func(*Config) (PodGetter, error) { return g, nil },
	}
	return p, &out, &log
}

func cmdArgs(stdin []byte, cniArgs string) *skel.CmdArgs {
	return &skel.CmdArgs{ContainerID: "c1", Netns: "/var/run/netns/x", IfName: "eth0", Args: cniArgs, StdinData: stdin}
}

const podArgs = "K8S_POD_NAMESPACE=shop;K8S_POD_NAME=web;K8S_POD_UID=u-1"

// Every path that leaves the pod alone prints prevResult through unchanged.
func TestAddPassesPrevResultThrough(t *testing.T) {
	kube := `,"kubeconfig":"/etc/k"`
	plain := map[string]PodMeta{"shop/web": {UID: "u-1", Annotations: map[string]string{"x": "y"}}}
	for _, tc := range []struct {
		name, extra, args, decision string
		apiCalls                    int
	}{
		{"no pod in CNI_ARGS", kube, "", "no K8S_POD_NAMESPACE", 0},
		{"excluded namespace", kube, "K8S_POD_NAMESPACE=kube-system;K8S_POD_NAME=dns", "namespace excluded", 0},
		{"not injected, runtimeConfig", `,"runtimeConfig":{"io.kubernetes.cri.pod-annotations":{"x":"y"}}`, podArgs, "not injected", 0},
		{"not injected, api", kube, podArgs, "not injected", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := &fakeGetter{pods: plain}
			p, out, log := testPlugin(g)
			if err := p.Add(cmdArgs(conf(t, tc.extra), tc.args)); err != nil {
				t.Fatal(err)
			}
			var got, want any
			json.Unmarshal(out.Bytes(), &got)
			json.Unmarshal([]byte(prevResult), &want)
			gotJSON, _ := json.Marshal(got)
			wantJSON, _ := json.Marshal(want)
			if string(gotJSON) != string(wantJSON) {
				t.Errorf("ADD printed\n%s\nwant prevResult\n%s", out, prevResult)
			}
			if !strings.Contains(log.String(), tc.decision) || !strings.Contains(log.String(), `"command":"ADD"`) {
				t.Errorf("log line %q lacks the decision %q", log, tc.decision)
			}
			if g.calls != tc.apiCalls {
				t.Errorf("%d API calls, want %d", g.calls, tc.apiCalls)
			}
		})
	}
}

func TestAddFailsClosed(t *testing.T) {
	injected := annotations.Redirect{Version: "v1", ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140}.Annotations()
	bad := map[string]string{}
	for k, v := range injected {
		bad[k] = v
	}
	bad[annotations.ExemptGIDs] = "0"
	for _, tc := range []struct {
		name, stdinExtra string
		noPrev           bool
		getter           *fakeGetter
		want             []string
		code             uint
	}{
		{"no prevResult", `,"kubeconfig":"/etc/k"`, true, &fakeGetter{}, []string{"no prevResult", "chained plugin"}, types.ErrInvalidNetworkConfig},
		{"no kubeconfig and no runtimeConfig", ``, false, &fakeGetter{}, []string{"pod shop/web", `set "kubeconfig"`}, types.ErrInvalidNetworkConfig},
		{"api down", `,"kubeconfig":"/etc/k"`, false, &fakeGetter{err: errors.New("connection refused")}, []string{"pod shop/web", "connection refused", "fails closed"}, types.ErrTryAgainLater},
		{"pod not found", `,"kubeconfig":"/etc/k"`, false, &fakeGetter{}, []string{"pod shop/web", "does not exist"}, types.ErrTryAgainLater},
		{"pod replaced", `,"kubeconfig":"/etc/k"`, false, &fakeGetter{pods: map[string]PodMeta{"shop/web": {UID: "u-2", Annotations: injected}}}, []string{"UID u-2", "UID u-1", "replaced"}, types.ErrTryAgainLater},
		{"malformed annotation", `,"kubeconfig":"/etc/k"`, false, &fakeGetter{pods: map[string]PodMeta{"shop/web": {UID: "u-1", Annotations: bad}}}, []string{"pod shop/web", annotations.ExemptGIDs, "recreate the pod"}, types.ErrInvalidNetworkConfig},
		{"bad config", `,"iptablesBackend":"x"`, false, &fakeGetter{}, []string{`iptablesBackend "x"`}, types.ErrInternal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, out, log := testPlugin(tc.getter)
			stdin := conf(t, tc.stdinExtra)
			if tc.noPrev {
				stdin = []byte(`{"cniVersion":"1.1.0","name":"k8s","type":"detour-cni"` + tc.stdinExtra + `}`)
			}
			err := p.Add(cmdArgs(stdin, podArgs))
			var cniErr *types.Error
			if !errors.As(err, &cniErr) {
				t.Fatalf("ADD = %v; want a CNI error", err)
			}
			for _, w := range tc.want {
				if !strings.Contains(cniErr.Msg, w) {
					t.Errorf("error %q lacks %q", cniErr.Msg, w)
				}
			}
			if cniErr.Code != tc.code {
				t.Errorf("error code %d, want %d", cniErr.Code, tc.code)
			}
			if out.Len() != 0 {
				t.Errorf("a failed ADD printed a result: %s", out)
			}
			if !strings.Contains(log.String(), `"level":"ERROR"`) {
				t.Errorf("no error log line: %s", log)
			}
		})
	}
}

func TestGCHasNothingToCollect(t *testing.T) {
	p, _, log := testPlugin(&fakeGetter{})
	if err := p.GC(cmdArgs([]byte(`{"cniVersion":"1.1.0","name":"k8s","type":"detour-cni"}`), "")); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(log.String(), "nothing to collect") {
		t.Errorf("log = %s", log)
	}
}

func TestDelWithoutNamespaceSucceeds(t *testing.T) {
	p, _, _ := testPlugin(&fakeGetter{})
	for _, netns := range []string{"", "/var/run/netns/gone-for-good"} {
		a := cmdArgs([]byte(`{"cniVersion":"1.1.0","name":"k8s","type":"detour-cni"}`), podArgs)
		a.Netns = netns
		if err := p.Del(a); err != nil {
			t.Errorf("DEL with netns %q: %v", netns, err)
		}
	}
}

// Issue 15.2: STATUS, which containerd calls every 5 s and whose failure marks the node's
// network not ready, fails only for what breaks ADD for every pod, and logs only a change.
func TestStatus(t *testing.T) {
	kubeconfig := writeKubeconfig(t, "current-context: a\ncontexts: [{name: a, context: {cluster: c, user: u}}]\nclusters: [{name: c, cluster: {server: \"https://127.0.0.1:6443\"}}]\nusers: [{name: u, user: {tokenFile: t}}]\n")
	stateDir := t.TempDir()
	var log bytes.Buffer
	status := func(extra string) error {
		p := New()
		p.Stdout, p.Stderr, p.StateDir = &bytes.Buffer{}, &log, stateDir
		return p.Status(cmdArgs([]byte(`{"cniVersion":"1.1.0","name":"k8s","type":"detour-cni"`+extra+`}`), ""))
	}
	lines := func() []string {
		defer log.Reset()
		return strings.Split(strings.TrimSpace(log.String()), "\n")
	}
	t.Run("iptables missing", func(t *testing.T) {
		t.Setenv("PATH", t.TempDir())
		if err := status(`,"iptablesBackend":"nft"`); err != nil {
			t.Fatalf("STATUS without iptables = %v; it breaks injected pods only, not the node", err)
		}
		if l := lines(); len(l) != 1 || !strings.Contains(l[0], `"level":"WARN"`) || !strings.Contains(l[0], "no usable ipv4 iptables backend") {
			t.Fatalf("log %q, want one warning", l)
		}
		for range 100 {
			if err := status(`,"iptablesBackend":"nft"`); err != nil {
				t.Fatal(err)
			}
		}
		if log.Len() != 0 {
			t.Fatalf("the same outcome was logged again:\n%s", log.String())
		}
	})
	t.Run("ip6tables missing", func(t *testing.T) {
		// The IPv4 tools alone: IPv4 pods get their rules, a dual-stack or IPv6-only pod's ADD
		// fails, so the log says so.
		dir := t.TempDir()
		for _, tool := range []string{"iptables-nft", "iptables-nft-save", "iptables-nft-restore"} {
			path, err := exec.LookPath(tool)
			if err != nil {
				t.Skipf("needs %s on PATH (hack/host-deps.sh installs it)", tool)
			}
			if err := os.Symlink(path, filepath.Join(dir, tool)); err != nil {
				t.Fatal(err)
			}
		}
		t.Setenv("PATH", dir)
		log.Reset()
		if err := status(`,"iptablesBackend":"nft"`); err != nil {
			t.Fatalf("STATUS without ip6tables = %v; it breaks IPv6 pods only, not the node", err)
		}
		if l := lines(); len(l) != 1 || !strings.Contains(l[0], `"level":"WARN"`) || !strings.Contains(l[0], "with an IPv6 address") || !strings.Contains(l[0], "ipv6") {
			t.Fatalf("log %q, want one warning naming IPv6 pods", l)
		}
	})
	t.Run("iptables missing, auto", func(t *testing.T) {
		testenv.Privileged(t) // nf_tables answers CAP_NET_ADMIN only
		t.Setenv("PATH", t.TempDir())
		log.Reset()
		if err := status(""); err != nil {
			t.Fatal(err)
		}
		if l := lines(); len(l) != 1 || !strings.Contains(l[0], `"decision":"ready"`) || strings.Contains(l[0], "WARN") {
			t.Fatalf("log %q; auto needs no iptables tool where the kernel answers nf_tables requests", l)
		}
	})
	t.Run("kubeconfig unreadable", func(t *testing.T) {
		if _, err := exec.LookPath("iptables-nft-restore"); err != nil {
			t.Skip("needs the iptables tools on PATH (hack/host-deps.sh installs them)")
		}
		log.Reset()
		if err := status(`,"kubeconfig":"/nonexistent/detour-cni.kubeconfig"`); err != nil {
			t.Fatalf("STATUS with an unreadable kubeconfig = %v; pods whose annotations come from the runtime need none", err)
		}
		if l := lines(); len(l) != 1 || !strings.Contains(l[0], "/nonexistent/detour-cni.kubeconfig") || !strings.Contains(l[0], "node agent") {
			t.Fatalf("log %q", l)
		}
		if err := os.WriteFile(filepath.Join(filepath.Dir(kubeconfig), "t"), []byte("token"), 0o600); err != nil {
			t.Fatal(err)
		}
		for range 100 {
			if err := status(`,"kubeconfig":"` + kubeconfig + `"`); err != nil {
				t.Fatalf("STATUS with a readable kubeconfig and iptables: %v", err)
			}
		}
		if l := lines(); len(l) != 1 || !strings.Contains(l[0], `"level":"INFO"`) || !strings.Contains(l[0], `"decision":"ready"`) {
			t.Fatalf("100 healthy STATUS calls logged %q; want the change to ready, once", l)
		}
	})
	t.Run("configuration broken", func(t *testing.T) {
		log.Reset()
		for range 3 {
			if err := status(`,"iptablesBackend":"x"`); err == nil {
				t.Fatal("STATUS with a configuration ADD cannot parse succeeded")
			}
		}
		if l := lines(); len(l) != 1 || !strings.Contains(l[0], `"level":"ERROR"`) {
			t.Fatalf("log %q, want one error", l)
		}
	})
}

// Without a state directory STATUS still logs its problems (and a clean "ready" at debug only).
func TestStatusWithoutStateLogsOnlyProblems(t *testing.T) {
	p, _, log := testPlugin(&fakeGetter{})
	p.NewExecutor = func(*Config) *iptables.Executor {
		return iptables.NewExecutor(iptables.WithBackend(iptables.BackendNFT))
	}
	t.Setenv("PATH", t.TempDir())
	if err := p.Status(cmdArgs([]byte(`{"cniVersion":"1.1.0","name":"k8s","type":"detour-cni"}`), "")); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(log.String(), "WARN") {
		t.Errorf("log %q, want the warning", log)
	}
}

// Issue 15.2: the log file is rotated at a size, so it cannot grow without bound.
func TestLogFileRotates(t *testing.T) {
	path := filepath.Join(t.TempDir(), "detour-cni.log")
	for i := range 50 {
		f, err := openLogFile(path, 1000)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(f, "%03d %s\n", i, strings.Repeat("x", 95))
		f.Close()
	}
	cur, _ := os.ReadFile(path)
	old, _ := os.ReadFile(path + ".1")
	if len(cur) > 1000 || len(old) > 1100 || len(old) < 1000 {
		t.Errorf("log %d bytes, rotated %d bytes; want at most the limit, and a full rotated file", len(cur), len(old))
	}
	if !strings.Contains(string(cur), "049 ") || !strings.Contains(string(old), "039 ") {
		t.Errorf("the latest lines are not where they belong:\n%s\n--\n%s", cur, old)
	}
	entries, _ := os.ReadDir(filepath.Dir(path))
	if len(entries) != 2 {
		t.Errorf("files %v, want the log and one rotated file", entries)
	}
}

// Issue 15.11: an xtables lock timeout is CNI's "try again later" (11), not an internal error.
func TestRedirectErrorLockTimeout(t *testing.T) {
	pod := podRef{Namespace: "shop", Name: "web"}
	lock := fmt.Errorf("apply ipv4 rules in /x: legacy backend: %w", &iptables.ExecError{Name: "iptables-legacy-restore", Args: []string{"--noflush", "-w", "5"},
		Err: errors.New("exit status 4"), Stderr: "Another app is currently holding the xtables lock. Stopped waiting after 5s."})
	var cniErr *types.Error
	if err := redirectError(pod, lock); !errors.As(err, &cniErr) || cniErr.Code != types.ErrTryAgainLater || !strings.Contains(cniErr.Msg, "xtables lock") {
		t.Errorf("lock timeout = %#v, want code %d", err, types.ErrTryAgainLater)
	}
	other := &iptables.ExecError{Name: "iptables-legacy-restore", Err: errors.New("exit status 2"), Stderr: "line 3 failed"}
	if err := redirectError(pod, other); errors.As(err, &cniErr) {
		t.Errorf("another failure = %v, want an internal error", err)
	}
}
