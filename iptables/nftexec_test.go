package iptables

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/google/nftables"
)

// nftDiff names the first difference between a table read back and the expected one.
func TestNFTDiff(t *testing.T) {
	v4, v6 := fullConfig(IPv4), fullConfig(IPv6)
	want, err := BuildNFT(v4, v6)
	if err != nil {
		t.Fatal(err)
	}
	wantV4, _ := BuildNFT(v4)
	clone := func() NFTRuleset {
		c := NFTRuleset{Families: want.Families}
		for _, ch := range want.Chains {
			ch.Rules = slices.Clone(ch.Rules)
			c.Chains = append(c.Chains, ch)
		}
		return c
	}
	chain := func(rs NFTRuleset, name string) *NFTChain {
		for i := range rs.Chains {
			if rs.Chains[i].Name == name {
				return &rs.Chains[i]
			}
		}
		t.Fatalf("no chain %s", name)
		return nil
	}
	for _, tc := range []struct {
		name   string
		want   NFTRuleset
		change func(NFTRuleset) NFTRuleset
		err    string
		// missing: a part the redirect cannot work without (a DiffError's Missing).
		missing bool
	}{
		{"same", want, func(h NFTRuleset) NFTRuleset { return h }, "", false},
		{"ipv4 alone in a dual table", wantV4, func(h NFTRuleset) NFTRuleset { return h }, "", false},
		{"missing chain", want, func(h NFTRuleset) NFTRuleset {
			h.Chains = slices.DeleteFunc(h.Chains, func(c NFTChain) bool { return c.Name == "outbound_ipv6" })
			return h
		}, "chain outbound_ipv6 is missing", true},
		{"missing rule", want, func(h NFTRuleset) NFTRuleset {
			c := chain(h, "outbound_ipv4")
			c.Rules = slices.Delete(c.Rules, 4, 5)
			return h
		}, `chain outbound_ipv4 lacks rule 5, "meta skuid 1001 return comment \"detour/exempt-uid\""`, false},
		{"unexpected rule", want, func(h NFTRuleset) NFTRuleset {
			c := chain(h, "inbound_ipv6")
			c.Rules = append(c.Rules, chain(h, "outbound_ipv6").Rules[2])
			return h
		}, `chain inbound_ipv6 has an unexpected rule 3, "meta skuid 2102 return comment \"detour/proxy-uid\""`, false},
		{"out of order", want, func(h NFTRuleset) NFTRuleset {
			c := chain(h, "outbound_ipv4")
			c.Rules[1], c.Rules[2] = c.Rules[2], c.Rules[1] // the proxy's RETURN before the sentinel's redirect
			return h
		}, "(rules out of order)", false},
		{"RETURNs in another order", want, func(h NFTRuleset) NFTRuleset {
			c := chain(h, "outbound_ipv4")
			c.Rules[2], c.Rules[4] = c.Rules[4], c.Rules[2] // the proxy's and an exempt UID's
			return h
		}, "", false},
		{"check redirect missing", want, func(h NFTRuleset) NFTRuleset {
			c := chain(h, "outbound_ipv6")
			c.Rules = c.Rules[1:]
			return h
		}, `chain outbound_ipv6 lacks rule 1, "ip6 daddr 2001:db8::fe tcp dport 80 meta skuid 2102 redirect to :4142 comment \"detour/validator-check\""`, true},
		{"jump twice", want, func(h NFTRuleset) NFTRuleset {
			c := chain(h, "output")
			c.Rules = append(c.Rules, c.Rules[0])
			return h
		}, `chain output has the jump "meta nfproto ipv4 meta l4proto tcp jump outbound_ipv4 comment \"detour/outbound\"" 2 times`, false},
		{"foreign rule in a base chain", wantV4, func(h NFTRuleset) NFTRuleset {
			c := chain(h, "prerouting")
			c.Rules = append(c.Rules, chain(h, "inbound_ipv4").Rules[1])
			return h
		}, `chain prerouting has an unexpected rule 3`, false},
		{"priority", want, func(h NFTRuleset) NFTRuleset {
			chain(h, "output").Priority = 0
			return h
		}, `chain output is "type nat hook output priority 0; policy accept;", expected "type nat hook output priority -100; policy accept;"`, true},
		{"regular chain hooked", want, func(h NFTRuleset) NFTRuleset {
			chain(h, "inbound_ipv4").Hook = nftables.ChainHookInput
			return h
		}, "chain inbound_ipv4 is a base chain", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := nftDiff(tc.want, tc.change(clone()))
			switch {
			case tc.err == "" && err != nil:
				t.Errorf("nftDiff = %v, want no difference", err)
			case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
				t.Errorf("nftDiff = %v, want %s", err, tc.err)
			}
			var d *DiffError
			if tc.err != "" && (!errors.As(err, &d) || d.Missing != tc.missing) {
				t.Errorf("nftDiff = %#v, want a DiffError with Missing %v", err, tc.missing)
			}
		})
	}
}
