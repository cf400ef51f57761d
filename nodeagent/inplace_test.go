package nodeagent

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/detourmesh/detour/annotations"
)

// inPlaceEnv is an agent over a temporary node whose primary is path (content in), and a
// writer that rewrites path in place, truncating and writing like a primary without renames.
func inPlaceEnv(t *testing.T, name, content string) (*Agent, string, func(string)) {
	t.Helper()
	root := t.TempDir()
	conf, bin, sa := filepath.Join(root, "net.d"), filepath.Join(root, "bin"), filepath.Join(root, "sa")
	for _, d := range []string{conf, bin, sa} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for f, c := range map[string]string{filepath.Join(root, "detour-cni"): "#!/bin/sh\n", filepath.Join(sa, "token"): "t", filepath.Join(sa, "ca.crt"): "ca", filepath.Join(conf, name): content} {
		if err := os.WriteFile(f, []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	fl := DefaultFlags()
	fl.ConfDir, fl.HostConfDir, fl.BinDir, fl.ServiceAccountDir = conf, conf, bin, sa
	fl.PluginSource, fl.APIServer, fl.NodeName = filepath.Join(root, "detour-cni"), "https://10.96.0.1:443", ""
	cfg, err := fl.Parse()
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(conf, name)
	write := func(c string) {
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if _, err := f.WriteString(c); err != nil {
			t.Fatal(err)
		}
	}
	return New(cfg, WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil)))), path, write
}

// Issue 15.7: a primary that rewrites its conflist in place between the agent's last look and
// its rename wrote into the file the rename replaced: its version was lost (11 of 25 rounds of
// a real race). The agent notices and adds its entry to that version.
func TestInPlaceWriteDuringReplace(t *testing.T) {
	const v1 = `{"name":"k8s","cniVersion":"1.0.0","plugins":[{"type":"bridge","mtu":1400}]}`
	const v2 = `{"name":"k8s","cniVersion":"1.0.0","plugins":[{"type":"bridge","mtu":9000}]}`
	a, path, write := inPlaceEnv(t, "10-k8s.conflist", v1)
	once := false
	a.beforeReplace = func() {
		if !once {
			once = true
			write(v2)
		}
	}
	if s, err := a.Reconcile(context.Background()); err != nil || !s.ConfigInPlace {
		t.Fatalf("Reconcile = %+v, %v", s, err)
	}
	got, _ := os.ReadFile(path)
	if !strings.Contains(string(got), `"mtu":9000`) || !strings.Contains(string(got), `"type":"detour-cni"`) {
		t.Errorf("the primary's in-place write was lost:\n%s", got)
	}
}

// The same for a .conf the agent converts: the write into the .conf it removes is kept.
func TestInPlaceWriteDuringConversion(t *testing.T) {
	const v1 = `{"name":"k8s","cniVersion":"1.0.0","type":"bridge","mtu":1400}`
	const v2 = `{"name":"k8s","cniVersion":"1.0.0","type":"bridge","mtu":9000}`
	a, path, write := inPlaceEnv(t, "10-k8s.conf", v1)
	once := false
	a.beforeReplace = func() {
		if !once {
			once = true
			write(v2)
		}
	}
	if s, err := a.Reconcile(context.Background()); err != nil || !s.ConfigInPlace {
		t.Fatalf("Reconcile = %+v, %v", s, err)
	}
	got, _ := os.ReadFile(strings.TrimSuffix(path, ".conf") + ".conflist")
	if !strings.Contains(string(got), `"mtu": 9000`) || !strings.Contains(string(got), `"type":"detour-cni"`) {
		t.Errorf("the primary's in-place write was lost:\n%s", got)
	}
}

// A reconcile error that stays the same (a refused primary, at every resync) is logged once,
// and again every errorRepeat, not every 10 seconds.
func TestSameErrorLoggedOnce(t *testing.T) {
	a, _, _ := inPlaceEnv(t, "10-k8s.conf", `{"name":"k8s","cniVersion":"0.2.0","type":"bridge"}`)
	var log strings.Builder
	a.log = slog.New(slog.NewTextHandler(&log, nil))
	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	a.now = func() time.Time { return now }
	for range 5 {
		a.reconcileAndLog(context.Background())
		now = now.Add(10 * time.Second)
	}
	if n := strings.Count(log.String(), "reconcile failed"); n != 1 {
		t.Errorf("%d error lines in 5 resyncs, want 1:\n%s", n, log.String())
	}
	now = now.Add(errorRepeat)
	a.reconcileAndLog(context.Background())
	if n := strings.Count(log.String(), "reconcile failed"); n != 2 {
		t.Errorf("%d error lines after %s, want 2", n, errorRepeat)
	}
}

// A primary's write that races the agent's (retried at once) does not take the ready label
// off the node: only an entry that stays out does.
func TestRaceKeepsTheLabel(t *testing.T) {
	const v1 = `{"name":"k8s","cniVersion":"1.0.0","plugins":[{"type":"bridge","mtu":1400}]}`
	a, path, write := inPlaceEnv(t, "10-k8s.conflist", v1)
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}})
	a.client, a.node = client, &nodeReadiness{client: client, name: "node-1", taint: annotations.CNINotReadyTaint}
	if s, err := a.Reconcile(context.Background()); err != nil || !s.NodeReady {
		t.Fatalf("Reconcile = %+v, %v", s, err)
	}
	// The primary rewrites its file without the entry, and keeps rewriting it in place while
	// the agent puts the entry back.
	write(v1)
	n := 0
	a.beforeReplace = func() { n++; write(strings.Replace(v1, "1400", fmt.Sprint(1400+n), 1)) }
	_, err := a.Reconcile(context.Background())
	if !isRace(err) {
		t.Fatalf("Reconcile = %v, want a race", err)
	}
	node, _ := client.CoreV1().Nodes().Get(context.Background(), "node-1", metav1.GetOptions{})
	if node.Labels[annotations.CNIReadyLabel] != "true" {
		t.Errorf("a race took the label off: %v", node.Labels)
	}
	// The primary settles: the entry is back, the node still ready.
	a.beforeReplace = func() {}
	if s, err := a.Reconcile(context.Background()); err != nil || !s.NodeReady {
		t.Fatalf("Reconcile = %+v, %v", s, err)
	}
	if got, _ := os.ReadFile(path); !strings.Contains(string(got), `"type":"detour-cni"`) || !strings.Contains(string(got), fmt.Sprint(1400+n)) {
		t.Errorf("entry not back, or the primary's last version (mtu %d) lost:\n%s", 1400+n, got)
	}
}
