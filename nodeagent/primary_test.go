package nodeagent_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/detourmesh/detour/nodeagent"
)

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
