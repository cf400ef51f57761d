package testprog

import (
	"context"
	"os"
	"os/signal"

	"golang.org/x/sys/unix"
)

// Pause is PID 1 of a pod sandbox: it holds the sandbox's namespaces open, reaps the children
// it inherits (zombies reparented to it), and returns when ctx ends (SIGTERM or SIGINT in
// the program).
func Pause(ctx context.Context) {
	sigchld := make(chan os.Signal, 1)
	signal.Notify(sigchld, unix.SIGCHLD)
	defer signal.Stop(sigchld)
	reap()
	for {
		select {
		case <-ctx.Done():
			return
		case <-sigchld:
			reap()
		}
	}
}

// reap collects every child that has exited.
func reap() {
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil)
		if err == unix.EINTR {
			continue
		}
		if pid <= 0 || err != nil {
			return
		}
	}
}
