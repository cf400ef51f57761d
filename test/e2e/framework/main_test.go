package framework

import (
	"os"
	"testing"
)

// TestMain makes the test binary a node's namespace holder when TestIntegrationHolder starts it
// as one (see [ServeHolder]).
func TestMain(m *testing.M) {
	ServeHolder()
	os.Exit(m.Run())
}
