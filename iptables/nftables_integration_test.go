package iptables_test

import (
	"context"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/test/testenv"
)

// The nftables backend installs the same redirect as the iptables tools, over netlink only: the
// PATH holds no iptables, ip6tables or nft binary while it works. Both families' rules go in
// with one Apply; the traffic of the topology's family proves who is redirected.
func TestIntegrationNFTablesRedirect(t *testing.T) {
	testenv.Privileged(t)
	for _, family := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
		t.Run(family.String(), func(t *testing.T) { testNFTablesRedirect(t, family) })
	}
}

func testNFTablesRedirect(t *testing.T, family iptables.Family) {
	ctx := context.Background()
	tp := newTopology(t, family)
	remote := netip.AddrPortFrom(tp.remoteIP, 8080)

	// Coexistence: another tool's iptables-nft rule in the nat table, written with its tool
	// before the PATH is emptied, keeps working beside detour's table and survives its removal.
	foreign := "*nat\n-A OUTPUT -p tcp --dport 9 -m comment --comment foreign -j REDIRECT --to-ports 8081\nCOMMIT\n"
	if _, err := exec.LookPath(restoreTool(iptables.BackendNFT, family)); err != nil {
		t.Fatalf("the coexistence check needs %s: %v", restoreTool(iptables.BackendNFT, family), err)
	}
	if err := tp.pod.Do(func() error {
		_, err := iptables.ExecRunner{}.Run(ctx, restoreTool(iptables.BackendNFT, family), []string{"--noflush"}, []byte(foreign))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	nftTool, _ := exec.LookPath("nft") // to compare with nft's own listing, when installed
	t.Setenv("PATH", t.TempDir())
	for _, tool := range []string{"iptables", "ip6tables", "nft", "iptables-nft-restore", "iptables-legacy-restore"} {
		if p, err := exec.LookPath(tool); err == nil {
			t.Fatalf("%s is still on PATH at %s", tool, p)
		}
	}

	exec := iptables.NewExecutor(iptables.WithBackend(iptables.BackendNFTables))
	if err := exec.Usable(family); err != nil {
		t.Fatalf("usable: %v", err)
	}
	var rulesets []iptables.Ruleset
	for _, f := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
		tp := *tp
		tp.family = f
		rulesets = append(rulesets, tp.ruleset(t))
	}
	start := time.Now()
	if err := exec.Apply(ctx, tp.pod.Path, rulesets...); err != nil {
		t.Fatalf("apply: %v", err)
	}
	t.Logf("apply took %s", time.Since(start))
	if err := exec.Check(ctx, tp.pod.Path, rulesets...); err != nil {
		t.Fatalf("check right after apply: %v", err)
	}
	for _, rs := range rulesets {
		if err := exec.Check(ctx, tp.pod.Path, rs); err != nil {
			t.Fatalf("check of %s alone: %v", rs.Family, err)
		}
	}
	applied, used, err := exec.Save(ctx, tp.pod.Path, family)
	if err != nil || used != iptables.BackendNFTables {
		t.Fatalf("save: backend %s, %v", used, err)
	}
	want, _ := iptables.BuildNFT(rulesets[0].Config, rulesets[1].Config)
	if applied != want.String() {
		t.Errorf("the table read back differs from the one built:\n--- read back\n%s--- built\n%s", applied, want)
	}
	// The rendering is nft's own: nft list prints the same text, character for character.
	if nftTool == "" {
		t.Log("nft is not installed: the comparison with nft list is left out")
	} else if err := tp.pod.Do(func() error {
		out, err := iptables.ExecRunner{}.Run(ctx, nftTool, []string{"list", "table", "inet", iptables.NFTTable}, nil)
		if err == nil && string(out) != want.String() {
			t.Errorf("nft list table inet detour differs from the rendering:\n--- nft\n%s--- detour\n%s", out, want)
		}
		return err
	}); err != nil {
		t.Errorf("nft list: %v", err)
	}

	expect(t, tp.pod, app, remote, "outbound "+remote.String())
	expect(t, tp.pod, root, remote, "outbound "+remote.String())
	expect(t, tp.pod, proxy, remote, "remote "+remote.String())
	expect(t, tp.pod, exemptUID, remote, "remote "+remote.String())
	expect(t, tp.pod, exemptGID, remote, "remote "+remote.String())
	// The exempt GID counts as the primary group only, as --gid-owner without --suppl-groups:
	// the app with it as a supplementary group is redirected.
	if got, err := testenv.DialAs(tp.pod, app, []uint32{exemptGID.GID}, remote, 3*time.Second); err != nil || got != "outbound "+remote.String() {
		t.Errorf("dial as %s with supplementary group %d: %q, %v; want the proxy", app, exemptGID.GID, got, err)
	}
	smtp := netip.AddrPortFrom(tp.remoteIP, 25)
	expect(t, tp.pod, app, smtp, "remote "+smtp.String())
	skipped := netip.AddrPortFrom(tp.skippedIP, 8080)
	expect(t, tp.pod, app, skipped, "remote "+skipped.String())
	local := netip.AddrPortFrom(loopback(family), 8081)
	expect(t, tp.pod, app, local, "app "+local.String())
	appPort := netip.AddrPortFrom(tp.podIP, 8081)
	expect(t, tp.remote, root, appPort, "inbound "+appPort.String())
	admin := netip.AddrPortFrom(tp.podIP, 4191)
	expect(t, tp.remote, root, admin, "admin "+admin.String())
	// The foreign rule still works: OUTPUT to port 9 of the remote goes to the pod's app.
	discard := netip.AddrPortFrom(tp.remoteIP, 9)
	expect(t, tp.pod, proxy, discard, "app "+discard.String())

	// Applying again changes nothing.
	if err := exec.Apply(ctx, tp.pod.Path, rulesets...); err != nil {
		t.Fatalf("second apply: %v", err)
	}
	if again, _, _ := exec.Save(ctx, tp.pod.Path, family); again != applied {
		t.Errorf("applying twice changed the table:\n--- first\n%s--- second\n%s", applied, again)
	}

	// Remove deletes the table, twice is fine, and the foreign rule stays.
	for range 2 {
		if err := exec.Remove(ctx, tp.pod.Path, iptables.IPv4, iptables.IPv6); err != nil {
			t.Fatalf("remove: %v", err)
		}
	}
	if after, _, err := exec.Save(ctx, tp.pod.Path, family); err != nil || after != "" {
		t.Errorf("after remove: table %q, %v; want none", after, err)
	}
	if err := exec.Check(ctx, tp.pod.Path, rulesets...); err == nil || !strings.Contains(err.Error(), "missing") {
		t.Errorf("check after remove = %v, want a missing table", err)
	}
	expect(t, tp.pod, app, remote, "remote "+remote.String())
	expect(t, tp.pod, proxy, discard, "app "+discard.String())
}

// CHECK reads the kernel: a rule changed behind detour's back is named in words.
func TestIntegrationNFTablesCheckNamesDifference(t *testing.T) {
	testenv.Privileged(t)
	ctx := context.Background()
	ns := testenv.NewNetNS(t)
	exec := iptables.NewExecutor(iptables.WithBackend(iptables.BackendNFTables))
	installed, _ := iptables.Build(iptables.Config{Family: iptables.IPv4, ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140, ExemptUIDs: []uint32{1000}})
	expected, _ := iptables.Build(iptables.Config{Family: iptables.IPv4, ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140, ExemptUIDs: []uint32{1001}})
	if err := exec.Apply(ctx, ns.Path, installed); err != nil {
		t.Fatal(err)
	}
	err := exec.Check(ctx, ns.Path, expected)
	want := `chain outbound_ipv4 lacks rule 2, "meta skuid 1001 return comment \"detour/exempt-uid\""`
	if err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("check = %v, want it to say %s", err, want)
	}
	// An IPv6 check of an IPv4-only table names the missing jump.
	v6, _ := iptables.Build(iptables.Config{Family: iptables.IPv6, ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140})
	if err := exec.Check(ctx, ns.Path, v6); err == nil || !strings.Contains(err.Error(), "lacks the jump") {
		t.Errorf("ipv6 check = %v, want a missing jump", err)
	}
}
