//go:build cluster

package e2e

import (
	"testing"
	"time"

	"github.com/detourmesh/detour/test/e2e/framework"
)

// TestE2ECluster runs every story of a cluster rather than a node (issue 22) on the bridge
// cluster: the cross-node story, the per-node scoping of the agent and repair, the primary
// rewriting its conflist on every node, a drain, seed 000's scale-out with node C, and B's
// removal. `make e2e-cluster` runs it (build tag cluster), with TestE2EFlannel; TestE2E, and so
// CI, runs only the cross-node story of them (clusterSmoke).
//
// Its cluster is its own, registered with detour's startup taint as the shared node is, and
// stopped when it ends: go test runs it before TestE2E starts the shared node (the order of
// their files), never beside it.
func TestE2ECluster(t *testing.T) {
	e := framework.OwnEnv(t, framework.Options{Taints: []string{framework.StartupTaint + ":NoSchedule"}})
	ctx, cancel := framework.Context(t, e.Node, 25*time.Minute)
	defer cancel()
	e.EnsureInstalled(t, ctx)
	onCluster(t, ctx, e, []clusterStory{
		{"cross-node", clusterCrossNode},
		{"per-node-scoping", clusterPerNodeScoping},
		{"primary-rewrites-on-every-node", clusterRewrites},
		{"drain", clusterDrain},
		{"seed000-scale-out", clusterScaleOut},
		{"removal", clusterRemoval}, // the last: B's Node object goes
	})
}
