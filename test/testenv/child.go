package testenv

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/detourmesh/detour/internal/netlab"
)

// childEnv names the function a child process of the test binary runs (see [RunChild]).
const childEnv = "DETOUR_TESTENV_CHILD"

// MainWithChildren is [Main] for test packages that run their own code in child processes
// (a command's real entry point, with its real exit code, inside a test namespace and as a
// chosen identity). When the process is such a child (started by [ChildCommand], already as
// its identity) it runs the named function with the child's arguments and exits with its
// result; otherwise it runs the tests.
func MainWithChildren(m *testing.M, children map[string]func(args []string) int) {
	if name := os.Getenv(childEnv); name != "" {
		fn, ok := children[name]
		if !ok {
			fmt.Fprintf(os.Stderr, "testenv: unknown child %q\n", name)
			os.Exit(2)
		}
		os.Exit(fn(os.Args[1:]))
	}
	Main(m)
}

// ChildResult is how a child process ended.
type ChildResult struct {
	Stdout, Stderr string
	ExitCode       int
}

// RunChild runs the child function name (registered with [MainWithChildren]) with args in a
// child process of the test binary inside ns as id, and returns its output and exit code. ctx
// bounds it: a child still running when ctx ends is killed, and RunChild returns an error.
func RunChild(ctx context.Context, ns *NetNS, id Identity, name string, args ...string) (ChildResult, error) {
	var stdout, stderr bytes.Buffer
	cmd := ChildCommand(ctx, id, name, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	// The child inherits the namespace of the thread that starts it.
	if err := ns.Do(cmd.Start); err != nil {
		return ChildResult{}, fmt.Errorf("start child %s in %s: %w", name, ns.Name, err)
	}
	err := cmd.Wait()
	res := ChildResult{Stdout: stdout.String(), Stderr: strings.TrimSpace(stderr.String()), ExitCode: cmd.ProcessState.ExitCode()}
	if ctxErr := ctx.Err(); ctxErr != nil {
		return res, fmt.Errorf("child %s %s as %s in %s did not finish: %w", name, strings.Join(args, " "), id, ns.Name, ctxErr)
	}
	if err != nil {
		if _, ok := errors.AsType[*exec.ExitError](err); !ok {
			return res, fmt.Errorf("child %s in %s: %w", name, ns.Name, err)
		}
	}
	return res, nil
}

// ChildCommand returns the command that runs the child function name (registered with
// [MainWithChildren]) with args as id, in the namespace of the thread that starts it; ctx
// kills it. Tests that signal the child or read its output as it runs start it themselves.
// The child is this test binary re-executed through /proc/self/exe (netlab.Self), which id
// can execute even though go test's work directory, where the binary is, is closed to it.
func ChildCommand(ctx context.Context, id Identity, name string, args ...string) *exec.Cmd {
	cmd := id.Command(ctx, netlab.Self, args...)
	cmd.Env = append(os.Environ(), childEnv+"="+name)
	return cmd
}
