package framework

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
)

// WaitFor polls cond until it holds ([Poll]); when it does not within timeout, or ctx ends,
// the test fails naming what it waited for and what cond saw last ([Seen]).
func WaitFor(t testing.TB, ctx context.Context, what string, timeout time.Duration, cond func() (bool, error)) {
	t.Helper()
	if err := Poll(ctx, timeout, cond); err != nil {
		t.Fatalf("waiting for %s: %v", what, err)
	}
}

// progress is what a condition saw while it does not hold yet (see [Seen]).
type progress struct{ msg string }

func (p progress) Error() string { return p.msg }

// Seen describes what a condition saw, for the message of a wait that times out: a condition
// returns (done, Seen(...)). Unlike its other errors, which make [Poll] retry, it does not stop
// a condition that holds from ending the wait.
func Seen(format string, args ...any) error { return progress{fmt.Sprintf(format, args...)} }

// Poll runs cond every 250 ms until it holds, timeout passes or ctx ends (the test's deadline,
// or a node component that died: see [Node.Watch]). cond's errors are retried; the last one, or
// the last thing cond said it saw, is part of the error.
func Poll(ctx context.Context, timeout time.Duration, cond func() (bool, error)) error {
	var last error
	start := time.Now()
	err := wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, timeout, true, func(context.Context) (bool, error) {
		ok, err := cond()
		var p progress
		if errors.As(err, &p) {
			last = err
			return ok, nil
		}
		if err != nil {
			last = err
			return false, nil
		}
		return ok, nil
	})
	if err == nil {
		return nil
	}
	msg := fmt.Sprintf("not within %s", timeout)
	if ctx.Err() != nil {
		msg = fmt.Sprintf("gave up after %s: %v", time.Since(start).Round(time.Second), context.Cause(ctx))
	}
	if last != nil {
		msg += "; last seen: " + last.Error()
	}
	return errors.New(msg)
}

// Context returns the context a long test runs in: want from now, but ending [cleanupMargin]
// before go test's -timeout would (a test that reaches go test's timeout ends in a goroutine
// dump, not with what it waited for), and watching node n, if any (see [Node.Watch]).
func Context(t testing.TB, n *Node, want time.Duration) (context.Context, context.CancelFunc) {
	deadline := time.Now().Add(want)
	cause := fmt.Errorf("the test's own limit of %s passed", want)
	if d, ok := t.(interface{ Deadline() (time.Time, bool) }); ok {
		if gotest, ok := d.Deadline(); ok && gotest.Add(-cleanupMargin).Before(deadline) {
			deadline = gotest.Add(-cleanupMargin)
			cause = fmt.Errorf("go test's -timeout ends at %s; the test stops %s before, to clean up and report", gotest.Format(time.TimeOnly), cleanupMargin)
		}
	}
	ctx, cancelDeadline := context.WithDeadlineCause(context.Background(), deadline, cause)
	if n == nil {
		return ctx, cancelDeadline
	}
	ctx, cancelWatch := n.Watch(ctx)
	return ctx, func() { cancelWatch(); cancelDeadline() }
}

// cleanupMargin is the time a test keeps, before go test's -timeout, to report and to stop the node.
const cleanupMargin = 3 * time.Minute
