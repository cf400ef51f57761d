package iptables

import (
	"context"
	"testing"

	"github.com/detourmesh/detour/internal/testenv"
)

// natTableExists sees exactly the tables the tools create, per backend and family.
func TestIntegrationNatTableExists(t *testing.T) {
	ns := testenv.NewNetNS(t)
	exists := func(b Backend, f Family) (yes bool) {
		if err := ns.Do(func() error { yes = natTableExists(b, f); return nil }); err != nil {
			t.Fatal(err)
		}
		return yes
	}
	for _, b := range []Backend{BackendLegacy, BackendNFT} {
		for _, f := range []Family{IPv4, IPv6} {
			if exists(b, f) {
				t.Errorf("a fresh namespace has a %s %s nat table", b, f)
			}
		}
	}
	rs, _ := Build(Config{Family: IPv6, ProxyUID: 1, InboundPort: 1, OutboundPort: 2})
	if err := NewExecutor(WithBackend(BackendNFT)).Apply(context.Background(), ns.Path, rs); err != nil {
		t.Fatal(err)
	}
	if !exists(BackendNFT, IPv6) || exists(BackendNFT, IPv4) || exists(BackendLegacy, IPv6) {
		t.Error("after an nft IPv6 apply only the nft IPv6 nat table should exist")
	}
	rs.Family = IPv4
	if err := NewExecutor(WithBackend(BackendLegacy)).Apply(context.Background(), ns.Path, rs); err != nil {
		t.Fatal(err)
	}
	if !exists(BackendLegacy, IPv4) || exists(BackendLegacy, IPv6) {
		t.Error("after a legacy IPv4 apply the legacy IPv4 nat table should exist, and only it")
	}
}
