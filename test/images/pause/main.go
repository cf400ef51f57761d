// Command pause is PID 1 of the end-to-end tests' pod sandboxes (the image detour.test/pause:1,
// containerd's sandbox image on the test node): it holds the namespaces, reaps orphaned
// children and exits 0 on SIGTERM or SIGINT.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/detourmesh/detour/test/images/testprog"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if len(os.Args) > 1 {
		os.Stderr.WriteString("usage: pause (no arguments)\n")
		os.Exit(2)
	}
	testprog.Pause(ctx)
}
