package iptables

import (
	"os"
	"slices"
	"strings"

	"github.com/google/nftables"
)

// natTableExists reports whether backend b has a nat table for family f in the calling
// thread's network namespace, without running a tool: the legacy tables are listed in /proc,
// the nf_tables ones are asked for over netlink. When it cannot tell it says yes, so the caller
// reads the table with the tool.
func natTableExists(b Backend, f Family) bool {
	if b == BackendLegacy {
		names := "/proc/thread-self/net/ip_tables_names"
		if f == IPv6 {
			names = "/proc/thread-self/net/ip6_tables_names"
		}
		data, err := os.ReadFile(names)
		// No file: the legacy modules are not loaded, so no legacy table exists anywhere.
		return err == nil && slices.Contains(strings.Fields(string(data)), "nat")
	}
	exists, err := nftTableExists(f, "nat")
	return exists || err != nil
}

// nftTableExists lists the nf_tables tables of family f and looks for name.
func nftTableExists(f Family, name string) (bool, error) {
	c, err := nftables.New()
	if err != nil {
		return false, err
	}
	tables, err := c.ListTablesOfFamily(nftFamily(f))
	if err != nil {
		return false, err
	}
	return slices.ContainsFunc(tables, func(t *nftables.Table) bool { return t.Name == name }), nil
}
