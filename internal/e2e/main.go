package e2e

import (
	"os"
	"testing"
)

// Main runs the package's tests; call it from TestMain. When the process is a node's
// namespace holder (the test binary re-executed by [Start]) it serves as one instead.
func Main(m *testing.M) {
	if spec := os.Getenv(holderEnv); spec != "" {
		os.Exit(runHolder(spec))
	}
	os.Exit(m.Run())
}
