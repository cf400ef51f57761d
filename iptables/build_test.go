package iptables

import (
	"flag"
	"fmt"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/test/testenv"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/ from the current output")

func ports(s string) []annotations.PortRange {
	p, err := annotations.ParsePorts("test", s)
	if err != nil {
		panic(err)
	}
	return p
}

func cidrs(s string) []netip.Prefix {
	p, err := annotations.ParseCIDRs("test", s)
	if err != nil {
		panic(err)
	}
	return p
}

func fullConfig(f Family) Config {
	return Config{
		Family:            f,
		ProxyUID:          2102,
		InboundPort:       4143,
		OutboundPort:      4140,
		SkipInboundPorts:  ports("4190-4191"),
		SkipOutboundPorts: ports("25,443,1000-1010,2000,2001,2002,2003,2004,2005,2006,2007,2008,2009,3000-3100,4000"),
		SkipOutboundCIDRs: cidrs("10.96.0.0/12,fd00:10:96::/112,169.254.169.254"),
		ExemptUIDs:        []uint32{1000, 1001},
		ExemptGIDs:        []uint32{2601},
		Sentinels:         []netip.AddrPort{netip.MustParseAddrPort("203.0.113.254:80"), netip.MustParseAddrPort("[2001:db8::fe]:80")},
		CheckPort:         4142,
	}
}

// listeningConfig is fullConfig with inbound connections redirected only where the pod listens.
func listeningConfig(f Family) Config {
	c := fullConfig(f)
	c.InboundListening = true
	return c
}

// fallbackConfig is listeningConfig as ADD installs it where the kernel refuses the socket
// lookup: every inbound connection redirected, under the fallback's own comment.
func fallbackConfig(f Family) Config {
	c := fullConfig(f)
	c.InboundFallback = true
	return c
}

// beforeCheckPort is c as the annotations of a pod injected before detour wrote
// detour.dev/validator-check-port give it.
func beforeCheckPort(c Config) Config {
	c.CheckPort = 0
	return c
}

func TestBuildGolden(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"minimal-ipv4", Config{Family: IPv4, ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140}},
		{"full-ipv4", fullConfig(IPv4)},
		{"full-ipv6", fullConfig(IPv6)},
		// A pod injected before the check port: the rules of the release that injected it, byte
		// for byte (the golden file is that release's full-ipv4.golden).
		{"full-ipv4-no-check-port", beforeCheckPort(fullConfig(IPv4))},
		{"inbound-listening-ipv4", listeningConfig(IPv4)},
		{"inbound-fallback-ipv4", fallbackConfig(IPv4)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rs, err := Build(tc.cfg)
			if err != nil {
				t.Fatal(err)
			}
			testenv.Golden(t, filepath.Join("testdata", tc.name+".golden"), rs.Restore(), *update)
		})
	}
}

func TestBuildRejects(t *testing.T) {
	for _, c := range []Config{
		{ProxyUID: 0, InboundPort: 1, OutboundPort: 2},
		{ProxyUID: 1, InboundPort: 0, OutboundPort: 2},
		{ProxyUID: 1, InboundPort: 1, OutboundPort: 0},
		{ProxyUID: 1, InboundPort: 1, OutboundPort: 2, CheckPort: 2},
		{ProxyUID: 1, InboundPort: 1, OutboundPort: 2, CheckPort: 1},
		{ProxyUID: 1, InboundPort: 1, OutboundPort: 2, InboundListening: true, InboundFallback: true},
	} {
		if _, err := Build(c); err == nil {
			t.Errorf("Build(%+v) succeeded; want an error", c)
		}
	}
}

// BuildFamilies is Build of each family, in the order given, and fails as Build does.
func TestBuildFamilies(t *testing.T) {
	r := annotations.Redirect{Version: "v1", ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140}
	got, err := BuildFamilies(r, IPv6, IPv4)
	if err != nil || len(got) != 2 {
		t.Fatalf("BuildFamilies = %d rulesets, %v; want 2", len(got), err)
	}
	for i, f := range []Family{IPv6, IPv4} {
		want, err := Build(ConfigFromRedirect(r, f))
		if err != nil {
			t.Fatal(err)
		}
		if got[i].Restore() != want.Restore() {
			t.Errorf("ruleset %d is not %s's:\n%s\nwant\n%s", i, f, got[i].Restore(), want.Restore())
		}
	}
	r.ProxyUID = 0
	if _, err := BuildFamilies(r, IPv4); err == nil {
		t.Error("BuildFamilies with no proxy UID succeeded; want Build's error")
	}
}

// V010Rules drops what detour-cni v0.1.0 does not know (the socket lookup, the check port)
// and nothing else; rulesets that use neither have no v0.1.0 form of their own.
func TestV010Rules(t *testing.T) {
	r := annotations.Redirect{Version: "v1", ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140, CheckPort: 4142, InboundListening: true, ExemptUIDs: []uint32{1001}}
	rulesets, err := BuildFamilies(r, IPv4, IPv6)
	if err != nil {
		t.Fatal(err)
	}
	older, ok := V010Rules(rulesets)
	if !ok || len(older) != 2 {
		t.Fatalf("V010Rules = %d rulesets, %v; want 2 and ok", len(older), ok)
	}
	for i, f := range []Family{IPv4, IPv6} {
		c := ConfigFromRedirect(r, f)
		c.InboundListening, c.CheckPort = false, 0
		want, _ := Build(c)
		if older[i].Restore() != want.Restore() {
			t.Errorf("%s: v0.1.0's form\n%s\nwant\n%s", f, older[i].Restore(), want.Restore())
		}
	}
	r.CheckPort, r.InboundListening = 0, false
	plain, _ := BuildFamilies(r, IPv4)
	if _, ok := V010Rules(plain); ok {
		t.Error("V010Rules of rules v0.1.0 installs as they are: ok, want not")
	}
}

func TestMultiportSplitsAtKernelLimit(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []string
	}{
		{"", nil},
		{"1,2,3", []string{"1,2,3"}},
		{"1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16", []string{"1,2,3,4,5,6,7,8,9,10,11,12,13,14,15", "16"}},
		{"1,2,3,4,5,6,7,8,9,10,11,12,13,14,20-30", []string{"1,2,3,4,5,6,7,8,9,10,11,12,13,14", "20:30"}},
		{"1-2,3-4,5-6,7-8,9-10,11-12,13-14,15-16", []string{"1:2,3:4,5:6,7:8,9:10,11:12,13:14", "15:16"}},
	} {
		got := multiport(ports(tc.in))
		if strings.Join(got, " ") != strings.Join(tc.want, " ") {
			t.Errorf("multiport(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

func FuzzBuild(f *testing.F) {
	f.Add(uint32(2102), uint16(4143), uint16(4140), "4190-4191", "25,8000-8100", "10.0.0.0/8,fd00::/8", "1000", "2601", false)
	f.Add(uint32(1), uint16(1), uint16(65535), "", "", "", "", "", true)
	f.Fuzz(func(t *testing.T, uid uint32, in, out uint16, skipIn, skipOut, nets, uids, gids string, v6 bool) {
		c := Config{Family: IPv4, ProxyUID: uid, InboundPort: in, OutboundPort: out}
		if v6 {
			c.Family = IPv6
		}
		var err error
		if c.SkipInboundPorts, err = annotations.ParsePorts("k", skipIn); err != nil {
			return
		}
		if c.SkipOutboundPorts, err = annotations.ParsePorts("k", skipOut); err != nil {
			return
		}
		if c.SkipOutboundCIDRs, err = annotations.ParseCIDRs("k", nets); err != nil {
			return
		}
		if c.ExemptUIDs, err = annotations.ParseIDs("k", uids); err != nil {
			return
		}
		if c.ExemptGIDs, err = annotations.ParseIDs("k", gids); err != nil {
			return
		}
		rs, err := Build(c)
		if err != nil {
			if uid != 0 && in != 0 && out != 0 {
				t.Fatalf("Build(%+v) failed: %v", c, err)
			}
			return
		}
		text := rs.Restore()
		for line := range strings.Lines(text) {
			if strings.Contains(line, "--uid-owner 0 ") || strings.Contains(line, "--gid-owner 0 ") {
				t.Fatalf("root is exempt: %s", line)
			}
			if strings.Contains(line, "--dports") && strings.Count(line, ",")+strings.Count(line, ":")+1 > maxMultiport {
				t.Fatalf("multiport list over the kernel limit: %s", line)
			}
			if strings.HasPrefix(line, "-A ") && !strings.Contains(line, `--comment "detour/`) {
				t.Fatalf("rule without a detour comment: %s", line)
			}
			if _, dst, ok := strings.Cut(line, " -d "); ok {
				addr, _, _ := strings.Cut(dst, "/")
				if strings.Contains(addr, ":") != v6 {
					t.Fatalf("%s ruleset holds a CIDR of the other family: %s", c.Family, line)
				}
			}
		}
		last := rs.Rules[len(rs.Rules)-1]
		if last.Chain != OutboundChain || !strings.HasSuffix(last.Spec, "REDIRECT --to-ports "+id(uint32(out))) {
			t.Fatalf("the last rule must redirect outbound to %d: %s", out, last)
		}
		if got := parseSave(text); diff(rs, got) != nil {
			t.Fatalf("the rendered text does not parse back to the ruleset: %v", diff(rs, got))
		}
	})
}

// The validator's probe is redirected whatever the skip lists say (issue 10): a pod that skips
// port 80 or every network must still pass its validator, so the sentinel's REDIRECT comes
// before any skip RETURN — and before the identities that go out directly, the proxy's among
// them, since the check folded into the proxy's start runs as the proxy (issue 21).
func TestBuildSentinelAheadOfSkipLists(t *testing.T) {
	for _, f := range []Family{IPv4, IPv6} {
		rs, err := Build(Config{
			Family: f, ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140,
			SkipOutboundPorts: ports("80"),
			SkipOutboundCIDRs: cidrs("0.0.0.0/0,::/0"),
			ExemptUIDs:        []uint32{1000},
			Sentinels:         []netip.AddrPort{netip.MustParseAddrPort("203.0.113.254:80"), netip.MustParseAddrPort("[2001:db8::fe]:80")},
		})
		if err != nil {
			t.Fatal(err)
		}
		want := map[Family]string{
			IPv4: `-d 203.0.113.254/32 -p tcp -m multiport --dports 80 -m comment --comment "detour/validator-sentinel" -j REDIRECT --to-ports 4140`,
			IPv6: `-d 2001:db8::fe/128 -p tcp -m multiport --dports 80 -m comment --comment "detour/validator-sentinel" -j REDIRECT --to-ports 4140`,
		}[f]
		sentinel, firstSkip, firstOwner := -1, -1, -1
		for i, r := range rs.Rules {
			switch {
			case r.Spec == want:
				sentinel = i
			case strings.Contains(r.Spec, "detour/validator-sentinel"):
				t.Errorf("%s: a sentinel of the other family: %s", f, r)
			case strings.Contains(r.Spec, "detour/skip-outbound") && firstSkip < 0:
				firstSkip = i
			case strings.Contains(r.Spec, "-m owner") && firstOwner < 0:
				firstOwner = i
			}
		}
		// Ahead of the skip lists, and of the proxy's own exemption too: the check folded into
		// the proxy's start runs as the proxy's UID.
		if sentinel < 0 || firstSkip < 0 || firstOwner < 0 || sentinel > firstSkip || sentinel > firstOwner {
			t.Errorf("%s: sentinel rule at %d, first skip at %d, first owner rule at %d; want sentinel < owner, sentinel < skip:\n%s", f, sentinel, firstSkip, firstOwner, rs.Restore())
		}
		// iptables-save prints a match-all destination without -d; the executor compares
		// rules as iptables-save prints them.
		if !strings.Contains(rs.Restore(), "-A DETOUR_OUTBOUND -m comment --comment \"detour/skip-outbound-cidr\" -j RETURN\n") {
			t.Errorf("%s: the /0 skip is not rendered without -d:\n%s", f, rs.Restore())
		}
	}
}

func TestBuildNFTGolden(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfgs []Config
	}{
		{"nftables-minimal-ipv4", []Config{{Family: IPv4, ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140}}},
		{"nftables-full-dual", []Config{fullConfig(IPv4), fullConfig(IPv6)}},
		{"nftables-full-dual-no-check-port", []Config{beforeCheckPort(fullConfig(IPv4)), beforeCheckPort(fullConfig(IPv6))}},
		{"nftables-inbound-listening", []Config{listeningConfig(IPv4), listeningConfig(IPv6)}},
		{"nftables-inbound-fallback", []Config{fallbackConfig(IPv4), fallbackConfig(IPv6)}},
		{"nftables-skip-all", []Config{{
			Family: IPv4, ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140,
			SkipOutboundPorts: ports("80"),
			SkipOutboundCIDRs: cidrs("0.0.0.0/0,::/0"),
			Sentinels:         []netip.AddrPort{netip.MustParseAddrPort("203.0.113.254:80")},
		}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rs, err := BuildNFT(tc.cfgs...)
			if err != nil {
				t.Fatal(err)
			}
			testenv.Golden(t, filepath.Join("testdata", tc.name+".golden"), rs.String(), *update)
		})
	}
}

// FuzzBuildNFT: whatever the annotations hold, the nftables table roots no one, renders every
// expression it holds (nothing the renderer does not know, so CHECK compares everything), keeps
// each family's addresses in its own chains and ends each outbound chain with the redirect.
func FuzzBuildNFT(f *testing.F) {
	f.Add(uint32(2102), uint16(4143), uint16(4140), "4190-4191", "25,8000-8100", "10.0.0.0/8,fd00::/8,0.0.0.0/0", "1000", "2601", "203.0.113.254:80")
	f.Add(uint32(1), uint16(1), uint16(65535), "", "", "", "", "", "")
	f.Fuzz(func(t *testing.T, uid uint32, in, out uint16, skipIn, skipOut, nets, uids, gids, sentinel string) {
		var cfgs []Config
		for _, fam := range []Family{IPv4, IPv6} {
			c := Config{Family: fam, ProxyUID: uid, InboundPort: in, OutboundPort: out}
			var err error
			if c.SkipInboundPorts, err = annotations.ParsePorts("k", skipIn); err != nil {
				return
			}
			if c.SkipOutboundPorts, err = annotations.ParsePorts("k", skipOut); err != nil {
				return
			}
			if c.SkipOutboundCIDRs, err = annotations.ParseCIDRs("k", nets); err != nil {
				return
			}
			if c.ExemptUIDs, err = annotations.ParseIDs("k", uids); err != nil {
				return
			}
			if c.ExemptGIDs, err = annotations.ParseIDs("k", gids); err != nil {
				return
			}
			if s, err := netip.ParseAddrPort(sentinel); err == nil {
				c.Sentinels = []netip.AddrPort{s}
			}
			cfgs = append(cfgs, c)
		}
		rs, err := BuildNFT(cfgs...)
		if err != nil {
			if uid != 0 && in != 0 && out != 0 {
				t.Fatalf("BuildNFT failed: %v", err)
			}
			return
		}
		for _, ch := range rs.Chains {
			for _, r := range ch.Rules {
				text := r.String()
				switch {
				case strings.Contains(text, "["):
					t.Fatalf("chain %s: an expression the renderer does not know: %s", ch.Name, text)
				case strings.Contains(text, "skuid 0 ") || strings.Contains(text, "skgid 0 "):
					t.Fatalf("chain %s: root is exempt: %s", ch.Name, text)
				case !strings.HasPrefix(r.Comment, "detour/"):
					t.Fatalf("chain %s: rule without a detour comment: %s", ch.Name, text)
				case strings.HasSuffix(ch.Name, "_ipv4") && strings.Contains(text, "ip6 "),
					strings.HasSuffix(ch.Name, "_ipv6") && strings.Contains(text, "ip daddr"):
					t.Fatalf("chain %s holds an address of the other family: %s", ch.Name, text)
				}
			}
			if strings.HasPrefix(ch.Name, "outbound_") {
				last := ch.Rules[len(ch.Rules)-1].String()
				if last != fmt.Sprintf(`meta l4proto tcp redirect to :%d comment "detour/redirect-outbound"`, out) {
					t.Fatalf("chain %s does not end with the redirect: %s", ch.Name, last)
				}
			}
		}
	})
}
