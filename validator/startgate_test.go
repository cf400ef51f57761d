package validator

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

func TestParseTarget(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Target
		err  string
	}{
		{in: "tcp://:4191", want: Target{Scheme: "tcp", Port: 4191}},
		{in: "http://:4191/ready", want: Target{Scheme: "http", Port: 4191, Path: "/ready"}},
		{in: "https://:15021/healthz/ready?full=1", want: Target{Scheme: "https", Port: 15021, Path: "/healthz/ready?full=1"}},
		{in: "http://:8080", want: Target{Scheme: "http", Port: 8080, Path: "/"}},
		{in: "tcp://10.0.0.1:4191", err: "no host"},
		{in: "tcp://:0", err: "from 1 to 65535"},
		{in: "tcp://:70000", err: "from 1 to 65535"},
		{in: "tcp://:4191/x", err: "a tcp probe has no path"},
		{in: "grpc://:4191", err: "the scheme must be tcp, http or https"},
		{in: "4191", err: "write it as tcp://:PORT"},
	} {
		got, err := ParseTarget(tc.in)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("ParseTarget(%q) error = %v, want one saying %q", tc.in, err, tc.err)
			}
			continue
		}
		if err != nil || got.Scheme != tc.want.Scheme || got.Port != tc.want.Port || got.Path != tc.want.Path {
			t.Errorf("ParseTarget(%q) = %+v, %v; want %+v", tc.in, got, err, tc.want)
			continue
		}
		if again, err := ParseTarget(got.String()); err != nil || again.String() != got.String() {
			t.Errorf("ParseTarget(%q).String() = %q does not parse back (%v)", tc.in, got.String(), err)
		}
	}
}

// loopback makes the waiter ask 127.0.0.1 only.
func loopback() ([]netip.Addr, error) { return []netip.Addr{netip.MustParseAddr("127.0.0.1")}, nil }

// freePort returns a loopback port nothing listens on.
func freePort(t *testing.T) uint16 {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return uint16(ln.Addr().(*net.TCPAddr).Port)
}

func TestWaitTCPReturnsOnceTheProxyListens(t *testing.T) {
	port := freePort(t)
	listening := make(chan time.Time, 1)
	go func() {
		time.Sleep(150 * time.Millisecond)
		ln, err := net.Listen("tcp", netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), port).String())
		if err != nil {
			t.Error(err)
			return
		}
		listening <- time.Now()
		t.Cleanup(func() { ln.Close() })
	}()
	w := NewWaiter(WaitConfig{Target: Target{Scheme: "tcp", Port: port}, Timeout: 10 * time.Second, AttemptTimeout: time.Second}, WithAddrs(loopback))
	res, err := w.Wait(context.Background())
	done := time.Now()
	if err != nil {
		t.Fatalf("Wait: %v", err)
	}
	at := <-listening
	// Its pauses are at most 25 ms (docs/benchmarks.md has the figure): a lag of a second would be
	// a wait that only a later attempt ends, whatever the machine's load.
	if lag := done.Sub(at); lag > time.Second {
		t.Errorf("Wait returned %s after the proxy listened; its pauses are at most 25 ms", lag)
	}
	if res.Attempts < 2 || res.Addr.Port() != port || !strings.Contains(res.String(), "answered after") {
		t.Errorf("result %+v (%s): want several attempts on port %d", res, res, port)
	}
}

func TestWaitHTTPNeedsASuccessfulAnswerWithTheHeaders(t *testing.T) {
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/ready" || r.Header.Get("X-Probe") != "start" {
			http.Error(w, "wrong request "+r.URL.String(), http.StatusNotFound)
			return
		}
		if calls.Add(1) < 3 {
			http.Error(w, "not yet", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	defer srv.Close()
	port := netip.MustParseAddrPort(srv.Listener.Addr().String()).Port()
	target := Target{Scheme: "http", Port: port, Path: "/ready", Header: http.Header{"X-Probe": {"start"}}}
	res, err := NewWaiter(WaitConfig{Target: target, Timeout: 10 * time.Second, AttemptTimeout: time.Second}, WithAddrs(loopback)).Wait(context.Background())
	if err != nil {
		t.Fatalf("Wait: %v", err)
	}
	if calls.Load() != 3 || res.Attempts != 3 {
		t.Errorf("the gate passed after %d GETs (%d attempts); want the third, the first answered 2xx", calls.Load(), res.Attempts)
	}
}

func TestWaitFailsWhenTheProxyNeverAnswers(t *testing.T) {
	port := freePort(t)
	// An attempt may take the whole wait: a refused connect returns at once, but on a loaded
	// machine not always within a shorter attempt bound, which then reads "i/o timeout".
	w := NewWaiter(WaitConfig{Target: Target{Scheme: "tcp", Port: port}, Timeout: 300 * time.Millisecond, AttemptTimeout: 300 * time.Millisecond}, WithAddrs(loopback))
	start := time.Now()
	_, err := w.Wait(context.Background())
	if err == nil {
		t.Fatal("Wait passed with nothing listening")
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("Wait took %s; its bound is 300ms", took)
	}
	for _, want := range []string{fmt.Sprintf("tcp://:%d", port), "127.0.0.1", "within 300ms", "refused", "its log says why", "starts it again"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}

	// An HTTP answer outside 200–399 does not pass either, and the error says what it was.
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "no", http.StatusInternalServerError)
	}))
	defer srv.Close()
	hp := netip.MustParseAddrPort(srv.Listener.Addr().String()).Port()
	_, err = NewWaiter(WaitConfig{Target: Target{Scheme: "http", Port: hp, Path: "/"}, Timeout: 200 * time.Millisecond, AttemptTimeout: 100 * time.Millisecond}, WithAddrs(loopback)).Wait(context.Background())
	if err == nil || !strings.Contains(err.Error(), "500") {
		t.Errorf("Wait against an HTTP 500: %v, want an error naming the status", err)
	}
}

func TestWaitStopsWhenCancelled(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(100*time.Millisecond, cancel)
	_, err := NewWaiter(WaitConfig{Target: Target{Scheme: "tcp", Port: freePort(t)}, Timeout: time.Minute, AttemptTimeout: time.Second}, WithAddrs(loopback)).Wait(ctx)
	if err == nil || !strings.Contains(err.Error(), "stopped waiting") {
		t.Errorf("Wait cancelled: %v", err)
	}
}

func TestPodAddrsPutsIPv4First(t *testing.T) {
	addrs, err := PodAddrs()
	if err != nil {
		t.Fatal(err)
	}
	if len(addrs) == 0 {
		t.Fatal("no address at all: want loopback at least")
	}
	seen6 := false
	for _, a := range addrs {
		if a.Is6() {
			seen6 = true
		} else if seen6 {
			t.Errorf("addresses %v: an IPv4 address after an IPv6 one", addrs)
		}
		if a.IsLinkLocalUnicast() {
			t.Errorf("addresses %v hold a link-local one, which the kubelet never probes", addrs)
		}
	}
}

// The hook joins the check's socket: a failed check ends the wait at once with its message, a
// passed one lets it go on to the proxy's port, and a wait that goes away first ends the check
// (its context's cause says so).
func TestWaitJoinsTheCheck(t *testing.T) {
	waiter := func(checkPort, port uint16) *Waiter {
		return NewWaiter(WaitConfig{Target: Target{Scheme: "tcp", Port: port}, Timeout: 20 * time.Second, AttemptTimeout: time.Second, CheckPort: checkPort}, WithAddrs(loopback))
	}
	t.Run("failed", func(t *testing.T) {
		g, _, err := ListenGate(context.Background(), 64101)
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			time.Sleep(200 * time.Millisecond)
			g.Verdict(&Error{Code: ExitNoRedirect, Msg: "no redirect in this pod's network namespace"}, time.Second)
		}()
		start := time.Now()
		_, err = waiter(64101, freePort(t)).Wait(context.Background())
		if err == nil || !strings.Contains(err.Error(), "failed (exit 42): no redirect in this pod's network namespace") || time.Since(start) > 5*time.Second {
			t.Errorf("Wait = %v after %s; want the check's failure at once", err, time.Since(start))
		}
	})
	t.Run("passed", func(t *testing.T) {
		g, _, err := ListenGate(context.Background(), 64102)
		if err != nil {
			t.Fatal(err)
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		go func() { time.Sleep(200 * time.Millisecond); g.Verdict(nil, 0) }()
		res, err := waiter(64102, uint16(ln.Addr().(*net.TCPAddr).Port)).Wait(context.Background())
		if err != nil || res.Unjoined != "" {
			t.Errorf("Wait = %+v, %v", res, err)
		}
	})
	t.Run("the wait goes away", func(t *testing.T) {
		g, checkCtx, err := ListenGate(context.Background(), 64103)
		if err != nil {
			t.Fatal(err)
		}
		defer g.Verdict(nil, 0)
		ctx, cancel := context.WithCancel(context.Background())
		time.AfterFunc(300*time.Millisecond, cancel)
		waiter(64103, freePort(t)).Wait(ctx)
		select {
		case <-checkCtx.Done():
			if err, ok := Aborted(checkCtx); !ok || Code(err) != ExitFailure || !strings.Contains(err.Error(), "ended before the check decided") {
				t.Errorf("Aborted = %v, %v", err, ok)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("the check went on after its hook went away")
		}
	})
	t.Run("no check to join", func(t *testing.T) {
		// The check passed and exec'd the proxy before the hook came: its socket is gone, and
		// the wait does not wait to join it.
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		port := uint16(ln.Addr().(*net.TCPAddr).Port)
		w := waiter(64104, port)
		w.joinWait = 5 * time.Second
		start := time.Now()
		if _, err := w.Wait(context.Background()); err != nil || time.Since(start) > time.Second {
			t.Errorf("Wait = %v after %s; want the listening proxy at once", err, time.Since(start))
		}
		// A proxy that listens late: the result says the check was not joined.
		late := freePort(t)
		time.AfterFunc(300*time.Millisecond, func() {
			if l, err := net.Listen("tcp", netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), late).String()); err == nil {
				t.Cleanup(func() { l.Close() })
			}
		})
		w = waiter(64104, late)
		w.joinWait = 50 * time.Millisecond
		res, err := w.Wait(context.Background())
		if err != nil || !strings.Contains(res.String(), "the check's socket was not joined") {
			t.Errorf("Wait = %s, %v; want success that says it joined nothing", res, err)
		}
	})
}

// A check that failed and told a hook waits for the kubelet to stop its container (SIGTERM)
// rather than exit by itself; one that told no hook does not wait; and SIGTERM during the check
// ends it, as the stop of a container whose pod is deleted.
func TestGateFailedCheckWaitsToBeStopped(t *testing.T) {
	failed := &Error{Code: ExitNoRedirect, Msg: "no redirect"}
	verdictReturns := func(g *GateServer, hookWait time.Duration) <-chan struct{} {
		done := make(chan struct{})
		go func() {
			if g.Verdict(failed, hookWait) {
				t.Error("Verdict says the container was not stopped in time")
			}
			close(done)
		}()
		return done
	}
	t.Run("told a hook", func(t *testing.T) {
		g, _, err := ListenGate(context.Background(), 64106)
		if err != nil {
			t.Fatal(err)
		}
		hook := joinGate(context.Background(), 64106, 5*time.Second)
		done := verdictReturns(g, 5*time.Second)
		if v := <-hook; v.err == nil || !strings.Contains(v.err.Error(), "no redirect") {
			t.Fatalf("the hook got %+v", v)
		}
		select {
		case <-done:
			t.Fatal("Verdict returned before the container was stopped")
		case <-time.After(300 * time.Millisecond):
		}
		syscall.Kill(os.Getpid(), syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(StopWait / 2):
			t.Fatal("Verdict did not return when the container was stopped")
		}
	})
	t.Run("told no hook", func(t *testing.T) {
		g, _, err := ListenGate(context.Background(), 64107)
		if err != nil {
			t.Fatal(err)
		}
		select {
		case <-verdictReturns(g, 50*time.Millisecond):
		case <-time.After(StopWait / 2):
			t.Fatal("Verdict waited for a stop although no hook was told")
		}
	})
	t.Run("stopped during the check", func(t *testing.T) {
		g, ctx, err := ListenGate(context.Background(), 64108)
		if err != nil {
			t.Fatal(err)
		}
		defer g.Verdict(nil, 0)
		syscall.Kill(os.Getpid(), syscall.SIGTERM)
		select {
		case <-ctx.Done():
			if err, ok := Aborted(ctx); !ok || Code(err) != ExitFailure || !strings.Contains(err.Error(), "stopped before the check decided") {
				t.Errorf("Aborted = %v, %v", err, ok)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("the check went on after SIGTERM")
		}
	})
}

// A hook that connects while the check passes gets "passed", never an end without a verdict
// (which fails the hook, and the kubelet would restart a proxy whose check passed).
func TestGateVerdictReachesEveryHookThatJoined(t *testing.T) {
	for round := 0; round < 20; round++ {
		g, _, err := ListenGate(context.Background(), 64105)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		var verdicts []<-chan gateVerdict
		for i := 0; i < 8; i++ {
			verdicts = append(verdicts, joinGate(ctx, 64105, 20*time.Millisecond))
		}
		time.Sleep(time.Duration(round%4) * time.Millisecond)
		g.Verdict(nil, 0)
		for _, ch := range verdicts {
			select {
			case v := <-ch:
				if v.err != nil {
					t.Fatalf("round %d: a hook got %v", round, v.err)
				}
			case <-time.After(5 * time.Second):
				t.Fatalf("round %d: a hook got no verdict", round)
			}
		}
		cancel()
	}
}
