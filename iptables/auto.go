package iptables

import (
	"slices"

	"github.com/google/nftables"
)

// autoChoice is auto's backend in the calling thread's network namespace for families:
// nftables where detour's table already is; the iptables tools (BackendAuto, which then picks
// legacy or nft as it always has) where detour's chains are in the iptables-nft nat table (a pod
// set up before the node moved to nftables, so its rules are replaced, not doubled) or where the
// legacy nat table holds rules (another tool's, which detour's nf_tables chains at the same hook
// priority would run in no defined order with), and where the kernel does not answer nf_tables
// requests; nftables otherwise — in a fresh pod namespace, always. It costs one netlink dump and
// a /proc read per family.
func autoChoice(families []Family) Backend {
	tables, err := nftTables()
	switch {
	case err != nil:
		return BackendAuto
	case tables[detourTable]:
		return BackendNFTables
	}
	for _, f := range families {
		if legacyNATHasRules(f) || tables[nfTable{nftFamily(f), "nat"}] && hasOwnChains(f) {
			return BackendAuto
		}
	}
	return BackendNFTables
}

// hasOwnChains reports whether the iptables-nft nat table of family f holds one of detour's
// chains; when it cannot tell, it says yes, which keeps the tools that can.
func hasOwnChains(f Family) bool {
	c, err := nftConn()
	if err != nil {
		return true
	}
	defer c.CloseLasting()
	chains, err := c.ListChainsOfTableFamily(nftFamily(f))
	if err != nil {
		return true
	}
	return slices.ContainsFunc(chains, func(ch *nftables.Chain) bool {
		return ch.Table.Name == "nat" && slices.Contains(Chains(), ch.Name)
	})
}
