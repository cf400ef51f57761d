package iptables

import (
	"os"
	"slices"
	"strings"

	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
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

// nftTableExists dumps the nf_tables tables of family f (NFT_MSG_GETTABLE) and looks for name.
func nftTableExists(f Family, name string) (bool, error) {
	family := uint8(unix.AF_INET)
	if f == IPv6 {
		family = unix.AF_INET6
	}
	req := nl.NewNetlinkRequest(unix.NFNL_SUBSYS_NFTABLES<<8|unix.NFT_MSG_GETTABLE, unix.NLM_F_DUMP)
	req.AddData(&nl.Nfgenmsg{NfgenFamily: family, Version: unix.NFNETLINK_V0})
	msgs, err := req.Execute(unix.NETLINK_NETFILTER, 0)
	if err != nil {
		return false, err
	}
	for _, m := range msgs {
		if len(m) < nl.SizeofNfgenmsg || m[0] != family {
			continue
		}
		attrs, err := nl.ParseRouteAttr(m[nl.SizeofNfgenmsg:])
		if err != nil {
			return false, err
		}
		for _, a := range attrs {
			if a.Attr.Type == unix.NFTA_TABLE_NAME && strings.TrimRight(string(a.Value), "\x00") == name {
				return true, nil
			}
		}
	}
	return false, nil
}
