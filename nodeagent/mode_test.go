package nodeagent_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/fsnotify/fsnotify"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/detourmesh/detour/nodeagent"
)

func TestRuntimeLoadsDropIns(t *testing.T) {
	for _, tc := range []struct {
		runtime string
		want    bool
	}{
		{"containerd://2.4.2", true},
		{"containerd://2.1.0", true},
		{"containerd://2.0.5", false},
		{"containerd://1.7.27", false},
		{"cri-o://1.33.1", true},
		{"cri-o://1.32.4", false},
		{"docker://28.0.1", false},
		{"containerd://v2.4.2-rc.1", true},
		{"containerd://garbage", false},
		{"containerd", false},
		{"", false},
	} {
		if got, why := nodeagent.RuntimeLoadsDropIns(tc.runtime); got != tc.want || why == "" {
			t.Errorf("RuntimeLoadsDropIns(%q) = %v, %q; want %v", tc.runtime, got, why, tc.want)
		}
	}
}

func TestChooseMode(t *testing.T) {
	const new, old = "containerd://2.4.2", "containerd://1.7.27"
	for _, tc := range []struct {
		name                             string
		configured                       nodeagent.Mode
		runtime                          string
		conflist, inlinedOnly, dropInNow bool
		want                             nodeagent.Mode
		why                              string
	}{
		{"auto, new containerd", nodeagent.ModeAuto, new, true, false, false, nodeagent.ModeDropIn, "containerd 2.4.2 loads drop-ins"},
		{"auto, old containerd", nodeagent.ModeAuto, old, true, false, false, nodeagent.ModeChainedEntry, "containerd 1.7.27 loads no drop-ins"},
		{"auto, old containerd after an upgrade back", nodeagent.ModeAuto, old, true, false, true, nodeagent.ModeChainedEntry, "loads no drop-ins"},
		{"auto, CRI-O 1.33", nodeagent.ModeAuto, "cri-o://1.33.0", true, false, false, nodeagent.ModeDropIn, "cri-o 1.33.0 loads drop-ins"},
		{"auto, unknown runtime", nodeagent.ModeAuto, "", true, false, false, nodeagent.ModeChainedEntry, "runtime is unknown"},
		{"auto, unknown runtime, drop-in there", nodeagent.ModeAuto, "", true, false, true, nodeagent.ModeDropIn, "drop-in is there already"},
		{"drop-in", nodeagent.ModeDropIn, old, true, false, false, nodeagent.ModeDropIn, "cniConfigMode is drop-in"},
		{"chained-entry", nodeagent.ModeChainedEntry, new, true, false, true, nodeagent.ModeChainedEntry, "cniConfigMode is chained-entry"},
		{"loadOnlyInlinedPlugins", nodeagent.ModeDropIn, new, true, true, true, nodeagent.ModeChainedEntry, "loadOnlyInlinedPlugins"},
		{"auto, loadOnlyInlinedPlugins", nodeagent.ModeAuto, new, true, true, false, nodeagent.ModeChainedEntry, "loadOnlyInlinedPlugins"},
		{"a .conf primary", nodeagent.ModeDropIn, new, false, false, false, nodeagent.ModeChainedEntry, "single-plugin"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, why := nodeagent.ChooseMode(tc.configured, tc.runtime, tc.conflist, tc.inlinedOnly, tc.dropInNow)
			if got != tc.want || !strings.Contains(why, tc.why) {
				t.Errorf("ChooseMode = %s, %q; want %s, ...%q...", got, why, tc.want, tc.why)
			}
		})
	}
}

func TestFlagsParseMode(t *testing.T) {
	e := newEnv(t)
	if c := e.config(t); c.Mode != nodeagent.ModeAuto {
		t.Errorf("default mode %q, want auto", c.Mode)
	}
	e.flags.CNIConfigMode = "dropin"
	if _, err := e.flags.Parse(); err == nil || !strings.Contains(err.Error(), "--cni-config-mode") {
		t.Errorf("Parse accepted mode dropin: %v", err)
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
	var types []string
	for _, p := range list.Plugins {
		types = append(types, p.Network.Type)
	}
	return types
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

func TestDropInSurvivesThePrimaryRewritingItsFile(t *testing.T) {
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	a := e.agent(t, nodeagent.WithNodeClient(runtimeNode(e, "containerd://2.4.2")))
	s, err := a.Reconcile(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	dropIn := filepath.Join(e.confDir, "k8s-pod-network", nodeagent.DropInName)
	if !s.ConfigInPlace || s.Mode != nodeagent.ModeDropIn || s.Entry != dropIn || !strings.Contains(s.ModeReason, "containerd 2.4.2") {
		t.Errorf("status %+v", s)
	}
	if ok, reason := a.Ready(); !ok || !strings.Contains(reason, dropIn) || !strings.Contains(reason, "drop-in") {
		t.Errorf("Ready = %v, %q", ok, reason)
	}
	if got := readFile(t, primary); got != calico {
		t.Errorf("the primary's file changed in drop-in mode:\n%s", got)
	}
	want := []string{"calico", "portmap", "detour-cni"}
	if types := loaded(t, primary); !slices.Equal(types, want) {
		t.Errorf("the runtime loads %v, want %v", types, want)
	}
	if got, want := files(t, e.confDir), []string{"10-calico.conflist", "detour-cni.kubeconfig", "detour-cni.mode", "detour-cni.token", "k8s-pod-network/", "k8s-pod-network/" + nodeagent.DropInName}; !slices.Equal(got, want) {
		t.Errorf("conf dir holds %v, want %v", got, want)
	}
	// The plugin parses the drop-in as it parses the entry.
	list, err := libcni.ConfListFromFile(primary)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(e.binDir, "detour-cni")); err != nil {
		t.Errorf("binary: %v", err)
	}
	if last := list.Plugins[2]; !strings.Contains(string(last.Bytes), `"kubeconfig"`) {
		t.Errorf("drop-in %s", last.Bytes)
	}

	// The primary rewrites its file, content changed, with no agent running: the runtime
	// still loads detour after it.
	writeAtomic(t, primary, strings.Replace(calico, `"snat": true`, `"snat": false`, 1))
	if types := loaded(t, primary); !slices.Equal(types, want) {
		t.Errorf("after the primary's rewrite the runtime loads %v, want %v", types, want)
	}
	// And the agent's next pass writes nothing.
	before := snapshot(t, e.confDir, e.binDir)
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if after := snapshot(t, e.confDir, e.binDir); !equalMaps(before, after) {
		t.Errorf("a steady reconcile wrote files")
	}
}

// The runtime reloads on a write, rename or remove event in the conf dir (containerd ignores
// create and chmod, and does not watch subdirectories): writing or removing the drop-in must
// cause one.
func TestDropInMakesTheRuntimeReload(t *testing.T) {
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	w, err := fsnotify.NewWatcher()
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if err := w.Add(e.confDir); err != nil {
		t.Fatal(err)
	}
	reloads := func() int {
		n := 0
		for {
			select {
			case ev := <-w.Events:
				if !ev.Has(fsnotify.Create) && !ev.Has(fsnotify.Chmod) {
					n++
				}
			case <-time.After(200 * time.Millisecond):
				return n
			}
		}
	}
	e.flags.CNIConfigMode = "drop-in"
	a := e.agent(t)
	reloads() // the kubeconfig and token
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	// The kubeconfig and token writes are events too; the poke comes after the drop-in.
	if n := reloads(); n == 0 {
		t.Error("writing the drop-in caused no event containerd reloads on")
	}
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := reloads(); n != 0 {
		t.Errorf("a steady reconcile caused %d events", n)
	}
	if err := a.Uninstall(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := reloads(); n == 0 {
		t.Error("removing the drop-in caused no event containerd reloads on")
	}
}

// Moving between modes leaves exactly one detour entry, in the form of the mode.
func TestModeMigration(t *testing.T) {
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	dropIn := filepath.Join(e.confDir, "k8s-pod-network", nodeagent.DropInName)
	want := []string{"calico", "portmap", "detour-cni"}
	step := func(mode, runtime string, wantFiles []string) {
		t.Helper()
		e.flags.CNIConfigMode = mode
		a := e.agent(t, nodeagent.WithNodeClient(runtimeNode(e, runtime)))
		if _, err := a.Reconcile(context.Background()); err != nil {
			t.Fatalf("%s on %s: %v", mode, runtime, err)
		}
		if types := loaded(t, primary); !slices.Equal(types, want) {
			t.Errorf("%s on %s: the runtime loads %v, want %v", mode, runtime, types, want)
		}
		if got := files(t, e.confDir); !slices.Equal(got, wantFiles) {
			t.Errorf("%s on %s: conf dir holds %v, want %v", mode, runtime, got, wantFiles)
		}
		// detour check reads the mode and why from the file the agent records them in.
		got, why := nodeagent.ReadModeFile(e.confDir)
		if wantMode := nodeagent.ModeChainedEntry; slices.Contains(wantFiles, "k8s-pod-network/") && got != nodeagent.ModeDropIn || !slices.Contains(wantFiles, "k8s-pod-network/") && got != wantMode || why == "" {
			t.Errorf("%s on %s: recorded mode %q, %q", mode, runtime, got, why)
		}
	}
	inFile := []string{"10-calico.conflist", "detour-cni.kubeconfig", "detour-cni.mode", "detour-cni.token"}
	asDropIn := append(slices.Clone(inFile), "k8s-pod-network/", "k8s-pod-network/"+nodeagent.DropInName)

	step("chained-entry", "containerd://2.4.2", inFile)
	step("auto", "containerd://2.4.2", asDropIn) // upgrade to a release with auto
	if got := readFile(t, primary); got != calico {
		t.Errorf("the in-file entry was not removed byte for byte:\n%s", got)
	}
	step("auto", "containerd://1.7.27", inFile) // the node's runtime downgraded
	step("drop-in", "containerd://1.7.27", asDropIn)
	step("chained-entry", "containerd://2.4.2", inFile)
	if _, err := os.Stat(dropIn); !os.IsNotExist(err) {
		t.Errorf("drop-in still there: %v", err)
	}

	// A conflist that loads only its inlined plugins gets the in-file entry, and an earlier
	// drop-in goes.
	step("drop-in", "containerd://2.4.2", asDropIn)
	inlined := strings.Replace(calico, `"cniVersion": "0.3.1",`, `"cniVersion": "0.3.1", "loadOnlyInlinedPlugins": true,`, 1)
	writeAtomic(t, primary, inlined)
	e.flags.CNIConfigMode = "drop-in"
	a := e.agent(t)
	s, err := a.Reconcile(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if s.Mode != nodeagent.ModeChainedEntry || !strings.Contains(s.ModeReason, "loadOnlyInlinedPlugins") {
		t.Errorf("status %+v", s)
	}
	if types := loaded(t, primary); !slices.Equal(types, want) {
		t.Errorf("loadOnlyInlinedPlugins: the runtime loads %v, want %v", types, want)
	}
	if got := files(t, e.confDir); !slices.Equal(got, inFile) {
		t.Errorf("loadOnlyInlinedPlugins: conf dir holds %v, want %v", got, inFile)
	}
}

// --uninstall removes both forms: a drop-in (the network's and a stale one of another
// network) and in-file entries.
func TestUninstallBothForms(t *testing.T) {
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	stale := filepath.Join(e.confDir, "20-old.conflist")
	oldList := `{"name":"old","cniVersion":"1.0.0","plugins":[{"type":"bridge"},{"type":"detour-cni"}]}`
	writeFile(t, stale, oldList)
	otherDir := filepath.Join(e.confDir, "renamed-network")
	if err := os.MkdirAll(otherDir, 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(otherDir, nodeagent.DropInName), `{"type":"detour-cni"}`)
	// Someone else's drop-in stays.
	keepDir := filepath.Join(e.confDir, "old")
	if err := os.MkdirAll(keepDir, 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(keepDir, "10-tuning.conf"), `{"type":"tuning"}`)

	e.flags.CNIConfigMode = "drop-in"
	a := e.agent(t)
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(otherDir, nodeagent.DropInName)); !os.IsNotExist(err) {
		t.Errorf("the stale drop-in of another network is still there: %v", err)
	}
	if err := a.Uninstall(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got, want := files(t, e.confDir), []string{"10-calico.conflist", "20-old.conflist", "old/", "old/10-tuning.conf"}; !slices.Equal(got, want) {
		t.Errorf("after uninstall the conf dir holds %v, want %v", got, want)
	}
	if got := readFile(t, primary); got != calico {
		t.Errorf("primary after uninstall:\n%s", got)
	}
	if types := pluginTypes(t, readFile(t, stale)); !slices.Equal(types, []string{"bridge"}) {
		t.Errorf("stale conflist after uninstall: %v", types)
	}
	if err := a.Uninstall(context.Background()); err != nil {
		t.Errorf("second Uninstall: %v", err)
	}
}

// In drop-in mode another drop-in that sorts before detour's is fine; one after it is refused.
func TestDropInOrder(t *testing.T) {
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	dir := filepath.Join(e.confDir, "k8s-pod-network")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(dir, "50-tuning.conf"), `{"type":"tuning"}`)
	e.flags.CNIConfigMode = "drop-in"
	a := e.agent(t)
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if types := loaded(t, primary); !slices.Equal(types, []string{"calico", "portmap", "tuning", "detour-cni"}) {
		t.Errorf("the runtime loads %v", types)
	}
	writeFile(t, filepath.Join(dir, "zzz-late.conf"), `{"type":"late"}`)
	if _, err := a.Reconcile(context.Background()); err == nil || !strings.Contains(err.Error(), "zzz-late.conf") {
		t.Errorf("a drop-in after detour's was accepted: %v", err)
	}
}

// A bin dir on a read-only filesystem is refused with the value to set; the node stays
// unlabelled and gets an Event.
func TestReadOnlyBinDirRefused(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to mount a read-only filesystem")
	}
	e := newEnv(t)
	writeFile(t, filepath.Join(e.confDir, "10-calico.conflist"), calico)
	if err := syscall.Mount("tmpfs", e.binDir, "tmpfs", syscall.MS_RDONLY, ""); err != nil {
		t.Skipf("cannot mount a read-only tmpfs: %v", err)
	}
	t.Cleanup(func() { syscall.Unmount(e.binDir, 0) })
	client := runtimeNode(e, "containerd://2.4.2")
	a := e.agent(t, nodeagent.WithNodeClient(client))
	s, err := a.Reconcile(context.Background())
	if err == nil || !strings.Contains(err.Error(), "read-only") || !strings.Contains(err.Error(), "nodeAgent.cniBinDir") {
		t.Fatalf("Reconcile with a read-only bin dir = %v", err)
	}
	if s.EntryInPlace || s.NodeReady {
		t.Errorf("status %+v", s)
	}
	if _, err := os.Stat(filepath.Join(e.confDir, "k8s-pod-network", nodeagent.DropInName)); !os.IsNotExist(err) {
		t.Errorf("the drop-in was written without its binary: %v", err)
	}
	events, _ := client.CoreV1().Events("default").List(context.Background(), metav1.ListOptions{})
	if len(events.Items) != 1 || !strings.Contains(events.Items[0].Message, "nodeAgent.cniBinDir") {
		t.Errorf("events %+v", events.Items)
	}
}

const ciliumConf = `{"cniVersion":"0.3.1","name":"cilium","type":"cilium-cni","enable-debug":false}`

// Cilium with cni.exclusive renames every configuration but its own to *.cilium_bak: the agent
// notices its configuration renamed away, refuses (the node loses its ready label, an Event
// names the setting), and goes on once the setting is changed and the file deleted.
func TestExclusivePrimaryNoticed(t *testing.T) {
	e := newEnv(t)
	conf := filepath.Join(e.confDir, "05-cilium.conf")
	writeFile(t, conf, ciliumConf)
	// Another CNI's file Cilium renamed away is none of detour's business.
	writeFile(t, filepath.Join(e.confDir, "10-calico.conflist.cilium_bak"), calico)
	client := runtimeNode(e, "containerd://2.4.2")
	a := e.agent(t, nodeagent.WithNodeClient(client))
	ctx := context.Background()
	s, err := a.Reconcile(ctx)
	if err != nil || !s.NodeReady || s.Mode != nodeagent.ModeChainedEntry {
		t.Fatalf("Reconcile = %+v, %v", s, err)
	}
	// Cilium renames the converted conflist away and writes its .conf again.
	converted := filepath.Join(e.confDir, "05-cilium.conflist")
	if err := os.Rename(converted, converted+".cilium_bak"); err != nil {
		t.Fatal(err)
	}
	writeFile(t, conf, ciliumConf)
	s, err = a.Reconcile(ctx)
	if err == nil || !strings.Contains(err.Error(), "cni.exclusive=false") || !strings.Contains(err.Error(), "05-cilium.conflist.cilium_bak") {
		t.Fatalf("Reconcile after the rename = %v", err)
	}
	if s.EntryInPlace || s.NodeReady {
		t.Errorf("status %+v", s)
	}
	node, _ := client.CoreV1().Nodes().Get(ctx, "node-1", metav1.GetOptions{})
	if _, ok := node.Labels["detour.dev/cni-ready"]; ok {
		t.Errorf("the node kept its ready label: %v", node.Labels)
	}
	events, _ := client.CoreV1().Events("default").List(ctx, metav1.ListOptions{})
	if len(events.Items) != 1 || !strings.Contains(events.Items[0].Message, "cni.exclusive") {
		t.Errorf("events %+v", events.Items)
	}
	if files, _, err := nodeagent.RenamedAway(e.confDir); err != nil || len(files) != 1 {
		t.Errorf("RenamedAway = %v, %v", files, err)
	}

	// The user sets cni.exclusive=false and deletes the renamed file: the agent goes on.
	if err := os.Remove(converted + ".cilium_bak"); err != nil {
		t.Fatal(err)
	}
	if s, err := a.Reconcile(ctx); err != nil || !s.NodeReady {
		t.Errorf("Reconcile after the fix = %+v, %v", s, err)
	}
}
