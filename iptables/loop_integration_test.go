package iptables_test

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/detourmesh/detour/internal/origdst"
	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/test/testenv"
)

// maxForwarded caps the forwarder's accepts: a loop reaches it at once.
const maxForwarded = 40

// forwarder is a transparent proxy as a mesh's is, run as the proxy's UID in the pod's
// namespace (a child process, so that its own connections are the proxy UID's): it listens on
// the outbound port, and for each connection dials its original destination (SO_ORIGINAL_DST)
// and keeps both open. It prints "listening", then after args[2] (a duration) the number of
// connections it accepted, at most maxForwarded.
func forwarder(args []string) int {
	network, addr := args[0], args[1]
	d, err := time.ParseDuration(args[2])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	ln, err := net.Listen(network, addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println("listening")
	var accepts atomic.Int64
	go func() {
		for accepts.Load() < maxForwarded {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepts.Add(1)
			go func() {
				dst, err := origdst.Get(c.(*net.TCPConn))
				if err != nil {
					c.Close()
					return
				}
				up, err := net.DialTimeout(network, dst.String(), 2*time.Second)
				if err != nil {
					c.Close()
					return
				}
				_ = up // held open with c, as a proxy holds both ends of what it forwards
			}()
		}
	}()
	time.Sleep(d)
	fmt.Println("accepts", accepts.Load())
	return 0
}

// A connection from the app to a validator sentinel reaches the proxy's outbound listener like
// any other; the proxy then dials the sentinel as its own UID. That connection must not come
// back to the proxy (issue 32, item 1): with detour.dev/validator-check-port it goes to the
// check port, where nothing listens outside a check, and is refused at once — one app
// connection, one accept, on every backend and family. The same pod's rules from before the
// check port (the rules detour installs for a pod injected then) show the loop this closes.
func TestIntegrationSentinelDoesNotLoopThroughTheProxy(t *testing.T) {
	testenv.Privileged(t)
	ctx := context.Background()
	for _, backend := range []iptables.Backend{iptables.BackendLegacy, iptables.BackendNFT, iptables.BackendNFTables} {
		for _, family := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
			t.Run(string(backend)+"-"+family.String(), func(t *testing.T) {
				for _, tc := range []struct {
					name      string
					checkPort uint16
					loops     bool
				}{
					{"with the check port", 4142, false},
					{"a pod from before the check port", 0, true},
				} {
					accepts := sentinelAccepts(t, ctx, backend, family, tc.checkPort)
					switch {
					case !tc.loops && accepts != 1:
						t.Errorf("%s: one app connection to the sentinel made the proxy accept %d connections, want 1", tc.name, accepts)
					case tc.loops && accepts < 2:
						t.Errorf("%s: one app connection made the proxy accept %d connections; the test no longer shows the loop the check port closes", tc.name, accepts)
					}
					t.Logf("%s: %d accepts", tc.name, accepts)
				}
			})
		}
	}
}

// sentinelAccepts installs the pod's rules with checkPort on backend, starts the forwarder on
// the outbound port as the proxy's UID, dials the sentinel once as the app, and returns how
// many connections the forwarder accepted.
func sentinelAccepts(t *testing.T, ctx context.Context, backend iptables.Backend, family iptables.Family, checkPort uint16) int {
	t.Helper()
	pod, remote := testenv.NewNetNS(t), testenv.NewNetNS(t)
	podIP, remoteIP, bits, network, listen := "10.78.0.2", "10.78.0.1", 24, "tcp4", "0.0.0.0:4140"
	sentinel, routed := netip.MustParseAddrPort("203.0.113.254:80"), netip.MustParsePrefix("203.0.113.0/24")
	if family == iptables.IPv6 {
		podIP, remoteIP, bits, network, listen = "fd78::2", "fd78::1", 64, "tcp6", "[::]:4140"
		sentinel, routed = netip.MustParseAddrPort("[2001:db8::fe]:80"), netip.MustParsePrefix("2001:db8::/32")
	}
	testenv.Link(t, pod, "eth0", []netip.Prefix{netip.PrefixFrom(netip.MustParseAddr(podIP), bits)},
		remote, "eth0", []netip.Prefix{netip.PrefixFrom(netip.MustParseAddr(remoteIP), bits)})
	testenv.AddRoute(t, pod, routed, netip.MustParseAddr(remoteIP))
	rs, err := iptables.Build(iptables.Config{
		Family: family, ProxyUID: proxy.UID, InboundPort: 4143, OutboundPort: 4140, CheckPort: checkPort,
		Sentinels: []netip.AddrPort{netip.MustParseAddrPort("203.0.113.254:80"), netip.MustParseAddrPort("[2001:db8::fe]:80")},
	})
	if err != nil {
		t.Fatal(err)
	}
	exec := iptables.NewExecutor(iptables.WithBackend(backend))
	if err := exec.Apply(ctx, pod.Path, rs); err != nil {
		t.Fatalf("apply: %v", err)
	}
	t.Cleanup(func() { exec.Remove(ctx, pod.Path, family) })

	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	cmd := testenv.ChildCommand(ctx, proxy, "forwarder", network, listen, "1500ms")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := pod.Do(cmd.Start); err != nil {
		t.Fatalf("start the forwarder: %v", err)
	}
	defer cmd.Wait()
	lines := bufio.NewScanner(out)
	if !lines.Scan() || lines.Text() != "listening" {
		t.Fatalf("the forwarder did not start: %q %s", lines.Text(), stderr.String())
	}
	// The app's connection is held by the proxy, which never answers: the dial ends at its
	// timeout, which is not what this test is about.
	_, _ = testenv.DialAs(pod, app, nil, sentinel, time.Second)
	for lines.Scan() {
		if n, ok := strings.CutPrefix(lines.Text(), "accepts "); ok {
			accepts, err := strconv.Atoi(n)
			if err != nil {
				t.Fatal(err)
			}
			return accepts
		}
	}
	t.Fatalf("the forwarder printed no count: %s", stderr.String())
	return 0
}
