package nodeagent_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

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
