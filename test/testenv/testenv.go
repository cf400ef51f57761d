// Package testenv is the real environment detour's integration tests run in: network namespaces
// joined by veth pairs, processes and connections under chosen UIDs and GIDs, listeners that
// report the original destination of redirected connections, and a local kube-apiserver + etcd
// built by hack/test-binaries.sh.
//
// Everything is entered from Go (no ip netns exec, no nsenter) and removed by t.Cleanup, also
// when a test fails. Privileged tests call [Privileged] or [ControlPlane], which skip with a
// reason when root, iptables or the binaries are missing — or fail, when
// DETOUR_REQUIRE_PRIVILEGED=1 (set by CI) makes them required.
package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/detourmesh/detour/internal/controlplane"
)

// RequireEnv is the environment variable that turns a would-be skip into a failure.
const RequireEnv = "DETOUR_REQUIRE_PRIVILEGED"

// Main runs the package's tests; call it from TestMain. It also serves the helper processes
// the package's tests start (see [Dial]) and stops the shared control plane afterwards.
func Main(m *testing.M) {
	if helper := os.Getenv(helperEnv); helper != "" {
		os.Exit(runHelper(helper))
	}
	code := m.Run()
	stopControlPlane()
	removeNamespaceDir()
	if built.dir != "" {
		os.RemoveAll(built.dir)
	}
	os.Exit(code)
}

// Required reports whether privileged tests must run here (CI).
func Required() bool { return os.Getenv(RequireEnv) == "1" }

// Unavailable skips the test with reason, or fails it when privileged tests are required.
func Unavailable(t testing.TB, reason string) {
	t.Helper()
	if Required() {
		t.Fatalf("privileged test cannot run: %s (%s=1 makes this a failure)", reason, RequireEnv)
	}
	t.Skipf("skipping privileged test: %s", reason)
}

// Privileged checks that the test can create network namespaces and run both iptables
// backends for both families: it must be root and find the tools on PATH.
func Privileged(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		Unavailable(t, "needs root to create network namespaces and run iptables")
		return
	}
	for _, tool := range []string{"iptables-legacy-restore", "iptables-nft-restore", "ip6tables-legacy-restore", "ip6tables-nft-restore"} {
		if _, err := exec.LookPath(tool); err != nil {
			Unavailable(t, fmt.Sprintf("%s is not on PATH (run hack/host-deps.sh as root, or make test)", tool))
			return
		}
	}
}

// BinDir is the directory of the binaries hack/test-binaries.sh built (see controlplane.BinDir).
func BinDir() string { return controlplane.BinDir() }

// Binary returns the path of a binary from [BinDir], skipping (or failing) the test when it
// has not been built.
func Binary(t testing.TB, name string) string {
	t.Helper()
	p := filepath.Join(BinDir(), name)
	if _, err := os.Stat(p); err != nil {
		Unavailable(t, fmt.Sprintf("%s is not built (run hack/test-binaries.sh, or make test)", p))
	}
	return p
}
