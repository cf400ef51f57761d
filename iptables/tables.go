package iptables

import (
	"math/bits"
	"os"
	"slices"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// natTableExists reports whether backend b has a nat table for family f in the calling
// thread's network namespace, without running a tool: the legacy tables are listed in /proc,
// the nf_tables ones are asked for over netlink (nftTables). When it cannot tell it says yes, so
// the caller reads the table with the tool.
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
	tables, err := nftTables()
	return err != nil || tables[nfTable{nftFamily(f), "nat"}]
}

// legacyNATHasRules reports whether the legacy nat table of family f in the calling thread's
// network namespace holds anything beyond its empty built-in chains — an empty one is left by
// a mere `iptables-legacy -t nat -L` — without running a tool: the kernel's table info
// (IPT_SO_GET_INFO) counts one entry per built-in chain's policy and one end marker in an empty
// table. It asks only when /proc lists the table (asking for a missing one creates it), and
// says yes when it cannot tell.
func legacyNATHasRules(f Family) bool {
	if !natTableExists(BackendLegacy, f) {
		return false
	}
	domain, level := unix.AF_INET, unix.IPPROTO_IP
	if f == IPv6 {
		domain, level = unix.AF_INET6, unix.IPPROTO_IPV6
	}
	sock, err := unix.Socket(domain, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
	if err != nil {
		return true
	}
	defer unix.Close(sock)
	// struct ipt_getinfo (ip6t_getinfo is the same): name, valid_hooks, hook_entry[5],
	// underflow[5], num_entries, size.
	var info struct {
		Name       [32]byte
		ValidHooks uint32
		HookEntry  [5]uint32
		Underflow  [5]uint32
		NumEntries uint32
		Size       uint32
	}
	copy(info.Name[:], "nat")
	const soGetInfo = 64 // IPT_SO_GET_INFO, IP6T_SO_GET_INFO
	size := uint32(unsafe.Sizeof(info))
	if _, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(sock), uintptr(level), soGetInfo,
		uintptr(unsafe.Pointer(&info)), uintptr(unsafe.Pointer(&size)), 0); errno != 0 {
		return true
	}
	return info.NumEntries > uint32(bits.OnesCount32(info.ValidHooks))+1
}
