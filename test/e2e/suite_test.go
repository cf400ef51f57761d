package e2e

import (
	"os"
	"testing"

	"github.com/detourmesh/detour/test/e2e/framework"
)

// The e2e suite shares one node between its stories, in the order a cluster lives them: a new
// node joins tainted, detour is installed, workloads run, the node breaks and is repaired,
// detour is uninstalled and installed again from install.yaml. TestMain stops the node.

func TestMain(m *testing.M) { os.Exit(framework.Run(m)) }
