package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/detourmesh/detour/test/e2e/framework"
	"github.com/detourmesh/detour/test/e2e/upstream"
)

// conformanceSmoke runs a few of Kubernetes' own conformance tests (upstream.Smoke) with
// detour injecting every pod they create (the mesh-wide story left defaultInject enabled):
// each must pass, and at least 95% of their pod-network pods must be injected, as the API
// server shows them. `make conformance` runs the whole selection, without detour and with it.
func conformanceSmoke(t *testing.T, ctx context.Context, e *framework.Env) {
	rec, err := upstream.Record(ctx, e.Node.Client)
	if err != nil {
		t.Fatal(err)
	}
	defer rec.Stop()
	dir := filepath.Join(e.Node.Dir, "conformance")
	start := time.Now()
	results, err := upstream.Run(ctx, e.Node.RunSplit, upstreamOptions(e, dir, "smoke-", upstream.Smoke, 20*time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range results {
		if r.Status != upstream.StatusPassed {
			t.Errorf("%s: %s with detour injecting every pod: %s", r.Name, r.Status, r.Message)
		}
	}
	c := upstream.Count(rec.Pods())
	t.Logf("%d conformance tests in %s; %d of %d pod-network pods injected, %d host-network pods", len(results), time.Since(start).Round(time.Second), c.Injected, c.PodNetwork, c.HostNetwork)
	if c.PodNetwork == 0 || c.Fraction() < 0.95 {
		t.Errorf("%d of %d pod-network pods of the tests were injected, want at least 95%%; not injected: %s", c.Injected, c.PodNetwork, strings.Join(c.Missed, ", "))
	}
	if t.Failed() {
		log, _ := os.ReadFile(filepath.Join(dir, "smoke-e2e.log"))
		t.Logf("e2e.test's log ends with:\n%s", framework.Tail(string(log), 80))
	}
}

// upstreamOptions are a run of e2e.test inside the control-plane node as admin.
func upstreamOptions(e *framework.Env, dir, prefix string, tests []string, timeout time.Duration) upstream.Options {
	return upstream.Options{
		Binary: e.Node.Bin("e2e.test"), Kubectl: e.Node.Bin("kubectl"), Kubeconfig: e.Node.Kubeconfig,
		ReportDir: dir, Prefix: prefix, Tests: tests, Nodes: len(e.Node.Nodes()), Timeout: timeout,
	}
}
