package iptables

import (
	"context"
	"testing"

	"github.com/detourmesh/detour/test/testenv"
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

// Remove tries the removal of the rules as Apply installs them; when the table holds something
// else of detour's (a jump added twice by hand, a foreign chain that goes to detour's), that
// attempt changes nothing and Remove reads the table and removes exactly what refers to
// detour's chains — with either backend, and on nf_tables over netlink.
func TestIntegrationRemoveUnusualTable(t *testing.T) {
	for _, b := range []Backend{BackendLegacy, BackendNFT} {
		t.Run(string(b), func(t *testing.T) {
			ns := testenv.NewNetNS(t)
			exec := NewExecutor(WithBackend(b))
			rs, _ := Build(Config{Family: IPv4, ProxyUID: 1, InboundPort: 1, OutboundPort: 2})
			ctx := context.Background()
			if err := exec.Apply(ctx, ns.Path, rs); err != nil {
				t.Fatal(err)
			}
			extra := "*nat\n:MESH_USER - [0:0]\n" + rs.Hooks[1].String() + "\n-A OUTPUT -d 192.0.2.7/32 -j RETURN\n" +
				"-A MESH_USER -d 192.0.2.8/32 -g " + OutboundChain + "\n-A MESH_USER -p udp -j RETURN\nCOMMIT\n"
			if err := ns.Do(func() error {
				_, err := exec.runner.Run(ctx, exec.tools(IPv4).found[b].restore, []string{"--noflush"}, []byte(extra))
				return err
			}); err != nil {
				t.Fatal(err)
			}
			if err := exec.Remove(ctx, ns.Path, IPv4); err != nil {
				t.Fatal(err)
			}
			saved, _, err := exec.Save(ctx, ns.Path, IPv4)
			if err != nil {
				t.Fatal(err)
			}
			if tb := parseSave(saved); tb.ours() || !tb.chains["MESH_USER"] || len(tb.rules) != 2 {
				t.Errorf("after Remove the table should hold only the foreign chain and the two foreign rules that do not refer to detour's chains:\n%s", saved)
			}
		})
	}
}

// countingRunner counts the tool runs of an Executor.
type countingRunner struct{ n int }

func (r *countingRunner) Run(ctx context.Context, name string, args []string, stdin []byte) ([]byte, error) {
	r.n++
	return ExecRunner{}.Run(ctx, name, args, stdin)
}

// With nf_tables, Remove deletes over netlink without running a tool, in both families, and
// leaves alone every rule and chain that does not refer to detour's: a foreign chain, a foreign
// rule in a hook chain, and it also removes a goto to detour's chain from a foreign chain.
func TestIntegrationRemoveNFTWithoutTools(t *testing.T) {
	ns := testenv.NewNetNS(t)
	ctx := context.Background()
	runs := &countingRunner{}
	exec := NewExecutor(WithBackend(BackendNFT), WithRunner(runs))
	for _, f := range []Family{IPv4, IPv6} {
		rs, _ := Build(Config{Family: f, ProxyUID: 1, InboundPort: 1, OutboundPort: 2})
		if err := exec.Apply(ctx, ns.Path, rs); err != nil {
			t.Fatal(err)
		}
		dst := "192.0.2.7/32"
		if f == IPv6 {
			dst = "2001:db8::7/128"
		}
		foreign := "*nat\n:MESH_USER - [0:0]\n-A MESH_USER -d " + dst + " -g " + OutboundChain +
			"\n-A MESH_USER -p udp -j RETURN\n-A OUTPUT -d " + dst + " -j RETURN\nCOMMIT\n"
		if err := ns.Do(func() error {
			_, err := exec.runner.Run(ctx, exec.tools(f).found[BackendNFT].restore, []string{"--noflush"}, []byte(foreign))
			return err
		}); err != nil {
			t.Fatalf("%s: %v", f, err)
		}
	}
	runs.n = 0
	if err := exec.Remove(ctx, ns.Path, IPv4, IPv6); err != nil {
		t.Fatal(err)
	}
	if runs.n != 0 {
		t.Errorf("Remove ran %d tools; nf_tables removal should need none", runs.n)
	}
	for _, f := range []Family{IPv4, IPv6} {
		saved, _, err := exec.Save(ctx, ns.Path, f)
		if err != nil {
			t.Fatal(err)
		}
		tb := parseSave(saved)
		if tb.ours() {
			t.Errorf("%s: detour's rules survived Remove:\n%s", f, saved)
		}
		if !tb.chains["MESH_USER"] || len(tb.rules) != 2 {
			t.Errorf("%s: Remove should leave the foreign chain with its RETURN rule and the foreign OUTPUT rule, and only them:\n%s", f, saved)
		}
	}
	// Nothing left: removing again succeeds and still runs no tool.
	runs.n = 0
	if err := exec.Remove(ctx, ns.Path, IPv4, IPv6); err != nil || runs.n != 0 {
		t.Errorf("a second Remove: %v, %d tool runs", err, runs.n)
	}
}

// BenchmarkNatTableExists measures asking the kernel whether a backend has a nat table, which
// Apply and Remove do instead of running iptables-save in a fresh namespace.
func BenchmarkNatTableExists(b *testing.B) {
	ns := testenv.NewNetNS(b)
	for _, backend := range []Backend{BackendNFT, BackendLegacy} {
		b.Run(string(backend), func(b *testing.B) {
			if err := ns.Do(func() error {
				for b.Loop() {
					natTableExists(backend, IPv4)
				}
				return nil
			}); err != nil {
				b.Fatal(err)
			}
		})
	}
}
