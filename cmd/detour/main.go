// Command detour is detour's CLI and every long-running component (webhook, node agent,
// repair controller, validator) as a subcommand. See internal/cli.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/detourmesh/detour/internal/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := cli.NewRoot().ExecuteContext(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "detour:", err)
		os.Exit(cli.ExitCode(err))
	}
}
