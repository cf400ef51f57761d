package cniplugin_test

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/test/testenv"
)

// Issue 33: with detour.dev/redirect-inbound: listening, an inbound connection goes to the proxy
// only where a socket of the pod listens on its destination, so a client meets what the app
// does — on every backend and family, through libcni after the bridge plugin:
//   - a port the app listens on (the wildcard address, or the pod's own) reaches the proxy,
//     which sees the original destination; so does one held by SO_REUSEPORT listeners;
//   - a port nothing listens on is refused, as without a mesh, and redirected from the moment
//     the app listens there;
//   - a port the app binds on loopback only is refused from outside;
//   - a skipped port reaches its listener untouched, and the proxy's inbound port is not looped.
func TestIntegrationInboundOnlyWhereTheAppListens(t *testing.T) {
	listening := redirect
	listening.InboundListening = true
	for _, backend := range []iptables.Backend{iptables.BackendLegacy, iptables.BackendNFT, iptables.BackendNFTables} {
		t.Run(string(backend), func(t *testing.T) {
			f := newFixture(t, true) // dual-stack
			pod := f.createPod("web", listening.Annotations())
			podSandbox := f.sandbox(pod, true)
			res := f.add(f.list(map[string]any{"iptablesBackend": string(backend)}), podSandbox)
			remote := testenv.NewNetNS(t)
			f.add(f.primaryOnly(), testenv.PodAttachment(remote, f.namespace, "remote", "", map[string]string{}))
			for _, v6 := range []bool{false, true} {
				network, any, loopback := "tcp4", "0.0.0.0", "127.0.0.1"
				if v6 {
					network, any, loopback = "tcp6", "::", "::1"
				}
				podIP := addrOf(t, res, v6)
				on := func(host string, port uint16) string {
					return netip.AddrPortFrom(netip.MustParseAddr(host), port).String()
				}
				testenv.Serve(t, podSandbox.NetNS, "inbound", network, on(any, 4143))
				testenv.Serve(t, podSandbox.NetNS, "admin", network, on(any, 4191))
				testenv.Serve(t, podSandbox.NetNS, "app", network, on(any, 8080))
				testenv.Serve(t, podSandbox.NetNS, "app-local", network, on(loopback, 8082))
				testenv.Serve(t, podSandbox.NetNS, "app-pinned", network, netip.AddrPortFrom(podIP, 8083).String())
				serveReusePort(t, podSandbox.NetNS, network, on(any, 8084), 2)

				at := func(port uint16) netip.AddrPort { return netip.AddrPortFrom(podIP, port) }
				for _, port := range []uint16{8080, 8083, 8084, 4143} {
					expect(t, remote, testenv.Identity{}, at(port), "inbound "+at(port).String())
				}
				expect(t, remote, testenv.Identity{}, at(4191), "admin "+at(4191).String())
				for _, port := range []uint16{8081, 8082} {
					if got, err := testenv.Dial(t, remote, testenv.Identity{}, at(port)); err == nil || !strings.Contains(err.Error(), "refused") {
						t.Errorf("%s: dial %s = %q, %v; want refused, as without a mesh", backend, at(port), got, err)
					}
				}
				// The app's loopback listener still serves the app's own process.
				expect(t, podSandbox.NetNS, app, netip.AddrPortFrom(netip.MustParseAddr(loopback), 8082), "app-local "+on(loopback, 8082))
				// A port the app starts listening on later is redirected from then on.
				testenv.Serve(t, podSandbox.NetNS, "app-late", network, on(any, 8081))
				expect(t, remote, testenv.Identity{}, at(8081), "inbound "+at(8081).String())
			}
			if err := f.cni.Config.CheckNetworkList(context.Background(), f.list(map[string]any{"iptablesBackend": string(backend)}), podSandbox.Runtime); err != nil {
				t.Errorf("CHECK after ADD: %v", err)
			}
		})
	}
}

// serveReusePort starts n listeners on addr in ns with SO_REUSEPORT, each answering as
// "reuseport" with the address it was reached at.
func serveReusePort(t *testing.T, ns *testenv.NetNS, network, addr string, n int) {
	t.Helper()
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1) }); err != nil {
			return err
		}
		return serr
	}}
	for range n {
		var ln net.Listener
		if err := ns.Do(func() (err error) { ln, err = lc.Listen(context.Background(), network, addr); return err }); err != nil {
			t.Fatalf("listen with SO_REUSEPORT on %s: %v", addr, err)
		}
		t.Cleanup(func() { ln.Close() })
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				fmt.Fprintf(c, "reuseport %s\n", c.LocalAddr())
				c.Close()
			}
		}()
	}
}

// A pod injected before detour wrote detour.dev/redirect-inbound, or one that asks for all
// (detour.dev/inbound-capture: all, a proxy that serves ports itself), has every inbound
// connection redirected, as before.
func TestIntegrationInboundAll(t *testing.T) {
	before := redirect.Annotations()
	delete(before, annotations.RedirectInbound)
	for name, ann := range map[string]map[string]string{"injected before the key": before, "all": redirect.Annotations()} {
		t.Run(name, func(t *testing.T) {
			f := newFixture(t, false)
			pod := f.createPod("web", ann)
			podSandbox := f.sandbox(pod, true)
			res := f.add(f.list(map[string]any{"iptablesBackend": "nftables"}), podSandbox)
			remote := testenv.NewNetNS(t)
			f.add(f.primaryOnly(), testenv.PodAttachment(remote, f.namespace, "remote", "", map[string]string{}))
			testenv.Serve(t, podSandbox.NetNS, "inbound", "tcp4", "0.0.0.0:4143")
			dst := netip.AddrPortFrom(addrOf(t, res, false), 8081) // nothing listens there
			expect(t, remote, testenv.Identity{}, dst, "inbound "+dst.String())
		})
	}
}
