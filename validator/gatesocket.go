package validator

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"
)

// The check at the proxy's start and its start gate's hook talk over an abstract unix socket of
// the pod's network namespace, named after the check port. The hook connects and waits for the
// check's verdict, a line: "passed", or "failed CODE MESSAGE". Two things follow:
//
//   - a hook that goes away before the verdict ends the check (exit 1): the kubelet that ran the
//     hook is gone (restarted, or the pod is being deleted), and would not run it again. Ended,
//     the proxy is started again — with the hook — by the next kubelet, which meanwhile holds
//     the pod's next containers on the proxy's startup probe;
//   - the hook reports a failed check's message, which the kubelet shows as the hook's error
//     (PostStartHookError), instead of dying with the check;
//   - a check that failed and told a hook does not exit by itself: it waits for the kubelet to
//     stop the container, which the kubelet does as soon as the hook has failed. A container
//     that ends on its own just then is, for some milliseconds, gone from containerd but still
//     "running" in its CRI status (containerd v2.4.2 deletes the task before it records the
//     exit, internal/cri/server/events.go:241 and :293, and a StopContainer in between returns
//     at once, container_stop.go:128–137); a relist then shows the kubelet a running proxy
//     without a startup probe, which it counts as started, and it starts the pod's next
//     container behind the failed check. Stopped by the kubelet, the container's exit is
//     recorded before StopContainer returns, so the kubelet's next look usually sees it exited;
//     on a loaded node it has not, which is why the startup probe stays beside the hook
//     (inject.hookGate).

// GateSocket is the abstract unix socket name of the check on checkPort.
func GateSocket(checkPort uint16) string { return fmt.Sprintf("@detour-check-%d", checkPort) }

// StopWait bounds how long a check that failed and told a hook waits for the kubelet to stop its
// container (it does so right after the hook returns). A kubelet that dies in between leaves the
// check to exit after it.
const StopWait = 5 * time.Second

// gateStopped is the cause of a check ended by SIGTERM or SIGINT.
var gateStopped = errors.New("the container was stopped before the check decided")

// gateAbort is the cause of a check ended by its hook's going away.
var gateAbort = errors.New("the start gate's postStart hook ended before the check decided (the kubelet that ran it stopped waiting: it restarted, or the pod is being deleted); ending the check, so that no container of the pod starts before a check has passed — the kubelet starts the proxy again")

// GateServer is the check's side: it accepts hooks and tells them the verdict.
type GateServer struct {
	ln     net.Listener
	cancel context.CancelCauseFunc
	// joined is closed when the first hook connects; accepted when the accept loop has ended.
	joined, accepted chan struct{}
	// stopped is done at the container's first SIGTERM or SIGINT; unwatch stops watching for
	// them (the verdict has been given).
	stopped <-chan struct{}
	unwatch func()
	mu      sync.Mutex
	conns   []net.Conn
	done    bool
}

// ListenGate opens the check's socket for checkPort; ctx is cancelled when a hook that connected
// goes away before [GateServer.Verdict], or when the container is stopped (SIGTERM, SIGINT),
// which the check takes itself until its verdict. An error (the name is taken) leaves the check
// without a hook to tell: it runs as before.
func ListenGate(ctx context.Context, checkPort uint16) (*GateServer, context.Context, error) {
	ln, err := net.Listen("unix", GateSocket(checkPort))
	if err != nil {
		return nil, ctx, fmt.Errorf("listen on the start gate's socket %s: %w", GateSocket(checkPort), err)
	}
	ctx, cancel := context.WithCancelCause(ctx)
	signals, stopSignals := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	stopCause := context.AfterFunc(signals, func() { cancel(gateStopped) })
	g := &GateServer{ln: ln, cancel: cancel, joined: make(chan struct{}), accepted: make(chan struct{}),
		stopped: signals.Done(), unwatch: func() { stopCause(); stopSignals() }}
	go g.accept()
	return g, ctx, nil
}

func (g *GateServer) accept() {
	defer close(g.accepted)
	for {
		c, err := g.ln.Accept()
		if err != nil {
			return
		}
		g.mu.Lock()
		if len(g.conns) == 0 {
			close(g.joined)
		}
		g.conns = append(g.conns, c)
		verdict := g.done
		g.mu.Unlock()
		if verdict {
			continue // Verdict tells it
		}
		go func() {
			// The hook never writes: a read returns only when it goes away.
			c.Read(make([]byte, 1))
			g.mu.Lock()
			early := !g.done
			g.mu.Unlock()
			if early {
				g.cancel(gateAbort)
			}
		}()
	}
}

// Verdict tells the hooks the check's outcome (err nil: passed) and closes the socket (nothing
// on a nil GateServer: no socket). After a failure it waits up to hookWait for a hook to join
// when none has — a check that finds no redirect may fail before the kubelet's exec of the hook
// has begun — gives the hooks up to a second to read the verdict, so that each reports the
// check's message before the check's exit ends them, and, when it told one, waits up to
// StopWait for the kubelet to stop the container (see the top of this file). It reports whether
// that wait ran out.
func (g *GateServer) Verdict(err error, hookWait time.Duration) (unstopped bool) {
	if g == nil {
		return false
	}
	defer g.unwatch()
	g.mu.Lock()
	g.done = true
	g.mu.Unlock()
	if err != nil {
		select {
		case <-g.joined:
		case <-time.After(hookWait):
		}
	}
	// Take the hooks whose connections wait in the listen queue (closing it would reset them),
	// then close it: every hook accepted is in conns and gets the verdict.
	g.ln.(*net.UnixListener).SetDeadline(time.Now().Add(5 * time.Millisecond))
	<-g.accepted
	g.ln.Close()
	g.mu.Lock()
	conns := g.conns
	g.mu.Unlock()
	line := "passed\n"
	if err != nil {
		line = fmt.Sprintf("failed %d %s\n", Code(err), strings.ReplaceAll(err.Error(), "\n", " "))
	}
	linger := time.Second
	told := 0
	for _, c := range conns {
		c.SetDeadline(time.Now().Add(linger))
		if _, werr := c.Write([]byte(line)); werr == nil {
			told++
		}
	}
	if err != nil {
		// Each hook closes its end once it has read the verdict.
		for _, c := range conns {
			c.Read(make([]byte, 1))
		}
	}
	for _, c := range conns {
		c.Close()
	}
	if err != nil && told > 0 {
		select {
		case <-g.stopped:
		case <-time.After(StopWait):
			return true
		}
	}
	return false
}

// Aborted reports whether ctx (from [ListenGate]) ended because the hook went away or the
// container was stopped, and the error to exit with then.
func Aborted(ctx context.Context) (error, bool) {
	for _, cause := range []error{gateAbort, gateStopped} {
		if errors.Is(context.Cause(ctx), cause) {
			return &Error{Code: ExitFailure, Msg: cause.Error()}, true
		}
	}
	return nil, false
}

// gateVerdict is what the hook learnt from the check: passed, the failure's message, or that
// it could not join it (unjoined).
type gateVerdict struct {
	passed   bool
	err      error
	unjoined error
}

// joinGate is the hook's side: in the background, it connects to the check's socket (retrying
// for up to wait: the check opens it as the container starts, usually before the hook runs) and
// sends the verdict on the channel it returns — or unjoined, when there is no socket to join: a
// check that decided before the hook came (it passed and exec'd the proxy, or failed and exits),
// or one that predates the socket; the hook then only waits for the proxy. The connection stays
// open until the verdict comes or ctx ends.
func joinGate(ctx context.Context, checkPort uint16, wait time.Duration) <-chan gateVerdict {
	ch := make(chan gateVerdict, 1)
	go func() {
		var c net.Conn
		var err error
		deadline := time.Now().Add(wait)
		for {
			var d net.Dialer
			c, err = d.DialContext(ctx, "unix", GateSocket(checkPort))
			if err == nil || time.Now().After(deadline) || ctx.Err() != nil {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		if err != nil {
			ch <- gateVerdict{unjoined: err}
			return
		}
		defer c.Close()
		stop := context.AfterFunc(ctx, func() { c.Close() })
		defer stop()
		line, err := bufio.NewReader(c).ReadString('\n')
		switch {
		case line == "" && errors.Is(err, syscall.ECONNRESET):
			// The check closed its socket with this connection still in its queue: it had
			// decided already, as when the socket is gone.
			ch <- gateVerdict{unjoined: err}
		case line == "passed\n":
			ch <- gateVerdict{passed: true}
		case strings.HasPrefix(line, "failed "):
			ch <- gateVerdict{err: fmt.Errorf("the redirect check at the proxy's start failed (exit %s", strings.Replace(strings.TrimSpace(strings.TrimPrefix(line, "failed ")), " ", "): ", 1))}
		case ctx.Err() == nil:
			ch <- gateVerdict{err: fmt.Errorf("the redirect check at the proxy's start ended without a verdict (%v): the proxy's container exited or was stopped; its log says why", err)}
		}
	}()
	return ch
}
