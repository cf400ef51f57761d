package iptables_test

import (
	"context"
	"net/netip"
	"regexp"
	"strings"
	"testing"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/test/testenv"
)

func TestMain(m *testing.M) {
	testenv.MainWithChildren(m, map[string]func([]string) int{"userns-dialer": usernsDialer, "forwarder": forwarder})
}

// Identities of the test pod.
var (
	proxy     = testenv.Identity{UID: 2102, GID: 2102}
	app       = testenv.Identity{UID: 3000, GID: 3000}
	exemptUID = testenv.Identity{UID: 1000, GID: 1000}
	exemptGID = testenv.Identity{UID: 0, GID: 2601} // root, running with a dedicated GID
	root      = testenv.Identity{}
)

// topology is a pod namespace joined by a veth to a "remote" namespace, with the proxy's
// listeners and an admin server in the pod and servers on the remote.
type topology struct {
	pod, remote *testenv.NetNS
	family      iptables.Family
	podIP       netip.Addr
	remoteIP    netip.Addr // redirected destination
	skippedIP   netip.Addr // a second remote address, in the skipped CIDR
}

func newTopology(t *testing.T, f iptables.Family) *topology {
	t.Helper()
	tp := &topology{pod: testenv.NewNetNS(t), remote: testenv.NewNetNS(t), family: f}
	network, any := "tcp4", "0.0.0.0"
	tp.podIP, tp.remoteIP, tp.skippedIP = netip.MustParseAddr("10.77.0.2"), netip.MustParseAddr("10.77.0.1"), netip.MustParseAddr("10.77.0.3")
	bits := 24
	if f == iptables.IPv6 {
		network, any = "tcp6", "::"
		tp.podIP, tp.remoteIP, tp.skippedIP = netip.MustParseAddr("fd77::2"), netip.MustParseAddr("fd77::1"), netip.MustParseAddr("fd77::3")
		bits = 64
	}
	testenv.Link(t, tp.pod, "eth0", []netip.Prefix{netip.PrefixFrom(tp.podIP, bits)},
		tp.remote, "eth0", []netip.Prefix{netip.PrefixFrom(tp.remoteIP, bits), netip.PrefixFrom(tp.skippedIP, bits)})

	at := func(port string) string {
		return netip.AddrPortFrom(netip.MustParseAddr(any), 0).Addr().String() + port
	}
	if f == iptables.IPv6 {
		at = func(port string) string { return "[::]" + port }
	}
	testenv.Serve(t, tp.pod, "outbound", network, at(":4140"))
	testenv.Serve(t, tp.pod, "inbound", network, at(":4143"))
	testenv.Serve(t, tp.pod, "admin", network, at(":4191"))
	testenv.Serve(t, tp.pod, "check", network, at(":4142"))
	testenv.Serve(t, tp.pod, "app", network, at(":8081"))
	testenv.Serve(t, tp.remote, "remote", network, at(":8080"))
	testenv.Serve(t, tp.remote, "remote", network, at(":25"))
	return tp
}

func (tp *topology) ruleset(t *testing.T) iptables.Ruleset {
	t.Helper()
	rs, err := iptables.Build(tp.config(t))
	if err != nil {
		t.Fatal(err)
	}
	return rs
}

// config is the test pod's redirect: the proxy, a skipped port and network, an exempt UID and
// GID, the proxy's admin ports.
func (tp *topology) config(t *testing.T) iptables.Config {
	t.Helper()
	skip := "10.77.0.3/32,fd77::3/128"
	cidrs, err := annotations.ParseCIDRs("test", skip)
	if err != nil {
		t.Fatal(err)
	}
	return iptables.Config{
		Family:            tp.family,
		ProxyUID:          proxy.UID,
		InboundPort:       4143,
		OutboundPort:      4140,
		CheckPort:         4142,
		SkipInboundPorts:  []annotations.PortRange{{First: 4190, Last: 4191}},
		SkipOutboundPorts: []annotations.PortRange{{First: 25, Last: 25}},
		SkipOutboundCIDRs: cidrs,
		ExemptUIDs:        []uint32{exemptUID.UID},
		ExemptGIDs:        []uint32{exemptGID.GID},
	}
}

// expect dials addr from ns as id and checks who answered (and the destination they report).
func expect(t *testing.T, ns *testenv.NetNS, id testenv.Identity, addr netip.AddrPort, want string) {
	t.Helper()
	got, err := testenv.Dial(t, ns, id, addr)
	if err != nil {
		t.Errorf("dial %s as %s: %v (want %q)", addr, id, err, want)
		return
	}
	if got != want {
		t.Errorf("dial %s as %s: answered %q, want %q", addr, id, got, want)
	}
}

// stable strips the comment and counter lines of iptables-save output, which change between runs.
func stable(save string) string {
	return regexp.MustCompile(`(?m)^#.*\n`).ReplaceAllString(save, "")
}

func TestIntegrationRedirect(t *testing.T) {
	testenv.Privileged(t)
	for _, backend := range []iptables.Backend{iptables.BackendLegacy, iptables.BackendNFT} {
		for _, family := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
			t.Run(string(backend)+"-"+family.String(), func(t *testing.T) {
				testRedirect(t, backend, family)
			})
		}
	}
}

func testRedirect(t *testing.T, backend iptables.Backend, family iptables.Family) {
	ctx := context.Background()
	tp := newTopology(t, family)
	exec := iptables.NewExecutor(iptables.WithBackend(backend))
	remote := netip.AddrPortFrom(tp.remoteIP, 8080)

	// Before: everyone reaches the remote directly.
	expect(t, tp.pod, app, remote, "remote "+remote.String())

	// A foreign rule detour must leave alone, so the table exists before and after.
	foreign := "*nat\n-A POSTROUTING -o eth0 -m comment --comment foreign -j RETURN\nCOMMIT\n"
	if err := tp.pod.Do(func() error {
		_, err := iptables.ExecRunner{}.Run(ctx, restoreTool(backend, family), []string{"--noflush"}, []byte(foreign))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	before, _, err := exec.Save(ctx, tp.pod.Path, family)
	if err != nil {
		t.Fatal(err)
	}

	rs := tp.ruleset(t)
	if err := exec.Apply(ctx, tp.pod.Path, rs); err != nil {
		t.Fatalf("apply: %v", err)
	}
	if err := exec.Check(ctx, tp.pod.Path, rs); err != nil {
		t.Fatalf("check right after apply: %v", err)
	}
	applied, used, err := exec.Save(ctx, tp.pod.Path, family)
	if err != nil || used != backend {
		t.Fatalf("save: backend %s, %v", used, err)
	}

	// Outbound: the app (and root) is captured; the proxy, the exempt UID and the exempt GID
	// (running as root), skipped ports and networks go out directly.
	expect(t, tp.pod, app, remote, "outbound "+remote.String())
	expect(t, tp.pod, root, remote, "outbound "+remote.String())
	expect(t, tp.pod, proxy, remote, "remote "+remote.String())
	expect(t, tp.pod, exemptUID, remote, "remote "+remote.String())
	expect(t, tp.pod, exemptGID, remote, "remote "+remote.String())
	smtp := netip.AddrPortFrom(tp.remoteIP, 25)
	expect(t, tp.pod, app, smtp, "remote "+smtp.String())
	skipped := netip.AddrPortFrom(tp.skippedIP, 8080)
	expect(t, tp.pod, app, skipped, "remote "+skipped.String())
	// Loopback stays inside the pod.
	local := netip.AddrPortFrom(loopback(family), 8081)
	expect(t, tp.pod, app, local, "app "+local.String())

	// Inbound: connections to pod ports land on the proxy's inbound listener, except the
	// skipped admin port.
	appPort := netip.AddrPortFrom(tp.podIP, 8081)
	expect(t, tp.remote, root, appPort, "inbound "+appPort.String())
	admin := netip.AddrPortFrom(tp.podIP, 4191)
	expect(t, tp.remote, root, admin, "admin "+admin.String())

	// Applying again changes nothing.
	if err := exec.Apply(ctx, tp.pod.Path, rs); err != nil {
		t.Fatalf("second apply: %v", err)
	}
	again, _, _ := exec.Save(ctx, tp.pod.Path, family)
	if stable(again) != stable(applied) {
		t.Errorf("applying twice changed the table:\n--- first\n%s--- second\n%s", stable(applied), stable(again))
	}
	for _, r := range append(rs.Hooks, rs.Rules...) {
		if n := strings.Count(again, r.String()+"\n"); n != 1 {
			t.Errorf("rule %q is in the table %d times", r, n)
		}
	}

	// Remove leaves the table as it was, and removing twice is fine.
	for range 2 {
		if err := exec.Remove(ctx, tp.pod.Path, family); err != nil {
			t.Fatalf("remove: %v", err)
		}
	}
	after, _, _ := exec.Save(ctx, tp.pod.Path, family)
	if stable(after) != stable(before) {
		t.Errorf("remove did not restore the table:\n--- before\n%s--- after\n%s", stable(before), stable(after))
	}
	if err := exec.Check(ctx, tp.pod.Path, rs); err == nil || !strings.Contains(err.Error(), "missing") {
		t.Errorf("check after remove = %v, want a missing rule", err)
	}
	expect(t, tp.pod, app, remote, "remote "+remote.String())
}

func loopback(f iptables.Family) netip.Addr {
	if f == iptables.IPv6 {
		return netip.IPv6Loopback()
	}
	return netip.MustParseAddr("127.0.0.1")
}

func restoreTool(b iptables.Backend, f iptables.Family) string {
	if f == iptables.IPv6 {
		return "ip6tables-" + string(b) + "-restore"
	}
	return "iptables-" + string(b) + "-restore"
}

// auto writes detour's own nftables table in a fresh namespace and beside iptables-nft rules of
// another tool, and keeps the iptables tools where the legacy nat table holds rules (they would
// run in no defined order with detour's at the same hook; an empty table does not count) or
// where detour's chains already are (a pod set up before the node moved to nftables, so they are
// replaced, never doubled).
func TestIntegrationAutoBackendChoice(t *testing.T) {
	testenv.Privileged(t)
	ctx := context.Background()
	rs, _ := iptables.Build(iptables.Config{Family: iptables.IPv4, ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140})
	foreign := "*nat\n-A OUTPUT -d 192.0.2.99/32 -m comment --comment foreign -j RETURN\nCOMMIT\n"
	for _, tc := range []struct {
		name     string
		setUp    func(t *testing.T, ns *testenv.NetNS)
		want     iptables.Backend
		excluded iptables.Backend // holds none of detour's rules after auto's Apply
	}{
		{"fresh namespace", func(*testing.T, *testenv.NetNS) {}, iptables.BackendNFTables, iptables.BackendNFT},
		{"iptables-nft rules of another tool", func(t *testing.T, ns *testenv.NetNS) {
			restoreIn(t, ns, iptables.BackendNFT, foreign)
		}, iptables.BackendNFTables, iptables.BackendNFT},
		{"an empty legacy nat table", func(t *testing.T, ns *testenv.NetNS) {
			restoreIn(t, ns, iptables.BackendLegacy, "*nat\nCOMMIT\n")
		}, iptables.BackendNFTables, iptables.BackendLegacy},
		{"legacy rules of another tool", func(t *testing.T, ns *testenv.NetNS) {
			restoreIn(t, ns, iptables.BackendLegacy, foreign)
		}, iptables.BackendLegacy, iptables.BackendNFTables},
		{"detour's rules written by iptables-nft", func(t *testing.T, ns *testenv.NetNS) {
			if err := iptables.NewExecutor(iptables.WithBackend(iptables.BackendNFT)).Apply(ctx, ns.Path, rs); err != nil {
				t.Fatal(err)
			}
		}, iptables.BackendNFT, iptables.BackendNFTables},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ns := testenv.NewNetNS(t)
			tc.setUp(t, ns)
			exec := iptables.NewExecutor()
			if err := exec.Apply(ctx, ns.Path, rs); err != nil {
				t.Fatal(err)
			}
			if _, used, err := exec.Save(ctx, ns.Path, iptables.IPv4); err != nil || used != tc.want {
				t.Fatalf("auto used %q (%v), want %q", used, err, tc.want)
			}
			if err := exec.Check(ctx, ns.Path, rs); err != nil {
				t.Fatalf("auto's check: %v", err)
			}
			if err := iptables.NewExecutor(iptables.WithBackend(tc.want)).Check(ctx, ns.Path, rs); err != nil {
				t.Fatalf("rules are not in the %s backend: %v", tc.want, err)
			}
			if err := iptables.NewExecutor(iptables.WithBackend(tc.excluded)).Check(ctx, ns.Path, rs); err == nil {
				t.Fatalf("detour's rules are in the %s backend too: a packet would be redirected twice", tc.excluded)
			}
		})
	}
}

// Remove cleans detour's rules of every kind, whatever the executor's backend: a pod set up
// with the iptables tools before its node moved to nftables (or back) is cleaned by the DEL of
// the new configuration. Other tools' rules stay.
func TestIntegrationRemoveCleansEveryBackend(t *testing.T) {
	testenv.Privileged(t)
	ctx := context.Background()
	rs, _ := iptables.Build(iptables.Config{Family: iptables.IPv4, ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140})
	foreign := "*nat\n-A OUTPUT -d 192.0.2.99/32 -m comment --comment foreign -j RETURN\nCOMMIT\n"
	all := []iptables.Backend{iptables.BackendLegacy, iptables.BackendNFT, iptables.BackendNFTables}
	for _, remover := range append([]iptables.Backend{iptables.BackendAuto}, all...) {
		t.Run(string(remover), func(t *testing.T) {
			ns := testenv.NewNetNS(t)
			restoreIn(t, ns, iptables.BackendLegacy, foreign)
			for _, b := range all {
				if err := iptables.NewExecutor(iptables.WithBackend(b)).Apply(ctx, ns.Path, rs); err != nil {
					t.Fatalf("apply with %s: %v", b, err)
				}
			}
			if err := iptables.NewExecutor(iptables.WithBackend(remover)).Remove(ctx, ns.Path, iptables.IPv4); err != nil {
				t.Fatal(err)
			}
			for _, b := range all {
				text, _, err := iptables.NewExecutor(iptables.WithBackend(b)).Save(ctx, ns.Path, iptables.IPv4)
				if err != nil {
					t.Fatalf("read %s: %v", b, err)
				}
				if strings.Contains(text, "DETOUR") || strings.Contains(text, "detour") {
					t.Errorf("%s still holds detour's rules after %s's Remove:\n%s", b, remover, text)
				}
			}
			legacy, _, _ := iptables.NewExecutor(iptables.WithBackend(iptables.BackendLegacy)).Save(ctx, ns.Path, iptables.IPv4)
			if !strings.Contains(legacy, "foreign") {
				t.Errorf("the other tool's legacy rule is gone:\n%s", legacy)
			}
		})
	}
}

// restoreIn loads iptables-restore input into ns with backend b's tool.
func restoreIn(t *testing.T, ns *testenv.NetNS, b iptables.Backend, input string) {
	t.Helper()
	if err := ns.Do(func() error {
		_, err := iptables.ExecRunner{}.Run(context.Background(), restoreTool(b, iptables.IPv4), []string{"--noflush"}, []byte(input))
		return err
	}); err != nil {
		t.Fatal(err)
	}
}

// The validator's probe is redirected although the pod skips its port and every network
// (issue 10): the validator passes whenever detour's rules are installed. The exempt identities
// still go out directly, and the /0 skip list lets everything else through.
func TestIntegrationSentinelRedirectedWhateverTheSkipLists(t *testing.T) {
	testenv.Privileged(t)
	ctx := context.Background()
	for _, family := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
		t.Run(family.String(), func(t *testing.T) {
			tp := newTopology(t, family)
			sentinel, network := netip.MustParseAddrPort("203.0.113.254:8080"), netip.MustParsePrefix("203.0.113.0/24")
			if family == iptables.IPv6 {
				sentinel, network = netip.MustParseAddrPort("[2001:db8::fe]:8080"), netip.MustParsePrefix("2001:db8::/32")
			}
			testenv.AddRoute(t, tp.pod, network, tp.remoteIP)
			rs, err := iptables.Build(iptables.Config{
				Family: family, ProxyUID: proxy.UID, InboundPort: 4143, OutboundPort: 4140,
				SkipOutboundPorts: []annotations.PortRange{{First: 8080, Last: 8080}},
				SkipOutboundCIDRs: []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0"), netip.MustParsePrefix("::/0")},
				ExemptGIDs:        []uint32{exemptGID.GID},
				Sentinels:         []netip.AddrPort{netip.MustParseAddrPort("203.0.113.254:8080"), netip.MustParseAddrPort("[2001:db8::fe]:8080")},
			})
			if err != nil {
				t.Fatal(err)
			}
			exec := iptables.NewExecutor()
			if err := exec.Apply(ctx, tp.pod.Path, rs); err != nil {
				t.Fatalf("apply: %v", err)
			}
			if err := exec.Check(ctx, tp.pod.Path, rs); err != nil {
				t.Fatalf("check right after apply (a /0 skip must read back as written): %v", err)
			}
			validator := testenv.Identity{UID: 2103, GID: 2103}
			expect(t, tp.pod, validator, sentinel, "outbound "+sentinel.String())
			remote := netip.AddrPortFrom(tp.remoteIP, 8080)
			expect(t, tp.pod, app, remote, "remote "+remote.String())
		})
	}
}

// The check folded into the proxy's start (issue 21) runs as the proxy's UID: its probe to the
// sentinel must be redirected, to the check port (issue 32), and nothing else of the proxy's own egress may change — it goes
// out directly to every other destination, skipped ports and networks included, on every
// backend and family. The app stays captured and the exempt identities go out directly.
func TestIntegrationProxyProbesTheSentinel(t *testing.T) {
	testenv.Privileged(t)
	ctx := context.Background()
	for _, backend := range []iptables.Backend{iptables.BackendLegacy, iptables.BackendNFT, iptables.BackendNFTables} {
		for _, family := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
			t.Run(string(backend)+"-"+family.String(), func(t *testing.T) {
				tp := newTopology(t, family)
				sentinel, network := netip.MustParseAddrPort("203.0.113.254:8080"), netip.MustParsePrefix("203.0.113.0/24")
				if family == iptables.IPv6 {
					sentinel, network = netip.MustParseAddrPort("[2001:db8::fe]:8080"), netip.MustParsePrefix("2001:db8::/32")
				}
				testenv.AddRoute(t, tp.pod, network, tp.remoteIP)
				c := tp.config(t)
				c.Sentinels = []netip.AddrPort{netip.MustParseAddrPort("203.0.113.254:8080"), netip.MustParseAddrPort("[2001:db8::fe]:8080")}
				rs, err := iptables.Build(c)
				if err != nil {
					t.Fatal(err)
				}
				exec := iptables.NewExecutor(iptables.WithBackend(backend))
				if err := exec.Apply(ctx, tp.pod.Path, rs); err != nil {
					t.Fatalf("apply: %v", err)
				}
				t.Cleanup(func() { exec.Remove(ctx, tp.pod.Path, family) })

				// The proxy's probe comes back to the check port, the validator's own.
				expect(t, tp.pod, proxy, sentinel, "check "+sentinel.String())
				// Everything else the proxy dials goes out directly, as before.
				remote := netip.AddrPortFrom(tp.remoteIP, 8080)
				smtp := netip.AddrPortFrom(tp.remoteIP, 25)
				skipped := netip.AddrPortFrom(tp.skippedIP, 8080)
				local := netip.AddrPortFrom(loopback(family), 8081)
				for _, to := range []netip.AddrPort{remote, smtp, skipped} {
					expect(t, tp.pod, proxy, to, "remote "+to.String())
				}
				expect(t, tp.pod, proxy, local, "app "+local.String())
				// The others are as they were.
				expect(t, tp.pod, app, remote, "outbound "+remote.String())
				expect(t, tp.pod, app, sentinel, "outbound "+sentinel.String())
				expect(t, tp.pod, exemptUID, remote, "remote "+remote.String())
				expect(t, tp.pod, exemptGID, remote, "remote "+remote.String())
			})
		}
	}
}
