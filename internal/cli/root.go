// Package cli holds detour's cobra commands; cmd/detour only wires them to the process. Each
// command parses its flags, builds the component from its package, and returns errors — only
// main exits.
package cli

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/detourmesh/detour/internal/version"
)

// NewRoot returns the detour command with every subcommand.
func NewRoot() *cobra.Command {
	root := &cobra.Command{
		Use:           "detour",
		Short:         "CNI-based traffic capture for service-mesh sidecars",
		Version:       version.Version,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(
		// Each component adds its command here.
		newValidateCommand(), newInstallCNICommand(), newRepairCommand(),
		newWebhookCommand(), newInjectCommand(), newRulesCommand(), newCheckCommand(), newWaitProxyCommand(),
		newVersionCommand(),
	)
	return root
}

// Main runs the detour command line args (without the program name) until it finishes or the
// process gets SIGINT or SIGTERM, prints an error to stderr, and returns the exit code. It is
// cmd/detour's main, and the tests' way to run the real command in a child process.
func Main(args []string) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	root := NewRoot()
	root.SetArgs(args)
	err := root.ExecuteContext(ctx)
	if err != nil {
		fmt.Fprintln(os.Stderr, "detour:", err)
	}
	return ExitCode(err)
}

// ExitError is an error that asks main for a specific exit code (the validator's documented
// codes, for instance).
type ExitError struct {
	Code int
	Err  error
}

func (e *ExitError) Error() string { return e.Err.Error() }
func (e *ExitError) Unwrap() error { return e.Err }

// ExitCode is the process exit code for err: 0 for nil, an ExitError's code, else 1.
func ExitCode(err error) int {
	if err == nil {
		return 0
	}
	if e, ok := errors.AsType[*ExitError](err); ok {
		return e.Code
	}
	return 1
}
