//go:build conformance

package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/detourmesh/detour/test/e2e/framework"
	"github.com/detourmesh/detour/test/e2e/upstream"
)

// TestNetpolCilium is `make netpol-cilium` (docs/conformance.md#networkpolicy-with-every-pod-meshed-cilium):
// Kubernetes' own NetworkPolicy tests (upstream.SelectNetpol) on a Cilium cluster of two
// nodes, which enforces the policies, first without detour, then with detour injecting every
// pod. A client in the mesh connects to its own proxy, which accepts the connection before it
// dials the destination, so the tests' probes, which count a completed connect() as
// connectivity, see every TCP connection of a meshed client succeed. What the policy decides is
// what the proxy's own connection meets: the run follows every proxy's log and, for each test
// that fails with detour only, reads the truth table of the step it failed at and checks it
// pair by pair against what the proxies carried (upstream.NetpolWire). It fails when a denied
// pair got through a proxy, an allowed one was not carried, a probe failed where the policy
// allows it, or the step cannot be read; when a denied pair was never seen in force by the
// step's end, unless the same step without detour needed its second round too (NetpolRow.Late);
// and when fewer than 95% of the tests' pod-network pods were injected. After each run,
// netpolRelabel watches relabelled servers for longer than the upstream test does, and fails
// the run when the policy does not hold through the proxies. Last, make e2e's conformance
// smoke runs on the cluster with every pod meshed. It writes $DETOUR_NETPOL_DIR/report.md (default bin/netpol-cilium/), with the
// JUnit reports, e2e.test's logs and the proxies' logs. DETOUR_CONFORMANCE_PROCS (default 3) is
// the parallel processes of each run; DETOUR_NETPOL_FOCUS (a regular expression) runs only the
// tests whose names match, to look at one closely.
//
// Declared before TestConformance (the file's name sorts first): it starts a cluster of its
// own, which cannot run beside the shared node.
func TestNetpolCilium(t *testing.T) {
	framework.RequireCilium(t)
	e := framework.OwnEnv(t, framework.Options{Cilium: &framework.CiliumConfig{}})
	ctx, cancel := framework.Context(t, e.Node, 4*time.Hour)
	defer cancel()
	e.JoinNode(t, ctx, "e2e-node-b", framework.Options{Images: e.Artifacts.Tarballs})

	tests := upstream.SelectNetpol(listUpstreamTests(t, ctx, e))
	if focus := os.Getenv("DETOUR_NETPOL_FOCUS"); focus != "" {
		re, err := regexp.Compile(focus)
		if err != nil {
			t.Fatalf("DETOUR_NETPOL_FOCUS %q: %v; give a Go regular expression matching test names", focus, err)
		}
		tests = slices.DeleteFunc(tests, func(name string) bool { return !re.MatchString(name) })
		if len(tests) == 0 {
			t.Fatalf("DETOUR_NETPOL_FOCUS %q matches none of the NetworkPolicy tests", focus)
		}
	}
	dir := reportDir(t, e, "DETOUR_NETPOL_DIR", "netpol-cilium")
	run, procs := upstreamRunner(t, ctx, e, dir, tests)
	stop := watchCilium(t, ctx, e, dir, "without-detour-")
	without, tookWithout := run("without-detour-")
	stop()
	relabelWithout := netpolRelabel(t, ctx, e, relabelForm{Name: "without detour", Prefix: "relabel-nodetour"})

	rec := meshEveryPod(t, ctx, e)
	logs, err := upstream.FollowProxyLogs(ctx, e.Node.Client)
	if err != nil {
		t.Fatal(err)
	}
	stop = watchCilium(t, ctx, e, dir, "with-detour-")
	with, tookWith := run("with-detour-")
	stop()
	rec.Stop() // the tests' pods: the relabel run's opted-out pods are not injected on purpose
	relabelWith := netpolRelabel(t, ctx, e, relabelForm{Name: "with detour, meshed", Prefix: "relabel-meshed", Meshed: true},
		relabelForm{Name: "with detour, opted out", Prefix: "relabel-optout", OptOut: true})
	logs.Stop()

	lines, unread := logs.Lines()
	var proxyLog strings.Builder
	for _, l := range lines {
		fmt.Fprintf(&proxyLog, "%s %s %s\n", l.Time.Format(time.RFC3339Nano), l.Pod, l.Text)
	}
	if err := os.WriteFile(filepath.Join(dir, "with-detour-proxies.log"), []byte(proxyLog.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	var verdicts []upstream.CiliumVerdict
	for _, n := range e.Node.Nodes() {
		b, err := os.ReadFile(filepath.Join(dir, "with-detour-cilium-monitor-"+n.Name+".log"))
		if err != nil {
			t.Fatal(err)
		}
		verdicts = append(verdicts, upstream.ParseCiliumVerdicts(string(b))...)
	}
	rows := upstream.CompareNetpol(without, with, rec.Pods(), rec.Services(), lines, verdicts)
	c := upstream.Count(rec.Pods())
	var b strings.Builder
	fmt.Fprintf(&b, "# Kubernetes' NetworkPolicy tests on Cilium, with and without detour\n\n")
	fmt.Fprintf(&b, "%s; e2e.test %s; Cilium %s; %d tests, %d parallel processes, 2 nodes; without detour %s, with detour %s.\n",
		time.Now().UTC().Format("2006-01-02"), kubernetesVersion(e), ciliumVersion(e), len(tests), procs, tookWithout.Round(time.Second), tookWith.Round(time.Second))
	fmt.Fprintf(&b, "With detour: %d of %d pod-network pods injected (%.1f%%), %d host-network pods (never injected); %d proxies' logs followed (%d lines), %d could not be, %d streams ended by the kubelet while the proxy logged on and were read again.\n\n",
		c.Injected, c.PodNetwork, 100*c.Fraction(), c.HostNetwork, logs.Followed(), len(lines), len(unread), logs.Resumed())
	b.WriteString(upstream.NetpolTable(rows))
	b.WriteString(relabelTable(relabelWithout, relabelWith))
	if err := os.WriteFile(filepath.Join(dir, "report.md"), []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("report %s:\n%s", filepath.Join(dir, "report.md"), b.String())
	for _, r := range rows {
		if r.Regression() {
			t.Errorf("passes without detour, %s with it, and the proxies do not show the policy holding: %s: %s", r.With.Status, r.Name, r.With.Message)
		}
		if len(r.Wire.Leaks) > 0 {
			t.Errorf("%s: a connection the policy denies went through a proxy: %s", r.Name, strings.Join(r.Wire.Leaks, ", "))
		}
	}
	if c.PodNetwork == 0 || c.Fraction() < 0.95 {
		t.Errorf("%d of %d pod-network pods of the tests were injected, want at least 95%%; not injected: %s", c.Injected, c.PodNetwork, strings.Join(c.Missed, ", "))
	}
	if len(unread) > 0 {
		t.Logf("proxies whose log could not be followed: %s", strings.Join(unread, "; "))
	}
	// make e2e's conformance smoke (sig-network: Services, DNS, pod to pod, session affinity,
	// NodePort) on Cilium, detour still injecting every pod.
	t.Run("conformance-smoke", func(t *testing.T) { conformanceSmoke(t, ctx, e) })
}

// watchCilium starts cilium-dbg monitor on every node for one run, printing Cilium's policy
// verdicts and drops to dir/<prefix>cilium-monitor-<node>.log; the function it returns stops
// them and writes what each agent knows beside them (<prefix>cilium-state-<node>.txt: endpoints,
// identities and their labels, IP cache, Services), so that a verdict's identities can be read.
func watchCilium(t *testing.T, ctx context.Context, e *framework.Env, dir, prefix string) (stop func()) {
	t.Helper()
	var stops []func()
	for _, n := range e.Node.Nodes() {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		out := filepath.Join(dir, prefix+"cilium-monitor-"+n.Name+".log")
		os.Remove(out) // a run before this one's
		s, err := n.CiliumMonitor(out)
		if err != nil {
			t.Fatal(err)
		}
		stops = append(stops, s)
	}
	return func() {
		for _, s := range stops {
			s()
		}
		for _, n := range e.Node.Nodes() {
			if err := os.WriteFile(filepath.Join(dir, prefix+"cilium-state-"+n.Name+".txt"), []byte(n.CiliumState(ctx)), 0o644); err != nil {
				t.Error(err)
			}
		}
	}
}

// ciliumVersion is cilium-agent's own version.
func ciliumVersion(e *framework.Env) string {
	out, err := exec.Command(e.Node.Bin("cilium/cilium-agent"), "--version").Output()
	if err != nil {
		return fmt.Sprintf("(no version: %v)", err)
	}
	return strings.TrimSpace(string(out))
}
