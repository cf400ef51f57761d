package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/internal/clustercheck"
	"github.com/detourmesh/detour/internal/nsutil"
	"github.com/detourmesh/detour/internal/version"
	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/test/testenv"
)

func TestCheckCNIConfig(t *testing.T) {
	for _, tc := range []struct {
		name  string
		files map[string]string
		want  string
	}{
		{"no config", nil, "none found; the primary CNI"},
		{"unsupported version", map[string]string{"10-bridge.conf": `{"cniVersion":"0.2.0","name":"k8s","type":"bridge"}`},
			`✗ 10-bridge.conf: network "k8s" declares cniVersion "0.2.0", which detour-cni does not speak`},
		{"primary only", map[string]string{"10-bridge.conflist": `{"cniVersion":"1.1.0","name":"k8s","plugins":[{"type":"bridge"}]}`},
			"has no detour-cni entry"},
		{"detour first", map[string]string{"10-bridge.conflist": `{"cniVersion":"1.1.0","name":"k8s","plugins":[{"type":"detour-cni"},{"type":"bridge"}]}`},
			"is the first plugin"},
		{"another plugin after detour", map[string]string{"10-bridge.conflist": `{"cniVersion":"1.1.0","name":"k8s","plugins":[{"type":"bridge"},{"type":"detour-cni"},{"type":"bandwidth"}]}`},
			"✓ 10-bridge.conflist (the configuration the runtime uses) chains detour-cni after the primary plugin"},
		{"installed", map[string]string{
			"10-bridge.conflist": `{"cniVersion":"1.1.0","name":"k8s","plugins":[{"type":"bridge"},{"type":"detour-cni","kubeconfig":"KUBECONFIG"}]}`,
			"99-other.conflist":  `{"cniVersion":"1.1.0","name":"other","plugins":[{"type":"bridge"}]}`},
			"✓ 10-bridge.conflist (the configuration the runtime uses) chains detour-cni after the primary plugin (mode chained-entry: cniConfigMode chained-entry, or auto on a runtime that loads no drop-ins (the node agent's log says which))\n✓ the plugin's kubeconfig"},
		{"bad entry", map[string]string{"10-bridge.conflist": `{"cniVersion":"1.1.0","name":"k8s","plugins":[{"type":"bridge"},{"type":"detour-cni","apiTimeout":"forever"}]}`},
			`apiTimeout "forever" is not valid`},
		{"drop-in", map[string]string{
			"10-bridge.conflist":     `{"cniVersion":"1.1.0","name":"k8s","plugins":[{"type":"bridge"}]}`,
			"k8s/10-tuning.conf":     `{"type":"tuning"}`,
			"k8s/zz-detour-cni.conf": `{"type":"detour-cni","kubeconfig":"KUBECONFIG"}`},
			"✓ 10-bridge.conflist (the configuration the runtime uses) loads detour-cni from the drop-in DIR/k8s/zz-detour-cni.conf after its plugins (mode drop-in"},
		{"drop-in, with the agent's reason", map[string]string{
			"10-bridge.conflist":     `{"cniVersion":"1.1.0","name":"k8s","plugins":[{"type":"bridge"}]}`,
			"detour-cni.mode":        "drop-in\ncniConfigMode is auto and containerd 2.4.2 loads drop-ins (2.1.0 or later)\n",
			"k8s/zz-detour-cni.conf": `{"type":"detour-cni"}`},
			"✓ 10-bridge.conflist (the configuration the runtime uses) loads detour-cni from the drop-in DIR/k8s/zz-detour-cni.conf after its plugins (mode drop-in: cniConfigMode is auto and containerd 2.4.2 loads drop-ins (2.1.0 or later))"},
		{"in-file entry, with the agent's reason", map[string]string{
			"10-bridge.conflist": `{"cniVersion":"1.1.0","name":"k8s","plugins":[{"type":"bridge"},{"type":"detour-cni"}]}`,
			"detour-cni.mode":    "chained-entry\ncniConfigMode is auto and containerd 1.7.27 loads no drop-ins (it needs 2.1.0 or later)\n"},
			"✓ 10-bridge.conflist (the configuration the runtime uses) chains detour-cni after the primary plugin (mode chained-entry: cniConfigMode is auto and containerd 1.7.27 loads no drop-ins (it needs 2.1.0 or later))"},
		{"in-file entry with loadOnlyInlinedPlugins", map[string]string{"10-bridge.conflist": `{"cniVersion":"1.1.0","name":"k8s","loadOnlyInlinedPlugins":true,"plugins":[{"type":"bridge"},{"type":"detour-cni"}]}`},
			`✓ 10-bridge.conflist (the configuration the runtime uses) chains detour-cni after the primary plugin (mode chained-entry: the conflist sets "loadOnlyInlinedPlugins": true`},
		{"drop-in and entry", map[string]string{
			"10-bridge.conflist":     `{"cniVersion":"1.1.0","name":"k8s","plugins":[{"type":"bridge"},{"type":"detour-cni"}]}`,
			"k8s/zz-detour-cni.conf": `{"type":"detour-cni"}`},
			"✗ DIR/10-bridge.conflist holds a detour-cni entry and DIR/k8s/zz-detour-cni.conf is detour's drop-in as well: the runtime runs the plugin twice"},
		{"drop-in ignored", map[string]string{
			"10-bridge.conflist":     `{"cniVersion":"1.1.0","name":"k8s","loadOnlyInlinedPlugins":true,"plugins":[{"type":"bridge"}]}`,
			"k8s/zz-detour-cni.conf": `{"type":"detour-cni"}`},
			`so the runtime ignores it`},
		{"drop-in before another", map[string]string{
			"10-bridge.conflist":     `{"cniVersion":"1.1.0","name":"k8s","plugins":[{"type":"bridge"}]}`,
			"k8s/zz-detour-cni.conf": `{"type":"detour-cni"}`,
			"k8s/zzz-late.conf":      `{"type":"late"}`},
			`✗ DIR/k8s/zzz-late.conf runs after detour's drop-in`},
		{"exclusive primary", map[string]string{
			"05-cilium.conf":                `{"cniVersion":"0.3.1","name":"cilium","type":"cilium-cni"}`,
			"05-cilium.conflist.cilium_bak": `{"cniVersion":"0.3.1","name":"cilium","plugins":[{"type":"cilium-cni"},{"type":"detour-cni"}]}`},
			"✗ the primary CNI renamed detour's configuration away (DIR/05-cilium.conflist.cilium_bak), and the node agent keeps the node unlabelled: Cilium claims the CNI config directory (its Helm value cni.exclusive, true by default): set cni.exclusive=false"},
		{"kubeconfig missing", map[string]string{"10-bridge.conflist": `{"cniVersion":"1.1.0","name":"k8s","plugins":[{"type":"bridge"},{"type":"detour-cni","kubeconfig":"/nonexistent/kubeconfig"}]}`},
			"✗ the plugin's kubeconfig"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			kubeconfig := filepath.Join(dir, "detour-cni.kubeconfig")
			os.WriteFile(kubeconfig, []byte("apiVersion: v1\n"), 0o600)
			for name, content := range tc.files {
				os.MkdirAll(filepath.Dir(filepath.Join(dir, name)), 0o755)
				os.WriteFile(filepath.Join(dir, name), []byte(strings.ReplaceAll(content, "KUBECONFIG", kubeconfig)), 0o644)
			}
			var out bytes.Buffer
			c := &checker{out: &out}
			c.cniConfig(dir)
			tc.want = strings.ReplaceAll(tc.want, "DIR", dir)
			if !strings.Contains(out.String(), tc.want) || strings.Contains(out.String(), "<nil>") {
				t.Errorf("check printed\n%s\nwant it to contain %q", out.String(), tc.want)
			}
			if strings.Contains(tc.want, "✗") || !strings.HasPrefix(tc.want, "✓") {
				if c.failed == 0 {
					t.Error("the check should have failed")
				}
			} else if c.failed != 0 {
				t.Errorf("the check failed: %s", out.String())
			}
		})
	}
}

// check --netns compares a pod namespace's live rules with its annotations and names the first
// difference; for a pod injected by a newer detour than itself it warns instead of failing.
func TestIntegrationCheckPodRules(t *testing.T) {
	ns := testenv.NewNetNS(t)
	r := annotations.Redirect{Version: "v1", ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140, ExemptGIDs: []uint32{2601}}
	pod := map[string]any{"apiVersion": "v1", "kind": "Pod", "metadata": map[string]any{"name": "web", "annotations": r.Annotations()}}
	b, _ := yaml.Marshal(pod)
	podFile := filepath.Join(t.TempDir(), "pod.yaml")
	os.WriteFile(podFile, b, 0o644)

	args := []string{"check", "--cni-conf-dir=", "-f", podFile, "--netns", ns.Path}
	if out, _, err := run(t, "", args...); err == nil || !strings.Contains(out, "✗ Pod web: check ipv4 rules in") || !strings.Contains(out, "missing") {
		t.Fatalf("check before the rules are installed: %v\n%s", err, out)
	}
	rs, _ := iptables.Build(iptables.ConfigFromRedirect(r, iptables.IPv4))
	if err := iptables.NewExecutor().Apply(context.Background(), ns.Path, rs); err != nil {
		t.Fatal(err)
	}
	out, _, err := run(t, "", args...)
	if err != nil || !strings.Contains(out, "✓ Pod web: the ipv4 rules in "+ns.Path+" are exactly what detour-cni installs") {
		t.Fatalf("check after installing the rules: %v\n%s", err, out)
	}
	if !strings.Contains(out, "✓ Pod web: no IPv6 address in "+ns.Path+", and no IPv6 rules") {
		t.Errorf("an IPv4-only pod's IPv6 check:\n%s", out)
	}

	// A pod injected by a newer detour (before a rollback): a rule this release does not know
	// is ‼, a missing table, chain, jump or redirect is ✗ whatever the release.
	newer := r.Annotations()
	newer[annotations.Injected] = "v99.0.0"
	b, _ = yaml.Marshal(map[string]any{"apiVersion": "v1", "kind": "Pod", "metadata": map[string]any{"name": "web", "annotations": newer}})
	newerFile := filepath.Join(t.TempDir(), "newer.yaml")
	os.WriteFile(newerFile, b, 0o644)
	for _, tc := range []struct {
		name    string
		install func(c iptables.Config) iptables.Config // nil: nothing installed
		want    string
	}{
		{"nothing installed", nil, "✗ Pod web: check ipv4 rules in"},
		{"a rule more", func(c iptables.Config) iptables.Config { c.ExemptUIDs = append(c.ExemptUIDs, 1234); return c }, "‼ Pod web: check ipv4 rules in"},
		{"the outbound redirect to another port", func(c iptables.Config) iptables.Config { c.OutboundPort = 5140; return c }, "✗ Pod web: check ipv4 rules in"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ns := testenv.NewNetNS(t)
			if tc.install != nil {
				rs, err := iptables.Build(tc.install(iptables.ConfigFromRedirect(r, iptables.IPv4)))
				if err != nil {
					t.Fatal(err)
				}
				if err := iptables.NewExecutor().Apply(context.Background(), ns.Path, rs); err != nil {
					t.Fatal(err)
				}
			}
			out, _, err := run(t, "", "check", "--cni-conf-dir=", "-f", newerFile, "--netns", ns.Path)
			if !strings.Contains(out, tc.want) || (err == nil) != strings.HasPrefix(tc.want, "‼") {
				t.Errorf("check of a pod injected by a newer detour: %v, want %q\n%s", err, tc.want, out)
			}
			if strings.HasPrefix(tc.want, "‼") && !strings.Contains(out, "injected by detour v99.0.0, newer than this one") {
				t.Errorf("the warning does not name the newer release:\n%s", out)
			}
		})
	}

	// A pod with an IPv6 address must have IPv6 rules.
	testenv.Link(t, ns, "eth0", []netip.Prefix{netip.MustParsePrefix("fd99::2/64")}, testenv.NewNetNS(t), "eth0", []netip.Prefix{netip.MustParsePrefix("fd99::1/64")})
	if out, _, err := run(t, "", args...); err == nil || !strings.Contains(out, "✗ Pod web: check ") || !strings.Contains(out, "ipv6") {
		t.Fatalf("check of a dual-stack pod without IPv6 rules: %v\n%s", err, out)
	}
}

// detour check --cluster finds the kubeconfig as kubectl does and reports through the real API
// server; nothing is installed here, so it stops at detour's namespace and exits non-zero.
func TestIntegrationCheckClusterCommand(t *testing.T) {
	cfg := testenv.ControlPlane(t)
	kubeconfig := testenv.Kubeconfig(t, cfg)

	out, _, err := run(t, "", "check", "--cluster", "--kubeconfig", kubeconfig, "-n", "detour-elsewhere", "-o", "json")
	var report clustercheck.Report
	if jerr := json.Unmarshal([]byte(out), &report); jerr != nil || err == nil || len(report.Results) != 2 {
		t.Fatalf("check --cluster -o json: %v, %v\n%s", err, jerr, out)
	}
	if r := report.Results[0]; r.Name != "kubernetes-api" || r.Status != clustercheck.OK || !strings.Contains(r.Message, cfg.Host) {
		t.Errorf("first result %+v, want kubernetes-api ok at %s", r, cfg.Host)
	}
	if r := report.Results[1]; r.Name != "detour-namespace" || r.Status != clustercheck.Error || !strings.Contains(r.Message, "namespace detour-elsewhere not found") || r.Fix == "" {
		t.Errorf("second result %+v, want detour-namespace error", r)
	}

	// $KUBECONFIG, as kubectl; text output.
	t.Setenv("KUBECONFIG", kubeconfig)
	out, _, err = run(t, "", "check", "--cluster")
	if err == nil || !strings.Contains(out, "✓ the API server at "+cfg.Host) || !strings.Contains(out, "✗ namespace detour-system not found") {
		t.Errorf("check --cluster with $KUBECONFIG: %v\n%s", err, out)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"check", "--cluster", "--context", "nope"}, `context "nope" does not exist`},
		{[]string{"check", "--cluster", "-o", "yaml"}, `-o "yaml": use text or json`},
		{[]string{"check", "--cluster", "--netns", "/var/run/netns/x"}, "--netns checks a node"},
		{[]string{"check", "--since", "2h"}, "--since goes with --cluster"},
	} {
		if _, _, err := run(t, "", tc.args...); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("detour %v: %v, want an error containing %q", tc.args, err, tc.want)
		}
	}
}

// check --iptables-backend nftables reads detour's nf_tables table back from the kernel.
func TestIntegrationCheckPodRulesNFTables(t *testing.T) {
	ns := testenv.NewNetNS(t)
	r := annotations.Redirect{Version: "v1", ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140, ExemptGIDs: []uint32{2601}}
	pod := map[string]any{"apiVersion": "v1", "kind": "Pod", "metadata": map[string]any{"name": "web", "annotations": r.Annotations()}}
	b, _ := yaml.Marshal(pod)
	podFile := filepath.Join(t.TempDir(), "pod.yaml")
	os.WriteFile(podFile, b, 0o644)

	args := []string{"check", "--cni-conf-dir=", "--iptables-backend=nftables", "-f", podFile, "--netns", ns.Path}
	if out, _, err := run(t, "", args...); err == nil || !strings.Contains(out, "table inet detour is missing") {
		t.Fatalf("check before the rules are installed: %v\n%s", err, out)
	}
	rs, _ := iptables.Build(iptables.ConfigFromRedirect(r, iptables.IPv4))
	if err := iptables.NewExecutor(iptables.WithBackend(iptables.BackendNFTables)).Apply(context.Background(), ns.Path, rs); err != nil {
		t.Fatal(err)
	}
	out, _, err := run(t, "", args...)
	for _, want := range []string{
		"✓ ipv4: the kernel answers nf_tables requests",
		"✓ Pod web: the ipv4 rules in " + ns.Path + " are exactly what detour-cni installs",
		"✓ Pod web: no IPv6 address in " + ns.Path + ", and no IPv6 rules",
	} {
		if err != nil || !strings.Contains(out, want) {
			t.Errorf("check after installing the rules: %v, want %q in\n%s", err, want, out)
		}
	}
}

// injectedByNewer tells a pod injected by a newer release apart; anything else, including a
// version that does not parse, is judged by the check.
func TestInjectedByNewer(t *testing.T) {
	defer func(v string) { version.Version = v }(version.Version)
	version.Version = "v0.2.0"
	for in, want := range map[string]string{
		"v0.3.0": "v0.3.0", "v0.2.1": "v0.2.1", "v1.0.0-rc.1": "v1.0.0-rc.1",
		"v0.2.0": "", "v0.1.0": "", "v0.2.0-e2e": "", "v1": "", "": "", "latest": "",
	} {
		if got := injectedByNewer(in); got != want {
			t.Errorf("injectedByNewer(%q) with detour v0.2.0 = %q, want %q", in, got, want)
		}
	}
	// A development build knows its own release's rules, whatever the commit on either side.
	for self, pods := range map[string][]string{
		"v0.2.0-dev.abc123": {"v0.2.0", "v0.2.0-dev.def456", "v0.2.0-dev.0001", "v0.2.0-dev"},
		"v0.2.0-dev":        {"v0.2.0", "v0.2.0-dev.abc123"},
	} {
		version.Version = self
		for _, pod := range pods {
			if got := injectedByNewer(pod); got != "" {
				t.Errorf("detour %s judging a pod of %s: newer %q, want the same release", self, pod, got)
			}
		}
		if got := injectedByNewer("v0.3.0-dev.abc"); got != "v0.3.0-dev.abc" {
			t.Errorf("detour %s judging a pod of v0.3.0-dev.abc: %q, want it newer", self, got)
		}
	}
}

// A pod that asked for the socket lookup and got the fallback ADD installs where the kernel
// refuses it: ‼ with what to do, whatever the kernel can do now — not "not as installed".
func TestIntegrationCheckPodRulesInboundFallback(t *testing.T) {
	r := annotations.Redirect{Version: "v1", ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140, InboundListening: true}
	pod := map[string]any{"apiVersion": "v1", "kind": "Pod", "metadata": map[string]any{"name": "web", "annotations": r.Annotations()}}
	b, _ := yaml.Marshal(pod)
	podFile := filepath.Join(t.TempDir(), "pod.yaml")
	os.WriteFile(podFile, b, 0o644)
	for _, backend := range []iptables.Backend{iptables.BackendNFTables, iptables.BackendLegacy} {
		t.Run(string(backend), func(t *testing.T) {
			ns := testenv.NewNetNS(t)
			rs, _ := iptables.Build(iptables.ConfigFromRedirect(r, iptables.IPv4))
			fallback, ok := iptables.InboundFallback([]iptables.Ruleset{rs})
			if !ok {
				t.Fatal("no fallback for a listening pod")
			}
			if err := iptables.NewExecutor(iptables.WithBackend(backend)).Apply(context.Background(), ns.Path, fallback...); err != nil {
				t.Fatal(err)
			}
			out, _, err := run(t, "", "check", "--cni-conf-dir=", "--iptables-backend="+string(backend), "-f", podFile, "--netns", ns.Path)
			if err != nil || !strings.Contains(out, "‼ Pod web: the ipv4 rules in "+ns.Path+" are the fallback detour-cni installs where the kernel refuses the socket lookup") {
				t.Errorf("check of a pod that fell back (%s, the kernel here does the lookup): %v\n%s", backend, err, out)
			}
			// The same rules unmarked are not the fallback: they are what detour-cni v0.1.0,
			// which knows no socket lookup, installs for the pod, and the check says so.
			all := iptables.ConfigFromRedirect(r, iptables.IPv4)
			all.InboundListening = false
			plain, _ := iptables.Build(all)
			if err := iptables.NewExecutor(iptables.WithBackend(backend)).Apply(context.Background(), ns.Path, plain); err != nil {
				t.Fatal(err)
			}
			if out, _, err := run(t, "", "check", "--cni-conf-dir=", "--iptables-backend="+string(backend), "-f", podFile, "--netns", ns.Path); err != nil ||
				!strings.Contains(out, "‼ Pod web: the ipv4 rules in "+ns.Path+" are what detour-cni v0.1.0 installs") || strings.Contains(out, "are the fallback") {
				t.Errorf("check of a listening pod with unmarked every-connection rules: %v\n%s", err, out)
			}
		})
	}
}

// An app that listens on the check port without declaring it passes the check at its pod's
// start (it was not running yet) and breaks the next one: check --netns finds it, names its
// address and owner, and fails.
func TestIntegrationCheckPodCheckPort(t *testing.T) {
	ns := testenv.NewNetNS(t)
	r := annotations.Redirect{Version: "v1", ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140, CheckPort: 4142}
	b, _ := yaml.Marshal(map[string]any{"apiVersion": "v1", "kind": "Pod", "metadata": map[string]any{"name": "web", "annotations": r.Annotations()}})
	podFile := filepath.Join(t.TempDir(), "pod.yaml")
	os.WriteFile(podFile, b, 0o644)
	rs, _ := iptables.Build(iptables.ConfigFromRedirect(r, iptables.IPv4))
	if err := iptables.NewExecutor().Apply(context.Background(), ns.Path, rs); err != nil {
		t.Fatal(err)
	}
	args := []string{"check", "--cni-conf-dir=", "-f", podFile, "--netns", ns.Path}
	out, _, err := run(t, "", args...)
	if err != nil || !strings.Contains(out, "✓ Pod web: nothing of the pod listens on the check port 4142") {
		t.Fatalf("check with the check port free: %v\n%s", err, out)
	}

	var ln net.Listener
	if err := nsutil.Do(ns.Path, func() (err error) { ln, err = net.Listen("tcp4", "0.0.0.0:4142"); return err }); err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	want := fmt.Sprintf("✗ Pod web: a container of the pod listens on the check port 4142 (detour.dev/validator-check-port) at 0.0.0.0:4142 (uid %d): the check at the proxy's next start will find it taken, exit 43", os.Getuid())
	if out, _, err := run(t, "", args...); err == nil || !strings.Contains(out, want) {
		t.Errorf("check with an app on the check port: %v, want %q\n%s", err, want, out)
	}
}

// A pod injected with the socket lookup and the check port while its node still ran detour-cni
// v0.1.0 (an upgrade: the webhook rolled before the node's agent) holds v0.1.0's rules: ‼ with
// what that means and what to do, not a failure; anything else that differs stays ✗.
func TestIntegrationCheckPodV010Rules(t *testing.T) {
	r := annotations.Redirect{Version: "v1", ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140, CheckPort: 4142, InboundListening: true}
	a := r.Annotations()
	a[annotations.Injected] = "v0.2.0"
	b, _ := yaml.Marshal(map[string]any{"apiVersion": "v1", "kind": "Pod", "metadata": map[string]any{"name": "web", "annotations": a}})
	podFile := filepath.Join(t.TempDir(), "pod.yaml")
	os.WriteFile(podFile, b, 0o644)
	rulesets, err := iptables.BuildFamilies(r, iptables.IPv4)
	if err != nil {
		t.Fatal(err)
	}
	older, ok := iptables.V010Rules(rulesets)
	if !ok {
		t.Fatal("V010Rules: the pod uses the lookup and the check port, want v0.1.0's form")
	}
	for _, tc := range []struct {
		name    string
		install []iptables.Ruleset
		want    string
	}{
		{"v0.1.0's rules", older, "‼ Pod web: the ipv4 rules in"},
		{"this release's", rulesets, "✓ Pod web: the ipv4 rules in"},
		{"v0.1.0's with another outbound port", func() []iptables.Ruleset {
			c := older[0].Config
			c.OutboundPort = 5140
			rs, _ := iptables.Build(c)
			return []iptables.Ruleset{rs}
		}(), "✗ Pod web: check ipv4 rules in"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ns := testenv.NewNetNS(t)
			if err := iptables.NewExecutor().Apply(context.Background(), ns.Path, tc.install...); err != nil {
				t.Fatal(err)
			}
			out, _, err := run(t, "", "check", "--cni-conf-dir=", "-f", podFile, "--netns", ns.Path)
			if !strings.Contains(out, tc.want) || (err == nil) == strings.HasPrefix(tc.want, "✗") {
				t.Fatalf("check: %v, want %q\n%s", err, tc.want, out)
			}
			if strings.HasPrefix(tc.want, "‼") && !strings.Contains(out, "what detour-cni v0.1.0 installs for this pod, injected by detour v0.2.0") {
				t.Errorf("the warning does not say whose rules they are:\n%s", out)
			}
		})
	}
}
