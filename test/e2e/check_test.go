package e2e

import (
	"context"
	"testing"

	"github.com/detourmesh/detour/internal/clustercheck"
	"github.com/detourmesh/detour/test/e2e/framework"
)

// checkClusterHealthy: on the node as the stories before it (TestE2E) left it — detour
// installed, the agent ready, pods injected — `detour check --cluster` exits 0, and the checks
// that need the real cluster pass: the certificate the webhook serves (seen through a
// port-forward by the kubelet), a dry-run admission through the real webhook, the agent, taint
// and label.
func checkClusterHealthy(t *testing.T, ctx context.Context, e *framework.Env) {
	report, failed := e.CheckCluster(t, ctx)
	if failed {
		t.Errorf("detour check --cluster failed on a healthy node: %+v", report.Results)
	}
	for _, name := range []string{"webhook-config", "webhook-endpoints", "webhook-certificate", "webhook-admission",
		"webhook-deployment", "node-agent", "startup-taint", "ready-label", "validator"} {
		framework.WantCheck(t, report, name, clustercheck.OK, "")
	}
}
