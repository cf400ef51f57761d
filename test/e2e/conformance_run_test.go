//go:build conformance

package e2e

import (
	"testing"
	"time"

	"github.com/detourmesh/detour/test/e2e/framework"
	"github.com/detourmesh/detour/test/e2e/upstream"
)

// TestConformance is `make conformance` (docs/conformance.md): Kubernetes' own network tests
// (upstream.Select of e2e.test's list: the [sig-network] conformance tests and the Services,
// DNS, endpoints, kube-proxy and connectivity tests that need no special cluster) on a
// cluster of two nodes, first without detour, then with detour injecting every pod of every
// namespace the tests create. It fails when a test that passed without detour fails with it
// and is not a listed exception, or when fewer than 95% of the tests' pod-network pods were
// injected (counted from the API). It writes the table of both runs to
// $DETOUR_CONFORMANCE_DIR/report.md (default bin/conformance/), with the JUnit reports and
// e2e.test's logs. DETOUR_CONFORMANCE_PROCS (default 3) is the parallel processes of each run.
//
// The nodes register without detour's startup taint: the first run has no node agent to
// remove it, and the e2e suite waits for nodes without taints.
func TestConformance(t *testing.T) {
	e := framework.SetUpWith(t, framework.Options{})
	ctx, cancel := framework.Context(t, e.Node, 4*time.Hour)
	defer cancel()
	e.JoinNode(t, ctx, "e2e-node-b", framework.Options{Images: e.Artifacts.Tarballs})

	tests := upstream.Select(listUpstreamTests(t, ctx, e))
	withAndWithout(t, ctx, e, reportDir(t, e, "DETOUR_CONFORMANCE_DIR", "conformance"), "Kubernetes' network tests with and without detour", tests)
}
