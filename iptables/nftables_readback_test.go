package iptables

import (
	"context"
	"net/netip"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/detourmesh/detour/test/testenv"
)

// The golden tables, written to the kernel and read back, are the golden text: what the kernel
// holds is what BuildNFT built, expression for expression (CHECK relies on it). Where nft is
// installed, nft list prints the same text too.
func TestIntegrationNFTablesReadBackGolden(t *testing.T) {
	testenv.Privileged(t)
	nft, _ := exec.LookPath("nft")
	for _, tc := range []struct {
		name string
		cfgs []Config
	}{
		{"nftables-minimal-ipv4", []Config{{Family: IPv4, ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140}}},
		{"nftables-full-dual", []Config{fullConfig(IPv4), fullConfig(IPv6)}},
		{"nftables-inbound-listening", []Config{listeningConfig(IPv4), listeningConfig(IPv6)}},
		{"nftables-skip-all", []Config{{
			Family: IPv4, ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140,
			SkipOutboundPorts: ports("80"),
			SkipOutboundCIDRs: cidrs("0.0.0.0/0,::/0"),
			Sentinels:         []netip.AddrPort{netip.MustParseAddrPort("203.0.113.254:80")},
		}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ns := testenv.NewNetNS(t)
			var rulesets []Ruleset
			for _, c := range tc.cfgs {
				rs, err := Build(c)
				if err != nil {
					t.Fatal(err)
				}
				rulesets = append(rulesets, rs)
			}
			e := NewExecutor(WithBackend(BackendNFTables))
			ctx := context.Background()
			if err := e.Apply(ctx, ns.Path, rulesets...); err != nil {
				t.Fatal(err)
			}
			got, _, err := e.Save(ctx, ns.Path, IPv4)
			if err != nil {
				t.Fatal(err)
			}
			golden := filepath.Join("testdata", tc.name+".golden")
			testenv.Golden(t, golden, got, false)
			if nft == "" {
				t.Log("nft is not installed: the comparison with nft list is left out")
				return
			}
			if err := ns.Do(func() error {
				out, err := ExecRunner{}.Run(ctx, nft, []string{"list", "table", "inet", NFTTable}, nil)
				if err == nil {
					testenv.Golden(t, golden, string(out), false)
				}
				return err
			}); err != nil {
				t.Errorf("nft list: %v", err)
			}
		})
	}
}
