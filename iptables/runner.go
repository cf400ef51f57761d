package iptables

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
)

// Runner runs a command and returns its standard output. The Executor runs every iptables tool
// through it, so tests can record or fake the calls.
type Runner interface {
	Run(ctx context.Context, name string, args []string, stdin []byte) ([]byte, error)
}

// ExecError is a command that failed: what ran, what it printed on standard error, and why.
type ExecError struct {
	Name   string
	Args   []string
	Stderr string
	Err    error
}

func (e *ExecError) Error() string {
	msg := fmt.Sprintf("%s %s: %v", e.Name, strings.Join(e.Args, " "), e.Err)
	if e.Stderr != "" {
		msg += ": " + e.Stderr
	}
	return msg
}

func (e *ExecError) Unwrap() error { return e.Err }

// IsLockTimeout reports whether err is an iptables tool that gave up waiting for the xtables
// lock ("Another app is currently holding the xtables lock"): another program on the node held
// it, and trying again later can succeed.
func IsLockTimeout(err error) bool {
	var e *ExecError
	return errors.As(err, &e) && strings.Contains(e.Stderr, "xtables lock")
}

// ExecRunner runs commands as child processes of the calling thread, so they inherit its
// network namespace.
type ExecRunner struct{}

// Run implements Runner.
func (ExecRunner) Run(ctx context.Context, name string, args []string, stdin []byte) ([]byte, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.Bytes(), &ExecError{Name: name, Args: args, Stderr: strings.TrimSpace(stderr.String()), Err: err}
	}
	return stdout.Bytes(), nil
}
