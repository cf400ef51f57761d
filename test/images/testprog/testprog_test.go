package testprog

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/detourmesh/detour/inject"
)

// syncBuffer is a bytes.Buffer that a program writes to while the test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// waitFor returns the first submatch of re in out once it appears.
func waitFor(t *testing.T, out *syncBuffer, re string) string {
	t.Helper()
	r := regexp.MustCompile(re)
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if m := r.FindStringSubmatch(out.String()); m != nil {
			return m[1]
		}
	}
	t.Fatalf("no %q in output:\n%s", re, out.String())
	return ""
}

// startWorkload runs the workload with args until the test ends; it returns its output and
// its result.
func startWorkload(t *testing.T, args ...string) (*syncBuffer, <-chan error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	out := &syncBuffer{}
	done := make(chan error, 1)
	go func() { done <- Workload(ctx, args, out) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Errorf("workload %q did not stop", args)
		}
	})
	return out, done
}

func TestWorkloadServeDial(t *testing.T) {
	srv, _ := startWorkload(t, "serve", "-listen", "127.0.0.1:0", "-name", "server")
	addr := waitFor(t, srv, `serve server listening on (\S+)`)

	var out bytes.Buffer
	if err := Workload(context.Background(), []string{"dial", "-addr", addr, "-must", Then, "id"}, &out); err != nil {
		t.Fatal(err)
	}
	want := regexp.MustCompile(`^dial ` + regexp.QuoteMeta(addr) + ` ok: server ` + regexp.QuoteMeta(Identity()) +
		` peer=127\.0\.0\.1:\d+ local=` + regexp.QuoteMeta(addr) + "\n" + regexp.QuoteMeta(Identity()) + "\n$")
	if !want.MatchString(out.String()) {
		t.Errorf("output\n%s\nwant %s", out.String(), want)
	}
	if !regexp.MustCompile(`^uid=\d+ gid=\d+ groups=[0-9,]*$`).MatchString(Identity()) {
		t.Errorf("Identity() = %q", Identity())
	}
}

func TestWorkloadLoad(t *testing.T) {
	srv, _ := startWorkload(t, "serve", "-listen", "127.0.0.1:0", "-name", "sink", "-sink")
	addr := waitFor(t, srv, `serve sink listening on (\S+)`)
	var out bytes.Buffer
	if err := Workload(context.Background(), []string{"load", "-addr", addr, "-conns", "20", "-bytes", "3000000"}, &out); err != nil {
		t.Fatal(err)
	}
	want := regexp.MustCompile(`^load ` + regexp.QuoteMeta(addr) + ` conns=20 p50=\S+ p99=\S+ bytes=3000000 seconds=[0-9.]+ MiB/s=[0-9.]+\n$`)
	if !want.MatchString(out.String()) {
		t.Errorf("output %q, want %s", out.String(), want)
	}

	// With -rate and -samples: connections per second for each number of clients, and every
	// timed connection's nanoseconds.
	samples := filepath.Join(t.TempDir(), "samples")
	out.Reset()
	if err := Workload(context.Background(), []string{"load", "-addr", addr, "-conns", "7", "-bytes", "0", "-rate", "1,4", "-rate-for", "200ms", "-samples", samples}, &out); err != nil {
		t.Fatal(err)
	}
	want = regexp.MustCompile(`^load ` + regexp.QuoteMeta(addr) + ` conns=7 p50=\S+ p99=\S+ cps@1=[1-9]\d* cps@4=[1-9]\d* bytes=0\n$`)
	if !want.MatchString(out.String()) {
		t.Errorf("output %q, want %s", out.String(), want)
	}
	if b, err := os.ReadFile(samples); err != nil || len(strings.Fields(string(b))) != 7 {
		t.Errorf("samples %q, %v: want 7 lines", b, err)
	}
	if err := Workload(context.Background(), []string{"load", "-addr", addr, "-rate", "0"}, io.Discard); err == nil || !strings.Contains(err.Error(), "-rate") {
		t.Errorf("-rate 0: %v", err)
	}

	// Against a plain serve (no count) it fails, naming the cause.
	plain, _ := startWorkload(t, "serve", "-listen", "127.0.0.1:0", "-name", "plain")
	plainAddr := waitFor(t, plain, `serve plain listening on (\S+)`)
	err := Workload(context.Background(), []string{"load", "-addr", plainAddr, "-conns", "1", "-bytes", "10"}, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "is it a serve -sink?") {
		t.Errorf("load against a plain serve: %v", err)
	}
}

func TestWorkloadServeNameFromHostname(t *testing.T) {
	t.Setenv("HOSTNAME", "pod-a")
	srv, _ := startWorkload(t, "serve", "-listen", "127.0.0.1:0")
	addr := waitFor(t, srv, `serve pod-a listening on (\S+)`)
	var out bytes.Buffer
	if err := Workload(context.Background(), []string{"dial", "-addr", addr}, &out); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(out.String(), "dial "+addr+" ok: pod-a uid=") {
		t.Errorf("output %q", out.String())
	}
}

// freeAddr returns a loopback address nothing listens on.
func freeAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

func TestWorkloadDialFailure(t *testing.T) {
	addr := freeAddr(t)
	var out bytes.Buffer
	// Without -must the chain goes on.
	if err := Workload(context.Background(), []string{"dial", "-addr", addr, Then, "id"}, &out); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(out.String(), "dial "+addr+" failed: ") || !strings.Contains(out.String(), "\nuid=") {
		t.Errorf("output %q", out.String())
	}
	// With -must it stops there, with an error (exit 1 in the program).
	out.Reset()
	err := Workload(context.Background(), []string{"dial", "-addr", addr, "-must", "-timeout", "1s", Then, "id"}, &out)
	if err == nil || strings.Contains(out.String(), "uid=") {
		t.Errorf("dial -must to nothing: %v, output %q", err, out.String())
	}
}

func TestWorkloadDialRetry(t *testing.T) {
	addr := freeAddr(t)
	go func() {
		time.Sleep(500 * time.Millisecond)
		ctx, cancel := context.WithCancel(context.Background())
		t.Cleanup(cancel)
		Workload(ctx, []string{"serve", "-listen", addr, "-name", "late"}, io.Discard)
	}()
	var out bytes.Buffer
	if err := Workload(context.Background(), []string{"dial", "-addr", addr, "-must", "-retry", "5s"}, &out); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(out.String(), "dial "+addr+" ok: late ") {
		t.Errorf("output %q", out.String())
	}
}

func TestWorkloadSleepStops(t *testing.T) {
	_, done := startWorkload(t, "sleep", Then, "id")
	select {
	case err := <-done:
		t.Fatalf("sleep without a duration returned %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	var out bytes.Buffer
	start := time.Now()
	if err := Workload(context.Background(), []string{"sleep", "100ms", Then, "id"}, &out); err != nil {
		t.Fatal(err)
	}
	if time.Since(start) < 100*time.Millisecond || !strings.HasPrefix(out.String(), "uid=") {
		t.Errorf("sleep 100ms then id: %v, %q", time.Since(start), out.String())
	}
}

func TestWorkloadUsageErrors(t *testing.T) {
	for _, args := range [][]string{
		nil,
		{"nope"},
		{"id", Then},
		{"dial"},
		{"dial", "-addr", "x:1", "extra"},
		{"sleep", "soon"},
		{"serve", "-bogus"},
		{"id", Then, "sleep", "-1s"},
		{"load"},
		{"load", "-addr", "x:1", "-conns", "0"},
		{"load", "-addr", "x:1", "-conns", "-3"},
	} {
		var out bytes.Buffer
		err := Workload(context.Background(), args, &out)
		if err == nil || !strings.Contains(err.Error(), "usage: workload") || out.Len() != 0 {
			t.Errorf("Workload(%q): %v, output %q; want a usage error before any step runs", args, err, out.String())
		}
	}
}

// The proxy's defaults are detour's: the webhook injects a proxy listening there.
func TestProxyDefaultPorts(t *testing.T) {
	for _, c := range []struct {
		addr string
		port int
	}{
		{DefaultOutbound, inject.DefaultProxyOutboundPort},
		{DefaultInbound, inject.DefaultProxyInboundPort},
		{DefaultAdmin, inject.DefaultProxyAdminPort},
	} {
		if c.addr != fmt.Sprintf(":%d", c.port) {
			t.Errorf("proxy default %s, webhook's port %d", c.addr, c.port)
		}
	}
}

// Without a redirect there is no original destination to go to: the proxy answers /ready,
// and refuses connections made to its ports directly instead of looping back to itself. The
// redirect path is TestIntegrationTestProxy in test/images.
func TestProxyReadyAndDirectConnections(t *testing.T) {
	out := &syncBuffer{}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Proxy{Outbound: "127.0.0.1:0", Inbound: "127.0.0.1:0", Admin: "127.0.0.1:0", Log: log.New(out, "", 0)}
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	outbound := waitFor(t, out, `proxy outbound listening on (\S+)`)
	inbound := waitFor(t, out, `proxy inbound listening on (\S+)`)
	admin := waitFor(t, out, `proxy admin listening on (\S+)`)

	resp, err := http.Get("http://" + admin + "/ready")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(body) != "ready" {
		t.Errorf("/ready: %d %q", resp.StatusCode, body)
	}

	for what, addr := range map[string]string{"outbound": outbound, "inbound": inbound} {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		if n, err := c.Read(make([]byte, 1)); n != 0 || err == nil {
			t.Errorf("%s: read %d bytes, %v; want the proxy to close", what, n, err)
		}
		c.Close()
		waitFor(t, out, `(proxy `+what+` 127\.0\.0\.1:\d+ -> \S+ failed: .*)`)
	}
	t.Logf("proxy log:\n%s", out)

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the proxy did not stop")
	}
}

// dial -every dials again at its interval until the context ends, a line per dial, and a
// failed dial does not end it.
func TestWorkloadDialEvery(t *testing.T) {
	t.Setenv("HOSTNAME", "pod-a")
	srv, _ := startWorkload(t, "serve", "-listen", "127.0.0.1:0")
	addr := waitFor(t, srv, `serve pod-a listening on (\S+)`)
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	var out bytes.Buffer
	if err := Workload(ctx, []string{"dial", "-addr", addr, "-every", "50ms"}, &out); err != nil {
		t.Fatal(err)
	}
	if ok := strings.Count(out.String(), "dial "+addr+" ok: pod-a uid="); ok < 3 || strings.Contains(out.String(), "failed") {
		t.Errorf("%d dials ok in 500ms at 50ms, want several and no failure; output %q", ok, out.String())
	}

	gone := freeAddr(t)
	ctx, cancel = context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	out.Reset()
	if err := Workload(ctx, []string{"dial", "-addr", gone, "-every", "50ms", "-timeout", "100ms"}, &out); err != nil {
		t.Fatal(err)
	}
	if failed := strings.Count(out.String(), "dial "+gone+" failed: "); failed < 2 {
		t.Errorf("%d failed dials to nothing, want a line for each; output %q", failed, out.String())
	}
}
