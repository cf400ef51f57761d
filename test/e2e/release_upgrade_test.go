//go:build upgrade

package e2e

import (
	"testing"
	"time"

	"github.com/detourmesh/detour/test/e2e/framework"
)

// TestE2EUpgrade is the upgrade story in full (issue 34; `make e2e-upgrade`, build tag
// upgrade): on a node of its own, registered with detour's startup taint, the previous release
// (hack/previous-release) is installed from its own chart and image, then, with meshed pods
// serving and an injected pod created every second throughout, upgraded in place to the
// working tree with the chart's defaults (failurePolicy Ignore), upgraded again with
// failurePolicy Fail, and rolled back to the previous release with `helm rollback`; each step
// is followed by 30 s of pods and the checks. TestE2E runs its first step alone
// (upgrade/from-the-previous-release), and so CI does.
//
// Its node is its own: go test runs it before TestE2E starts the shared node (the order of
// their files), never beside it.
func TestE2EUpgrade(t *testing.T) {
	e := framework.OwnEnv(t, framework.Options{Taints: []string{framework.StartupTaint + ":NoSchedule"}})
	ctx, cancel := framework.Context(t, e.Node, 30*time.Minute)
	defer cancel()
	runUpgrade(t, ctx, e, upgradePlan{first: installPreviousRelease(), dwell: 30 * time.Second, steps: []upgradeStep{
		upgradeToWorkingTree("Ignore"), upgradeToWorkingTree("Fail"), rollbackToPrevious(),
	}})
}
