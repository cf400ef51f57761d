// Command preflight checks, before the long builds, that this machine can run the real node of
// the end-to-end tests (test/e2e/preflight): it prints one line per missing thing and
// exits 1, or exits 0 silently. hack/test.sh runs it when the e2e tests are required (CI).
package main

import (
	"fmt"
	"os"

	"github.com/detourmesh/detour/test/e2e/preflight"
)

func main() {
	if err := preflight.Err(preflight.Check(preflight.Options{RunDir: os.Getenv("DETOUR_E2E_DIR")})); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
