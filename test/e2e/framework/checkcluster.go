package framework

import (
	"context"
	"encoding/json"
	"path/filepath"
	"strings"
	"testing"

	"github.com/detourmesh/detour/internal/clustercheck"
)

// CheckCluster runs `detour check --cluster -o json` inside the node's namespaces with the
// admin kubeconfig, as a cluster admin would, and returns its report and whether it exited
// non-zero.
func (e *Env) CheckCluster(t testing.TB, ctx context.Context) (clustercheck.Report, bool) {
	t.Helper()
	stdout, stderr, err := e.Node.RunSplit(ctx, nil, filepath.Join(e.Artifacts.dir, "detour"),
		"check", "--cluster", "--kubeconfig", e.Node.Kubeconfig, "-o", "json", "--since", "10m")
	var r clustercheck.Report
	if jerr := json.Unmarshal([]byte(stdout), &r); jerr != nil {
		t.Fatalf("detour check --cluster -o json: %v (%v)\nstdout:\n%s\nstderr:\n%s", jerr, err, stdout, stderr)
	}
	return r, err != nil
}

// WantCheck fails t unless check name ran with status and a message containing want.
func WantCheck(t testing.TB, r clustercheck.Report, name string, status clustercheck.Status, want string) {
	t.Helper()
	res, ok := r.Result(name)
	switch {
	case !ok:
		t.Errorf("detour check --cluster ran no check %s", name)
	case res.Status != status || !strings.Contains(res.Message, want):
		t.Errorf("check %s: %s %q, want %s with %q (fix: %s)", name, res.Status, res.Message, status, want, res.Fix)
	}
}
