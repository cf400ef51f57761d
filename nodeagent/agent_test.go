package nodeagent_test

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/cniplugin"
	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/nodeagent"
)

// env is a node's directories in a temporary directory: the CNI config and bin dirs, the
// agent's service account, and the plugin binary it installs.
type env struct {
	confDir, binDir, saDir, source string
	flags                          nodeagent.Flags
}

func newEnv(t testing.TB) *env {
	t.Helper()
	root := t.TempDir()
	e := &env{
		confDir: filepath.Join(root, "etc/cni/net.d"),
		binDir:  filepath.Join(root, "opt/cni/bin"),
		saDir:   filepath.Join(root, "serviceaccount"),
		source:  filepath.Join(root, "image/detour-cni"),
	}
	for _, d := range []string{e.confDir, e.binDir, filepath.Dir(e.source)} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	writeFile(t, e.source, "#!/bin/sh\necho detour-cni v1\n")
	e.rotateToken(t, "token-1", []byte("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"))
	e.flags = nodeagent.DefaultFlags()
	e.flags.ConfDir, e.flags.HostConfDir, e.flags.BinDir = e.confDir, e.confDir, e.binDir
	e.flags.ServiceAccountDir, e.flags.PluginSource = e.saDir, e.source
	e.flags.APIServer = "https://10.96.0.1:443"
	e.flags.NodeName = ""
	e.flags.Resync = time.Second
	return e
}

// rotateToken writes the service account files the way the kubelet does: a new timestamped
// directory, then the ..data symlink swapped atomically; token and ca.crt link through it.
func (e *env) rotateToken(t testing.TB, token string, ca []byte) {
	t.Helper()
	stamp := filepath.Join(e.saDir, ".."+strings.ReplaceAll(time.Now().Format("2006_01_02_15_04_05.000000000"), ".", "_"))
	if err := os.MkdirAll(stamp, 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(stamp, "token"), token)
	writeFile(t, filepath.Join(stamp, "ca.crt"), string(ca))
	tmp := filepath.Join(e.saDir, "..data_tmp")
	if err := os.Symlink(filepath.Base(stamp), tmp); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(e.saDir, "..data")); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"token", "ca.crt"} {
		if _, err := os.Lstat(filepath.Join(e.saDir, f)); err != nil {
			if err := os.Symlink(filepath.Join("..data", f), filepath.Join(e.saDir, f)); err != nil {
				t.Fatal(err)
			}
		}
	}
}

func (e *env) config(t testing.TB) nodeagent.Config {
	t.Helper()
	cfg, err := e.flags.Parse()
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

func (e *env) agent(t *testing.T, opts ...nodeagent.Option) *nodeagent.Agent {
	t.Helper()
	opts = append([]nodeagent.Option{nodeagent.WithLogger(testLogger(t)), nodeagent.WithDebounce(10 * time.Millisecond)}, opts...)
	return nodeagent.New(e.config(t), opts...)
}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimSpace(string(b)))
	return len(b), nil
}

func writeFile(t testing.TB, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// writeAtomic replaces path the way a careful primary CNI agent does.
func writeAtomic(t *testing.T, path, content string) {
	t.Helper()
	tmp := filepath.Join(filepath.Dir(path), ".primary-tmp")
	writeFile(t, tmp, content)
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// snapshot is every file under dirs with its content, to show what a step wrote.
func snapshot(t *testing.T, dirs ...string) map[string]string {
	t.Helper()
	files := map[string]string{}
	for _, d := range dirs {
		filepath.WalkDir(d, func(p string, de os.DirEntry, err error) error {
			if err == nil && !de.IsDir() {
				files[p] = readFile(t, p)
			}
			return nil
		})
	}
	return files
}

const calico = `{
  "name": "k8s-pod-network",
  "cniVersion": "0.3.1",
  "plugins": [
    {"type": "calico", "datastore_type": "kubernetes", "ipam": {"type": "calico-ipam"}},
    {"type": "portmap", "snat": true, "capabilities": {"portMappings": true}}
  ]
}`

// pluginTypes returns the plugin types of a conflist through libcni, as the runtime reads it.
func pluginTypes(t *testing.T, conflist string) []string {
	t.Helper()
	list, err := libcni.ConfListFromBytes([]byte(conflist))
	if err != nil {
		t.Fatalf("the runtime cannot load the conflist: %v\n%s", err, conflist)
	}
	var types []string
	for _, p := range list.Plugins {
		types = append(types, p.Network.Type)
	}
	return types
}

func TestReconcileNoPrimaryWritesNothing(t *testing.T) {
	e := newEnv(t)
	writeFile(t, filepath.Join(e.confDir, "README"), "not a network")
	before := snapshot(t, e.confDir, e.binDir)
	a := e.agent(t)
	s, err := a.Reconcile(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if s.ConfigInPlace || !strings.Contains(s.Reason, "waiting for the primary CNI") {
		t.Errorf("status %+v", s)
	}
	if after := snapshot(t, e.confDir, e.binDir); !equalMaps(before, after) {
		t.Errorf("wrote files with no primary config: %v", after)
	}
	if ok, _ := a.Ready(); ok {
		t.Error("ready without a primary config")
	}
}

func equalMaps(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

func TestReconcileConflistAppended(t *testing.T) {
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	a := e.agent(t)
	s, err := a.Reconcile(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !s.ConfigInPlace || s.Primary != primary {
		t.Errorf("status %+v", s)
	}
	if ok, reason := a.Ready(); !ok {
		t.Errorf("not ready: %s", reason)
	}
	got := readFile(t, primary)
	if types := pluginTypes(t, got); !slices.Equal(types, []string{"calico", "portmap", "detour-cni"}) {
		t.Errorf("plugins %v", types)
	}
	// The entry is the contract the plugin parses.
	var list struct {
		Plugins []map[string]any `json:"plugins"`
	}
	json.Unmarshal([]byte(got), &list)
	entry := list.Plugins[2]
	want := map[string]any{
		"type": "detour-cni", "name": "detour-cni", "kubeconfig": filepath.Join(e.confDir, "detour-cni.kubeconfig"),
		"apiTimeout": "5s", "iptablesBackend": "auto", "logLevel": "info", "excludeNamespaces": []any{"kube-system"},
		"capabilities": map[string]any{"io.kubernetes.cri.pod-annotations": true},
	}
	if b1, b2 := mustJSON(entry), mustJSON(want); b1 != b2 {
		t.Errorf("entry\n%s\nwant\n%s", b1, b2)
	}

	// The binary, executable and identical to its source.
	bin := filepath.Join(e.binDir, "detour-cni")
	if readFile(t, bin) != readFile(t, e.source) {
		t.Error("installed binary differs from its source")
	}
	if st, _ := os.Stat(bin); st.Mode().Perm() != 0o755 {
		t.Errorf("binary mode %v", st.Mode())
	}
	// The kubeconfig and token copy, 0600, the token by file.
	for _, f := range []string{"detour-cni.kubeconfig", "detour-cni.token"} {
		if st, err := os.Stat(filepath.Join(e.confDir, f)); err != nil || st.Mode().Perm() != 0o600 {
			t.Errorf("%s: %v, mode %v; want mode 0600", f, err, st.Mode())
		}
	}
	kc, err := clientcmd.LoadFromFile(filepath.Join(e.confDir, "detour-cni.kubeconfig"))
	if err != nil {
		t.Fatal(err)
	}
	ctx := kc.Contexts[kc.CurrentContext]
	user, cluster := kc.AuthInfos[ctx.AuthInfo], kc.Clusters[ctx.Cluster]
	if user.TokenFile != filepath.Join(e.confDir, "detour-cni.token") || user.Token != "" || cluster.Server != "https://10.96.0.1:443" || !bytes.Contains(cluster.CertificateAuthorityData, []byte("MIIB")) {
		t.Errorf("kubeconfig user %+v cluster %+v", user, cluster)
	}
	if readFile(t, filepath.Join(e.confDir, "detour-cni.token")) != "token-1" {
		t.Error("token copy differs from the service account token")
	}

	// Nothing changes on the next reconcile: nothing is written.
	before := inodes(t, e.confDir, e.binDir)
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if after := inodes(t, e.confDir, e.binDir); !equalMaps(before, after) {
		t.Errorf("a reconcile with nothing to do rewrote files:\n%v\n%v", before, after)
	}
}

func mustJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// inodes identifies every file by inode and modification time: a rewrite changes them.
func inodes(t *testing.T, dirs ...string) map[string]string {
	t.Helper()
	m := map[string]string{}
	for _, d := range dirs {
		entries, _ := os.ReadDir(d)
		for _, de := range entries {
			st, err := os.Stat(filepath.Join(d, de.Name()))
			if err != nil {
				continue
			}
			m[de.Name()] = fmt.Sprint(st.ModTime(), "/", st.Sys().(*syscall.Stat_t).Ino)
		}
	}
	return m
}

func TestReconcileConfConverted(t *testing.T) {
	e := newEnv(t)
	const kindnet = `{"cniVersion":"0.4.0","name":"kindnet","type":"ptp","ipMasq":false,"ipam":{"type":"host-local","ranges":[[{"subnet":"10.244.1.0/24"}]]},"mtu":1500}`
	conf := filepath.Join(e.confDir, "10-kindnet.conf")
	writeFile(t, conf, kindnet)
	writeFile(t, filepath.Join(e.confDir, "99-loopback.conf"), `{"cniVersion":"0.4.0","name":"lo","type":"loopback"}`)
	a := e.agent(t)
	for round := range 2 { // the primary writes its .conf again after the conversion
		s, err := a.Reconcile(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		conflist := filepath.Join(e.confDir, "10-kindnet.conflist")
		if s.Primary != conflist || !s.ConfigInPlace {
			t.Errorf("round %d: status %+v", round, s)
		}
		if _, err := os.Stat(conf); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("round %d: the .conf is still there (%v): the runtime would load it first", round, err)
		}
		if p, _ := nodeagent.Primary(e.confDir); p != conflist {
			t.Errorf("round %d: the runtime loads %s", round, p)
		}
		got := readFile(t, conflist)
		if types := pluginTypes(t, got); !slices.Equal(types, []string{"ptp", "detour-cni"}) {
			t.Errorf("round %d: plugins %v", round, types)
		}
		list, _ := libcni.ConfListFromBytes([]byte(got))
		if list.Name != "kindnet" || list.CNIVersion != "0.4.0" || !strings.Contains(string(list.Plugins[0].Bytes), `"mtu":1500`) {
			t.Errorf("round %d: converted list lost fields: %s", round, got)
		}
		writeFile(t, conf, kindnet)
	}
}

func TestReconcileEditsOnlyTheRuntimesConfig(t *testing.T) {
	e := newEnv(t)
	others := map[string]string{
		"20-flannel.conflist": `{"name":"cbr0","cniVersion":"0.3.1","plugins":[{"type":"flannel"}]}`,
		"87-podman.conflist":  `{"name":"podman","cniVersion":"1.0.0","plugins":[{"type":"bridge"}]}`,
		"99-loopback.conf":    `{"cniVersion":"0.3.1","name":"lo","type":"loopback"}`,
		"aa.json":             `{"cniVersion":"0.3.1","name":"x","type":"bridge"}`,
		"00-notes.txt":        `not a network`,
	}
	for name, content := range others {
		writeFile(t, filepath.Join(e.confDir, name), content)
	}
	writeFile(t, filepath.Join(e.confDir, "10-calico.conflist"), calico)
	if s, err := e.agent(t).Reconcile(context.Background()); err != nil || !s.ConfigInPlace {
		t.Fatalf("Reconcile = %+v, %v", s, err)
	}
	for name, content := range others {
		if got := readFile(t, filepath.Join(e.confDir, name)); got != content {
			t.Errorf("%s was edited:\n%s", name, got)
		}
	}
	if types := pluginTypes(t, readFile(t, filepath.Join(e.confDir, "10-calico.conflist"))); types[len(types)-1] != "detour-cni" {
		t.Errorf("primary plugins %v", types)
	}
}

func TestReconcileWaitsOrRefuses(t *testing.T) {
	for _, tc := range []struct {
		name    string
		files   map[string]string
		dirs    []string
		wantErr string // empty: no error, but not in place and nothing written
		reason  string
	}{
		{name: "half-written primary", files: map[string]string{"10-calico.conflist": calico[:40]}, reason: "to become a valid CNI configuration"},
		{name: "conf that is a list", files: map[string]string{"10-x.conf": `{"name":"x","cniVersion":"1.0.0","plugins":[{"type":"bridge"}]}`}, reason: "missing 'type'"},
		{name: "foreign conflist in the way", files: map[string]string{
			"10-x.conf":     `{"name":"x","cniVersion":"1.0.0","type":"bridge"}`,
			"10-x.conflist": `{"name":"other","cniVersion":"1.0.0","plugins":[{"type":"macvlan"}]}`,
		}, wantErr: "already exists and was not written by detour"},
		{name: "plugins from a directory", files: map[string]string{
			"10-x.conflist":       `{"name":"x","cniVersion":"1.1.0","plugins":[{"type":"bridge"}]}`,
			"x/50-tuning.conf":    `{"type":"tuning"}`,
			"x/ignored.conflist":  `{}`,
			"y/not-relevant.conf": `{}`,
		}, dirs: []string{"x", "y"}, wantErr: `network "x" also loads plugins from`},
		// Issue 15.1: chained into a version detour-cni does not speak, the entry would fail
		// every ADD on the node ("incompatible CNI versions").
		{name: "conf of CNI 0.2.0", files: map[string]string{"10-x.conf": `{"name":"x","cniVersion":"0.2.0","type":"bridge"}`},
			wantErr: `network "x" declares cniVersion "0.2.0", which detour-cni does not speak`},
		{name: "conf without cniVersion", files: map[string]string{"10-x.conf": `{"name":"x","type":"bridge"}`},
			wantErr: `network "x" declares no cniVersion (which means 0.1.0)`},
		{name: "conflist of CNI 0.1.0", files: map[string]string{"10-x.conflist": `{"name":"x","cniVersion":"0.1.0","plugins":[{"type":"bridge"}]}`},
			wantErr: `refusing to chain detour-cni into`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			for _, d := range tc.dirs {
				os.MkdirAll(filepath.Join(e.confDir, d), 0o755)
			}
			for name, content := range tc.files {
				writeFile(t, filepath.Join(e.confDir, name), content)
			}
			before := snapshot(t, e.confDir)
			s, err := e.agent(t).Reconcile(context.Background())
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("Reconcile error %v, want %q", err, tc.wantErr)
				}
			} else if err != nil || !strings.Contains(s.Reason, tc.reason) {
				t.Fatalf("Reconcile = %+v, %v; want no error and reason %q", s, err, tc.reason)
			}
			if s.ConfigInPlace {
				t.Error("config reported in place")
			}
			for name, content := range before {
				if snapshot(t, e.confDir)[name] != content {
					t.Errorf("%s was edited", name)
				}
			}
		})
	}
}

// Issue 15.1: a primary whose version the plugin does not speak loses an entry an earlier
// agent (or another version) put there, the agent is not ready and says why.
func TestReconcileRemovesEntryFromUnsupportedVersion(t *testing.T) {
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-x.conflist")
	writeFile(t, primary, `{"name":"x","cniVersion":"0.2.0","plugins":[{"type":"bridge","k":"&000"},{"type":"detour-cni"}]}`)
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1", UID: "uid-1"}})
	e.flags.NodeName = "node-1"
	a := e.agent(t, nodeagent.WithNodeClient(client))
	s, err := a.Reconcile(context.Background())
	if err == nil || !strings.Contains(err.Error(), `declares cniVersion "0.2.0"`) || s.ConfigInPlace {
		t.Fatalf("Reconcile = %+v, %v; want a refusal", s, err)
	}
	a.Reconcile(context.Background()) // the same refusal again: no second Event
	events, _ := client.CoreV1().Events("default").List(context.Background(), metav1.ListOptions{})
	if len(events.Items) != 1 || events.Items[0].Reason != nodeagent.EventReason || events.Items[0].InvolvedObject.UID != "uid-1" ||
		!strings.Contains(events.Items[0].Message, `declares cniVersion "0.2.0"`) {
		t.Errorf("events %+v, want one %s on the node", events.Items, nodeagent.EventReason)
	}
	if types := pluginTypes(t, readFile(t, primary)); !slices.Equal(types, []string{"bridge"}) {
		t.Errorf("plugins %v, want the entry removed", types)
	}
	if ok, reason := a.Ready(); ok || !strings.Contains(reason, "refusing to chain") {
		t.Errorf("Ready = %v, %q", ok, reason)
	}
	// The primary moves to a version the plugin speaks: the entry goes in.
	writeFile(t, primary, `{"name":"x","cniVersion":"0.3.1","plugins":[{"type":"bridge"}]}`)
	if s, err := a.Reconcile(context.Background()); err != nil || !s.ConfigInPlace {
		t.Fatalf("Reconcile = %+v, %v", s, err)
	}
}

// The versions the agent accepts are the plugin's, and a conflist with "cniVersions" counts by
// the version the runtime picks from it.
func TestCheckCNIVersion(t *testing.T) {
	for conf, ok := range map[string]bool{
		`{"name":"x","cniVersion":"0.3.0","plugins":[{"type":"bridge"}]}`:                         true,
		`{"name":"x","cniVersion":"1.1.0","plugins":[{"type":"bridge"}]}`:                         true,
		`{"name":"x","cniVersion":"0.2.0","plugins":[{"type":"bridge"}]}`:                         false,
		`{"name":"x","plugins":[{"type":"bridge"}]}`:                                              false,
		`{"name":"x","cniVersions":["0.2.0","1.0.0"],"plugins":[{"type":"bridge"}]}`:              true,
		`{"name":"x","cniVersion":"0.1.0","cniVersions":["0.2.0"],"plugins":[{"type":"bridge"}]}`: false,
	} {
		list, err := libcni.ConfListFromBytes([]byte(conf))
		if err != nil {
			t.Fatal(err)
		}
		if err := nodeagent.CheckCNIVersion(list); (err == nil) != ok {
			t.Errorf("%s: CheckCNIVersion = %v, want ok %v", conf, err, ok)
		}
	}
}

func TestReconcileUpdatesBinary(t *testing.T) {
	e := newEnv(t)
	writeFile(t, filepath.Join(e.confDir, "10-calico.conflist"), calico)
	a := e.agent(t)
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(e.binDir, "detour-cni")
	// An upgrade ships a new binary; someone deletes the installed one.
	writeFile(t, e.source, "#!/bin/sh\necho detour-cni v2\n")
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(readFile(t, bin), "v2") {
		t.Error("binary not updated")
	}
	os.Remove(bin)
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(readFile(t, bin), "v2") {
		t.Error("binary not restored")
	}
	os.Remove(e.source)
	if _, err := a.Reconcile(context.Background()); err == nil || !strings.Contains(err.Error(), "--plugin-source") {
		t.Errorf("missing source: %v", err)
	}
	if ok, reason := a.Ready(); ok || !strings.Contains(reason, "plugin binary") {
		t.Errorf("Ready = %v, %q", ok, reason)
	}
}

// run starts the agent's loop and returns a function that stops it and returns Run's error.
func run(t *testing.T, a *nodeagent.Agent) (stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() {
			cancel()
			err = <-done
		})
		return err
	}
	t.Cleanup(func() { stop() })
	return stop
}

// eventually polls cond until it holds, failing the test after a generous bound (a hang guard,
// not a timing assertion).
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestRunRestoresRewrittenPrimary(t *testing.T) {
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	stale := filepath.Join(e.binDir, ".detour-tmp-detour-cni-123") // left by a killed agent
	writeFile(t, stale, "half a binary")
	a := e.agent(t)
	stop := run(t, a)

	// The primary appears after the agent started.
	eventually(t, "the agent waits for the primary", func() bool { _, r := a.Ready(); return strings.Contains(r, "waiting") })
	want := pluginTypes(t, calico)
	for i := range 50 {
		writeAtomic(t, primary, calico)
		eventually(t, "the entry is restored", func() bool {
			b, err := os.ReadFile(primary)
			if err != nil {
				t.Fatal(err)
			}
			if !json.Valid(b) {
				t.Fatalf("rewrite %d: invalid JSON in the primary:\n%s", i, b)
			}
			types := pluginTypes(t, string(b))
			if n := strings.Count(strings.Join(types, ","), "detour-cni"); n > 1 {
				t.Fatalf("rewrite %d: detour-cni appears %d times: %v", i, n, types)
			}
			return slices.Equal(types, append(want, "detour-cni"))
		})
	}
	if _, err := os.Stat(stale); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("stale temporary file not removed: %v", err)
	}
	// No write loop: once restored, the agent leaves the file alone. Two more passes (the resync
	// brings them) mean at least one whole pass began after the snapshot; a loop would write.
	settled := inodes(t, e.confDir)
	passes := nodeagent.Passes(a)
	eventually(t, "the agent has looked again", func() bool { return nodeagent.Passes(a) >= passes+2 })
	if now := inodes(t, e.confDir); !equalMaps(settled, now) {
		t.Errorf("the agent kept writing after the entry was in place")
	}
	if err := stop(); err != nil {
		t.Errorf("Run = %v", err)
	}
	// Stopping (SIGTERM) leaves everything in place.
	if types := pluginTypes(t, readFile(t, primary)); !slices.Contains(types, "detour-cni") {
		t.Errorf("entry removed on stop: %v", types)
	}
	for _, f := range []string{filepath.Join(e.binDir, "detour-cni"), filepath.Join(e.confDir, "detour-cni.kubeconfig"), filepath.Join(e.confDir, "detour-cni.token")} {
		if _, err := os.Stat(f); err != nil {
			t.Errorf("removed on stop: %v", err)
		}
	}
}

// A rotated service-account token is copied for the plugin, and a client built from the
// plugin's kubeconfig sends the new one.
func TestRunTokenRotation(t *testing.T) {
	var mu sync.Mutex
	var seen []string
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer "))
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"major":"1","minor":"37","gitVersion":"v1.37.2"}`)
	}))
	defer srv.Close()
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})

	e := newEnv(t)
	e.rotateToken(t, "token-1", ca)
	e.flags.APIServer = srv.URL
	writeFile(t, filepath.Join(e.confDir, "10-calico.conflist"), calico)
	a := e.agent(t)
	run(t, a)
	eventually(t, "the config is in place", func() bool { ok, _ := a.Ready(); return ok })

	tokenUsed := func() string {
		cfg, err := clientcmd.BuildConfigFromFlags("", filepath.Join(e.confDir, "detour-cni.kubeconfig"))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := kubernetes.NewForConfigOrDie(cfg).Discovery().ServerVersion(); err != nil {
			t.Fatalf("call the API server with the plugin's kubeconfig: %v", err)
		}
		mu.Lock()
		defer mu.Unlock()
		return seen[len(seen)-1]
	}
	if got := tokenUsed(); got != "token-1" {
		t.Errorf("plugin client sent %q, want token-1", got)
	}
	e.rotateToken(t, "token-2", ca)
	eventually(t, "the rotated token is copied", func() bool {
		return readFile(t, filepath.Join(e.confDir, "detour-cni.token")) == "token-2"
	})
	if got := tokenUsed(); got != "token-2" {
		t.Errorf("after rotation the plugin client sent %q, want token-2", got)
	}
}

func TestUninstall(t *testing.T) {
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	stale := filepath.Join(e.confDir, "20-old.conflist") // an earlier primary that still has the entry
	writeFile(t, stale, `{"name":"old","cniVersion":"1.0.0","plugins":[{"type":"bridge"},{"type":"detour-cni"}]}`)
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}})
	e.flags.NodeName = "node-1"
	a := e.agent(t, nodeagent.WithNodeClient(client))
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := a.Uninstall(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{primary, stale} {
		if types := pluginTypes(t, readFile(t, f)); slices.Contains(types, "detour-cni") {
			t.Errorf("%s still has the entry: %v", f, types)
		}
	}
	if types := pluginTypes(t, readFile(t, primary)); !slices.Equal(types, []string{"calico", "portmap"}) {
		t.Errorf("primary plugins after uninstall %v", types)
	}
	for _, f := range []string{filepath.Join(e.binDir, "detour-cni"), filepath.Join(e.confDir, "detour-cni.kubeconfig"), filepath.Join(e.confDir, "detour-cni.token")} {
		if _, err := os.Stat(f); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s not removed: %v", f, err)
		}
	}
	node, _ := client.CoreV1().Nodes().Get(context.Background(), "node-1", metav1.GetOptions{})
	if _, ok := node.Labels[annotations.CNIReadyLabel]; ok {
		t.Errorf("ready label still set: %v", node.Labels)
	}
	// Uninstalling twice is fine.
	if err := a.Uninstall(context.Background()); err != nil {
		t.Errorf("second Uninstall: %v", err)
	}
}

// The watch says the Node object is deleted once; when the read that confirms it fails (an API
// server that does not answer for a moment), the agent reads it again at its next resync and
// still takes detour off the node, rather than keeping it there until it restarts.
func TestRunRemovesDetourWhenTheDeletionIsConfirmedLate(t *testing.T) {
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}})
	var failing sync.Mutex
	failUntil := time.Time{}
	client.PrependReactor("get", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) {
		failing.Lock()
		defer failing.Unlock()
		if time.Now().Before(failUntil) {
			return true, nil, apierrors.NewServiceUnavailable("the API server is restarting")
		}
		return false, nil, nil
	})
	e.flags.NodeName = "node-1"
	a := e.agent(t, nodeagent.WithNodeClient(client))
	stop := run(t, a)
	defer stop()
	eventually(t, "the agent is ready", func() bool { ok, _ := a.Ready(); return ok })

	failing.Lock()
	failUntil = time.Now().Add(1500 * time.Millisecond) // beyond the watch's event, within two resyncs
	failing.Unlock()
	if err := client.Tracker().Delete(schema.GroupVersionResource{Version: "v1", Resource: "nodes"}, "", "node-1"); err != nil {
		t.Fatal(err)
	}
	eventually(t, "detour to leave the node once the deletion is confirmed", func() bool {
		ok, reason := a.Ready()
		_, err := os.Stat(filepath.Join(e.binDir, "detour-cni"))
		return ok && strings.Contains(reason, "Node object is deleted") && errors.Is(err, os.ErrNotExist) &&
			!slices.Contains(pluginTypes(t, readFile(t, primary)), "detour-cni")
	})
}

// Issue 15.3: when an entry cannot be removed, the binary, kubeconfig and token it needs stay:
// without them every ADD on the node fails with "plugin not found".
func TestUninstallKeepsWhatARemainingEntryNeeds(t *testing.T) {
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	a := e.agent(t)
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	// A list that holds only detour entries: removing them would leave no plugin, so the
	// agent refuses (as it fails on a read-only or immutable file).
	stuck := filepath.Join(e.confDir, "20-stuck.conflist")
	writeFile(t, stuck, `{"name":"stuck","cniVersion":"1.0.0","plugins":[{"type":"detour-cni"}]}`)
	err := a.Uninstall(context.Background())
	if err == nil || !strings.Contains(err.Error(), "20-stuck.conflist") || !strings.Contains(err.Error(), "kept") {
		t.Fatalf("Uninstall = %v, want the stuck entry reported and the files kept", err)
	}
	if types := pluginTypes(t, readFile(t, primary)); !slices.Equal(types, []string{"calico", "portmap"}) {
		t.Errorf("the removable entry stays: %v", types)
	}
	for _, f := range []string{filepath.Join(e.binDir, "detour-cni"), filepath.Join(e.confDir, "detour-cni.kubeconfig"), filepath.Join(e.confDir, "detour-cni.token")} {
		if _, err := os.Stat(f); err != nil {
			t.Errorf("%s removed while an entry remains: %v", f, err)
		}
	}
	if ok, reason := a.Ready(); ok || !strings.Contains(reason, "uninstall failed") {
		t.Errorf("Ready = %v, %q", ok, reason)
	}
	// Fixed, the next attempt finishes the job.
	os.Remove(stuck)
	if err := a.Uninstall(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{filepath.Join(e.binDir, "detour-cni"), filepath.Join(e.confDir, "detour-cni.kubeconfig"), filepath.Join(e.confDir, "detour-cni.token")} {
		if _, err := os.Stat(f); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s not removed: %v", f, err)
		}
	}
}

func TestNodeReadiness(t *testing.T) {
	node := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: "node-1", ResourceVersion: "7", Labels: map[string]string{"zone": "a"}},
		Spec: corev1.NodeSpec{Taints: []corev1.Taint{
			{Key: "node.kubernetes.io/not-ready", Effect: corev1.TaintEffectNoSchedule},
			{Key: annotations.CNINotReadyTaint, Value: "true", Effect: corev1.TaintEffectNoSchedule},
			{Key: annotations.CNINotReadyTaint, Effect: corev1.TaintEffectNoExecute},
		}},
		Status: corev1.NodeStatus{NodeInfo: corev1.NodeSystemInfo{KubeletVersion: "v1.37.2", ContainerRuntimeVersion: "containerd://2.4.2"}},
	}
	client := fake.NewClientset(node)
	// The first patch meets a concurrent change: the agent reads again and retries.
	conflicts := 1
	var patches []string
	client.PrependReactor("patch", "nodes", func(action k8stesting.Action) (bool, runtime.Object, error) {
		patches = append(patches, string(action.(k8stesting.PatchAction).GetPatch()))
		if conflicts > 0 {
			conflicts--
			return true, nil, apierrors.NewConflict(schema.GroupResource{Resource: "nodes"}, "node-1", errors.New("the object has been modified"))
		}
		return false, nil, nil
	})
	e := newEnv(t)
	e.flags.NodeName = "node-1"
	a := e.agent(t, nodeagent.WithNodeClient(client))

	// No config yet: the node is left alone.
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if len(patches) != 0 {
		t.Fatalf("patched the node before the config was in place: %v", patches)
	}
	writeFile(t, filepath.Join(e.confDir, "10-calico.conflist"), calico)
	s, err := a.Reconcile(context.Background())
	if err != nil || !s.NodeReady {
		t.Fatalf("Reconcile = %+v, %v", s, err)
	}
	got, _ := client.CoreV1().Nodes().Get(context.Background(), "node-1", metav1.GetOptions{})
	if len(got.Spec.Taints) != 1 || got.Spec.Taints[0].Key != "node.kubernetes.io/not-ready" {
		t.Errorf("taints %v, want only node.kubernetes.io/not-ready", got.Spec.Taints)
	}
	// The node mounts image volumes (kubelet 1.37, containerd 2.4): labelled in the same patch.
	if got.Labels[annotations.CNIReadyLabel] != "true" || got.Labels["zone"] != "a" || got.Labels[annotations.ImageVolumesLabel] != "true" {
		t.Errorf("labels %v", got.Labels)
	}
	if len(patches) != 2 || !strings.Contains(patches[0], `"resourceVersion":"7"`) {
		t.Errorf("patches %v: want a conflicting one carrying the resourceVersion, then a retry", patches)
	}
	// Ready already: the node is not read or patched on every resync.
	gets := 0
	for _, act := range client.Actions() {
		if act.GetVerb() == "get" {
			gets++
		}
	}
	if _, err := a.Reconcile(context.Background()); err != nil || len(patches) != 2 || len(client.Actions()) != gets+len(patches) {
		t.Errorf("a resync of a ready node called the API: %v, %v", client.Actions(), err)
	}
	// Issue 15.4: the config goes away after the first readiness (a reboot where the primary
	// writes its file first, an operator's mistake): the label follows, once; the taint is
	// not put back.
	os.Remove(filepath.Join(e.confDir, "10-calico.conflist"))
	for range 3 {
		if s, _ := a.Reconcile(context.Background()); s.NodeReady || s.ConfigInPlace {
			t.Errorf("status without config %+v", s)
		}
	}
	got, _ = client.CoreV1().Nodes().Get(context.Background(), "node-1", metav1.GetOptions{})
	// The image volumes label describes the node's software: it stays (the kubelet admits the
	// running pods that select it again when it restarts).
	if _, ok := got.Labels[annotations.CNIReadyLabel]; ok || got.Labels["zone"] != "a" || got.Labels[annotations.ImageVolumesLabel] != "true" || len(got.Spec.Taints) != 1 {
		t.Errorf("without the config: labels %v taints %v; want the ready label gone, the rest kept", got.Labels, got.Spec.Taints)
	}
	if len(patches) != 3 {
		t.Errorf("patches %v: want one removing the label, not one per resync", patches)
	}
	rec := httptest.NewRecorder()
	a.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/readyz", nil))
	if rec.Code != http.StatusServiceUnavailable {
		t.Errorf("/readyz without the config = %d %s", rec.Code, rec.Body)
	}
	writeFile(t, filepath.Join(e.confDir, "10-calico.conflist"), calico)
	before := len(client.Actions())
	if s, err := a.Reconcile(context.Background()); err != nil || !s.NodeReady || len(client.Actions()) != before+2 {
		t.Errorf("config back: %+v, %v, %d new API calls (want a get and a patch)", s, err, len(client.Actions())-before)
	}
	got, _ = client.CoreV1().Nodes().Get(context.Background(), "node-1", metav1.GetOptions{})
	if got.Labels[annotations.CNIReadyLabel] != "true" {
		t.Errorf("config back: labels %v", got.Labels)
	}
	rec = httptest.NewRecorder()
	a.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/readyz", nil))
	if rec.Code != 200 {
		t.Errorf("/readyz = %d %s", rec.Code, rec.Body)
	}
}

func TestReadyzNotReady(t *testing.T) {
	e := newEnv(t)
	a := e.agent(t)
	a.Reconcile(context.Background())
	rec := httptest.NewRecorder()
	a.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/readyz", nil))
	if rec.Code != http.StatusServiceUnavailable || !strings.Contains(rec.Body.String(), "waiting for the primary CNI") {
		t.Errorf("/readyz = %d %q", rec.Code, rec.Body)
	}
	rec = httptest.NewRecorder()
	a.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/healthz", nil))
	if rec.Code != 200 {
		t.Errorf("/healthz = %d", rec.Code)
	}
}

func TestFlagsParse(t *testing.T) {
	base := func() nodeagent.Flags {
		f := nodeagent.DefaultFlags()
		f.APIServer, f.PluginSource = "https://10.96.0.1:443", "/opt/detour/bin/detour-cni"
		return f
	}
	cfg, err := base().Parse()
	if err != nil {
		t.Fatal(err)
	}
	if cfg.KubeconfigPath != "/host/etc/cni/net.d/detour-cni.kubeconfig" || cfg.HostKubeconfigPath != "/etc/cni/net.d/detour-cni.kubeconfig" || cfg.HostTokenPath != "/etc/cni/net.d/detour-cni.token" {
		t.Errorf("paths %+v", cfg)
	}
	f := base()
	f.ExcludeNamespaces, f.LogFile = nil, "/var/log/detour-cni.log"
	cfg, err = f.Parse()
	if err != nil || !strings.Contains(string(cfg.Entry), `"excludeNamespaces":[]`) || !strings.Contains(string(cfg.Entry), `"logFile":"/var/log/detour-cni.log"`) {
		t.Errorf("entry %s, %v: an empty exclusion list must be written as [] (absent means the plugin's default)", cfg.Entry, err)
	}
	f = base()
	f.IPv6 = "always"
	if cfg, err := f.Parse(); err != nil || !strings.Contains(string(cfg.Entry), `"ipv6":"always"`) {
		t.Errorf("ipv6 always: entry %s, %v", cfg.Entry, err)
	}
	t.Setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
	t.Setenv("KUBERNETES_SERVICE_PORT", "443")
	f = base()
	f.APIServer = ""
	if cfg, err := f.Parse(); err != nil || cfg.APIServer != "https://[fd00::1]:443" {
		t.Errorf("in-cluster API server %q, %v", cfg.APIServer, err)
	}

	for _, tc := range []struct {
		modify func(*nodeagent.Flags)
		want   string
	}{
		{func(f *nodeagent.Flags) { f.ConfDir = "etc/cni" }, `--cni-conf-dir "etc/cni"`},
		{func(f *nodeagent.Flags) { f.KubeconfigName = "x.conflist" }, `--kubeconfig-name "x.conflist"`},
		{func(f *nodeagent.Flags) { f.TokenName = "../token" }, `--token-name "../token"`},
		{func(f *nodeagent.Flags) { f.TokenName = f.KubeconfigName }, "must differ"},
		{func(f *nodeagent.Flags) { f.PluginSource = "detour-cni" }, `--plugin-source "detour-cni"`},
		{func(f *nodeagent.Flags) { f.APIServer = "http://10.96.0.1" }, `--api-server "http://10.96.0.1"`},
		{func(f *nodeagent.Flags) { f.APITimeout = time.Hour }, `--api-timeout "1h0m0s"`},
		{func(f *nodeagent.Flags) { f.IPTablesBackend = "nftable" }, `--iptables-backend "nftable"`},
		{func(f *nodeagent.Flags) { f.LogLevel = "trace" }, `--plugin-log-level "trace"`},
		{func(f *nodeagent.Flags) { f.LogFile = "cni.log" }, `--plugin-log-file "cni.log"`},
		{func(f *nodeagent.Flags) { f.ExcludeNamespaces = []string{"Kube_System"} }, `--exclude-namespaces "Kube_System"`},
		{func(f *nodeagent.Flags) { f.IPv6 = "on" }, `--ipv6 "on"`},
		{func(f *nodeagent.Flags) { f.NodeName = "Node 1" }, `--node-name "Node 1"`},
		{func(f *nodeagent.Flags) { f.StartupTaint = "bad key!" }, `--startup-taint "bad key!"`},
		{func(f *nodeagent.Flags) { f.Resync = 0 }, `--resync-interval "0s"`},
	} {
		f := base()
		tc.modify(&f)
		if _, err := f.Parse(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Parse error %v, want one containing %q", err, tc.want)
		}
	}
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	f = base()
	f.APIServer = ""
	if _, err := f.Parse(); err == nil || !strings.Contains(err.Error(), "set --api-server") {
		t.Errorf("no API server: %v", err)
	}
}

// BenchmarkReconcileSteady is the cost of one resync on a node where everything is in place:
// the agent reads the directory, the primary, the binary's identity and the token, and writes
// nothing.
func BenchmarkReconcileSteady(b *testing.B) {
	e := newEnv(b)
	writeFile(b, filepath.Join(e.confDir, "10-calico.conflist"), calico)
	a := nodeagent.New(e.config(b), nodeagent.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
	if _, err := a.Reconcile(context.Background()); err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if s, err := a.Reconcile(context.Background()); err != nil || !s.ConfigInPlace {
			b.Fatal(s, err)
		}
	}
}

// A new primary that sorts first (another CNI replacing the first one) gets the entry; the
// file the runtime no longer loads is left as it is.
func TestRunFollowsANewPrimary(t *testing.T) {
	e := newEnv(t)
	old := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, old, calico)
	a := e.agent(t)
	run(t, a)
	eventually(t, "the entry is in the first primary", func() bool { ok, _ := a.Ready(); return ok })
	before := readFile(t, old)

	cilium := filepath.Join(e.confDir, "05-cilium.conflist")
	writeAtomic(t, cilium, `{"cniVersion":"0.3.1","name":"cilium","plugins":[{"type":"cilium-cni","enable-debug":false}]}`)
	eventually(t, "the entry is in the new primary", func() bool {
		b, err := os.ReadFile(cilium)
		return err == nil && slices.Equal(pluginTypes(t, string(b)), []string{"cilium-cni", "detour-cni"})
	})
	eventually(t, "the status names the new primary", func() bool { return a.Status().Primary == cilium })
	if readFile(t, old) != before {
		t.Error("the old primary was edited")
	}
}

// The entry the agent writes is what the plugin parses: every flag arrives as the plugin's
// setting (the contract test between install-cni and detour-cni).
func TestEntryParsedByPlugin(t *testing.T) {
	f := nodeagent.DefaultFlags()
	f.APIServer, f.PluginSource = "https://10.96.0.1:443", "/opt/detour/bin/detour-cni"
	f.APITimeout, f.IPTablesBackend, f.LogLevel, f.LogFile = 3*time.Second, "nft", "debug", "/var/log/detour-cni.log"
	f.ExcludeNamespaces, f.IPv6 = []string{"kube-system", "istio-system"}, "always"
	cfg, err := f.Parse()
	if err != nil {
		t.Fatal(err)
	}
	list, _, err := nodeagent.InsertEntry([]byte(calico), cfg.Entry)
	if err != nil {
		t.Fatal(err)
	}
	// The runtime hands each plugin its configuration with the list's name and version.
	netList, err := libcni.ConfListFromBytes(list)
	if err != nil {
		t.Fatal(err)
	}
	stdin, err := libcni.InjectConf(netList.Plugins[2], map[string]any{"name": netList.Name, "cniVersion": netList.CNIVersion})
	if err != nil {
		t.Fatal(err)
	}
	pc, err := cniplugin.ParseConfig(stdin.Bytes)
	if err != nil {
		t.Fatalf("the plugin rejects the agent's entry: %v\n%s", err, stdin.Bytes)
	}
	if pc.Type != cniplugin.PluginType || pc.Kubeconfig != "/etc/cni/net.d/detour-cni.kubeconfig" || pc.APITimeout != 3*time.Second ||
		pc.IPTablesBackend != iptables.BackendNFT || pc.LogLevel != slog.LevelDebug || pc.LogFile != "/var/log/detour-cni.log" ||
		!slices.Equal(pc.ExcludeNamespaces, []string{"kube-system", "istio-system"}) || pc.IPv6 != cniplugin.IPv6Always ||
		!netList.Plugins[2].Network.Capabilities[cniplugin.PodAnnotationsCapability] {
		t.Errorf("the plugin reads %+v", pc)
	}
}

// Issue 15.8: a primary conflist that is a symlink stays one: the agent edits the file it leads
// to, which the primary keeps updating (replacing the link would make the runtime ignore those
// updates); uninstall does the same. A target the agent cannot reach, or a linked .conf it would
// have to replace, is refused with a message.
func TestSymlinkedPrimary(t *testing.T) {
	e := newEnv(t)
	if err := os.MkdirAll(filepath.Join(e.confDir, "calico"), 0o755); err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(e.confDir, "calico", "k8s.conflist.real")
	writeFile(t, target, calico)
	link := filepath.Join(e.confDir, "10-calico.conflist")
	if err := os.Symlink("calico/k8s.conflist.real", link); err != nil {
		t.Fatal(err)
	}
	a := e.agent(t)
	isLink := func() bool { st, err := os.Lstat(link); return err == nil && st.Mode()&os.ModeSymlink != 0 }
	if s, err := a.Reconcile(context.Background()); err != nil || !s.ConfigInPlace {
		t.Fatalf("Reconcile = %+v, %v", s, err)
	}
	if !isLink() {
		t.Fatal("the primary's symlink was replaced by a file")
	}
	if types := pluginTypes(t, readFile(t, target)); !slices.Equal(types, []string{"calico", "portmap", "detour-cni"}) {
		t.Errorf("target plugins %v", types)
	}
	// The primary updates its target: the entry goes back into it.
	writeFile(t, target, strings.Replace(calico, `"snat": true`, `"snat": false`, 1))
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, link); !strings.Contains(got, `"snat": false`) || !strings.Contains(got, `"type":"detour-cni"`) || !isLink() {
		t.Errorf("after the primary's update (link %v):\n%s", isLink(), got)
	}
	if err := a.Uninstall(context.Background()); err != nil {
		t.Fatal(err)
	}
	if types := pluginTypes(t, readFile(t, target)); !slices.Equal(types, []string{"calico", "portmap"}) || !isLink() {
		t.Errorf("after uninstall: target plugins %v, link %v", types, isLink())
	}

	for name, tc := range map[string]struct{ link, target, want string }{
		"outside":     {"10-a.conflist", "/elsewhere/a.conflist", "outside the CNI config directory"},
		"leaves":      {"10-b.conflist", "../b.conflist", "outside the CNI config directory"},
		"linked conf": {"10-c.conf", "c.real", "symlink to a single-plugin configuration"},
	} {
		t.Run(name, func(t *testing.T) {
			e := newEnv(t)
			writeFile(t, filepath.Join(e.confDir, "c.real"), `{"name":"c","cniVersion":"1.0.0","type":"bridge"}`)
			writeFile(t, filepath.Join(filepath.Dir(e.confDir), "b.conflist"), `{"name":"b","cniVersion":"1.0.0","plugins":[{"type":"bridge"}]}`)
			if err := os.Symlink(tc.target, filepath.Join(e.confDir, tc.link)); err != nil {
				t.Fatal(err)
			}
			if name == "outside" {
				// A valid target for the runtime's loader: the agent's container sees another path.
				os.Remove(filepath.Join(e.confDir, tc.link))
				real := filepath.Join(t.TempDir(), "a.conflist")
				writeFile(t, real, `{"name":"a","cniVersion":"1.0.0","plugins":[{"type":"bridge"}]}`)
				os.Symlink(real, filepath.Join(e.confDir, tc.link))
			}
			s, err := e.agent(t).Reconcile(context.Background())
			if err == nil || !strings.Contains(err.Error(), tc.want) || s.EntryInPlace {
				t.Errorf("Reconcile = %+v, %v; want a refusal with %q", s, err, tc.want)
			}
			if st, err := os.Lstat(filepath.Join(e.confDir, tc.link)); err != nil || st.Mode()&os.ModeSymlink == 0 {
				t.Errorf("the link was replaced: %v", err)
			}
		})
	}
}

// Issue 15.4: the ready label carries the boot it holds for; after a reboot the agent, started
// again, marks the new boot (readers tell a stale label by the boot ID).
func TestNodeReadinessMarksTheBoot(t *testing.T) {
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}, Status: corev1.NodeStatus{NodeInfo: corev1.NodeSystemInfo{BootID: "boot-1"}}}
	client := fake.NewClientset(node)
	e := newEnv(t)
	e.flags.NodeName = "node-1"
	writeFile(t, filepath.Join(e.confDir, "10-calico.conflist"), calico)
	if _, err := e.agent(t, nodeagent.WithNodeClient(client)).Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	got, _ := client.CoreV1().Nodes().Get(context.Background(), "node-1", metav1.GetOptions{})
	if got.Labels[annotations.CNIReadyLabel] != "true" || got.Annotations[annotations.CNIReadyBootAnnotation] != "boot-1" {
		t.Fatalf("labels %v annotations %v", got.Labels, got.Annotations)
	}
	// Reboot: the kubelet reports a new boot ID; the label is still there.
	got.Status.NodeInfo.BootID = "boot-2"
	client.CoreV1().Nodes().Update(context.Background(), got, metav1.UpdateOptions{})
	if _, err := e.agent(t, nodeagent.WithNodeClient(client)).Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	got, _ = client.CoreV1().Nodes().Get(context.Background(), "node-1", metav1.GetOptions{})
	if got.Annotations[annotations.CNIReadyBootAnnotation] != "boot-2" {
		t.Errorf("after the reboot: annotations %v, want boot-2", got.Annotations)
	}
}

// Issue 15.3, as reported: the entry sits in an immutable file (chattr +i). Uninstall fails to
// remove it and keeps the binary, kubeconfig and token that entry needs.
func TestUninstallImmutableConflist(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to set the immutable attribute")
	}
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	a := e.agent(t)
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("chattr", "+i", primary).CombinedOutput(); err != nil {
		t.Skipf("cannot make the file immutable here: %v %s", err, out)
	}
	t.Cleanup(func() { exec.Command("chattr", "-i", primary).Run() })
	if err := a.Uninstall(context.Background()); err == nil || !strings.Contains(err.Error(), "kept") {
		t.Fatalf("Uninstall = %v, want the entry reported and the files kept", err)
	}
	if !slices.Contains(pluginTypes(t, readFile(t, primary)), "detour-cni") {
		t.Fatal("the immutable file lost its entry")
	}
	for _, f := range []string{filepath.Join(e.binDir, "detour-cni"), filepath.Join(e.confDir, "detour-cni.kubeconfig"), filepath.Join(e.confDir, "detour-cni.token")} {
		if _, err := os.Stat(f); err != nil {
			t.Errorf("%s removed while the entry remains: %v", f, err)
		}
	}
}
