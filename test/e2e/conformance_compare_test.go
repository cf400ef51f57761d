//go:build conformance || dualstack

package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/detourmesh/detour/test/e2e/framework"
	"github.com/detourmesh/detour/test/e2e/upstream"
)

// Runs of Kubernetes' own tests against the e2e's cluster, without detour and with it: make
// conformance's, make netpol-cilium's and make e2e-dualstack's.

// kubernetesVersion is e2e.test's own version.
func kubernetesVersion(e *framework.Env) string {
	out, err := exec.Command(e.Node.Bin("e2e.test"), "--version").Output()
	if err != nil {
		return fmt.Sprintf("(no version: %v)", err)
	}
	return strings.TrimSpace(string(out))
}

// reportDir is where a run of Kubernetes' tests writes its reports: $env, or bin/def of the
// repository, as an absolute path.
func reportDir(t *testing.T, e *framework.Env, env, def string) string {
	dir := os.Getenv(env)
	if dir == "" {
		dir = filepath.Join(e.Root, "bin", def)
	}
	dir, err := filepath.Abs(dir)
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

// upstreamRunner returns a run of tests of e2e.test against e's cluster, with
// DETOUR_CONFORMANCE_PROCS (default 3) parallel processes, writing to dir under prefix; it
// returns the results and how long the run took. It returns the number of processes too.
func upstreamRunner(t *testing.T, ctx context.Context, e *framework.Env, dir string, tests []string) (func(prefix string) ([]upstream.Result, time.Duration), int) {
	procs := 3
	if v := os.Getenv("DETOUR_CONFORMANCE_PROCS"); v != "" {
		var err error
		if procs, err = strconv.Atoi(v); err != nil || procs < 1 {
			t.Fatalf("DETOUR_CONFORMANCE_PROCS=%q: want a number of processes, 1 or more", v)
		}
	}
	return func(prefix string) ([]upstream.Result, time.Duration) {
		t.Helper()
		o := upstreamOptions(e, dir, prefix, tests, 3*time.Hour)
		o.Procs, o.Ginkgo = procs, e.Node.Bin("ginkgo")
		start := time.Now()
		results, err := upstream.Run(ctx, e.Node.RunSplit, o)
		if err != nil {
			t.Fatal(err)
		}
		return results, time.Since(start)
	}, procs
}

// listUpstreamTests is e2e.test's list of its tests (--list-tests).
func listUpstreamTests(t *testing.T, ctx context.Context, e *framework.Env) string {
	list, err := exec.CommandContext(ctx, e.Node.Bin("e2e.test"), "--list-tests").Output()
	if err != nil {
		t.Fatalf("e2e.test --list-tests: %v", err)
	}
	return string(list)
}

// meshEveryPod installs detour injecting every pod (defaultInject enabled) with its node agent
// on every node, and starts recording the pods created from then on.
func meshEveryPod(t *testing.T, ctx context.Context, e *framework.Env) *upstream.Recorder {
	e.InstallDetour(t, ctx, "webhook:\n  config:\n    defaultInject: enabled\n")
	for _, n := range e.Node.Nodes() {
		e.SetNodeAgent(t, ctx, n, true)
	}
	rec, err := upstream.Record(ctx, e.Node.Client)
	if err != nil {
		t.Fatal(err)
	}
	return rec
}

// withAndWithout runs tests of e2e.test on e's cluster without detour injecting, then with
// detour injecting every pod ([meshEveryPod]), and writes the table of both runs under title to
// dir/report.md. It fails when a test that passed without detour fails with it and is not a
// listed exception (upstream.Exceptions), or when fewer than 95% of the tests' pod-network pods
// were injected (counted from the API).
func withAndWithout(t *testing.T, ctx context.Context, e *framework.Env, dir, title string, tests []string) {
	run, procs := upstreamRunner(t, ctx, e, dir, tests)
	without, tookWithout := run("without-detour-")

	rec := meshEveryPod(t, ctx, e)
	with, tookWith := run("with-detour-")
	rec.Stop()

	rows := upstream.Compare(without, with)
	c := upstream.Count(rec.Pods())
	var b strings.Builder
	fmt.Fprintf(&b, "# %s\n\n", title)
	fmt.Fprintf(&b, "%s; e2e.test %s; %d tests, %d parallel processes, %d nodes (%s); without detour %s, with detour %s.\n",
		time.Now().UTC().Format("2006-01-02"), kubernetesVersion(e), len(tests), procs, len(e.Node.Nodes()), families(e),
		tookWithout.Round(time.Second), tookWith.Round(time.Second))
	fmt.Fprintf(&b, "With detour: %d of %d pod-network pods injected (%.1f%%), %d host-network pods (never injected).\n\n",
		c.Injected, c.PodNetwork, 100*c.Fraction(), c.HostNetwork)
	b.WriteString(upstream.Table(rows))
	if err := os.WriteFile(filepath.Join(dir, "report.md"), []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("report %s:\n%s", filepath.Join(dir, "report.md"), b.String())
	for _, r := range rows {
		if r.Regression() {
			t.Errorf("passes without detour, %s with it: %s: %s", r.With.Status, r.Name, r.With.Message)
		}
	}
	if c.PodNetwork == 0 || c.Fraction() < 0.95 {
		t.Errorf("%d of %d pod-network pods of the tests were injected, want at least 95%%; not injected: %s", c.Injected, c.PodNetwork, strings.Join(c.Missed, ", "))
	}
}

// families names the IP families of e's cluster.
func families(e *framework.Env) string {
	switch e.Node.Families() {
	case framework.DualStack:
		return "dual stack"
	case framework.IPv6Only:
		return "IPv6 only"
	default:
		return "IPv4"
	}
}
