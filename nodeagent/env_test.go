package nodeagent_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

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

func mustJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
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
	return typesOf(list)
}

// typesOf returns the plugin types of list, in the order the runtime runs them.
func typesOf(list *libcni.NetworkConfigList) []string {
	var types []string
	for _, p := range list.Plugins {
		types = append(types, p.Network.Type)
	}
	return types
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

// runtimeNode is a node whose runtime is runtime, for an agent in auto mode.
func runtimeNode(e *env, runtime string) *fake.Clientset {
	e.flags.NodeName = "node-1"
	return fake.NewClientset(&corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: "node-1"},
		Status:     corev1.NodeStatus{NodeInfo: corev1.NodeSystemInfo{ContainerRuntimeVersion: runtime}},
	})
}

// loaded returns the plugin types the runtime runs for the conflist at path: libcni's
// ConfListFromFile, drop-ins included, as containerd >= 2.1 loads it.
func loaded(t *testing.T, path string) []string {
	t.Helper()
	list, err := libcni.ConfListFromFile(path)
	if err != nil {
		t.Fatalf("the runtime cannot load %s: %v", path, err)
	}
	return typesOf(list)
}

// files lists every file and directory under dir, relative to it.
func files(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && p != dir {
			rel, _ := filepath.Rel(dir, p)
			if d.IsDir() {
				rel += "/"
			}
			out = append(out, rel)
		}
		return nil
	})
	return out
}
