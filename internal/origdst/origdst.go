// Package origdst reads the destination a redirected TCP connection was originally sent to
// (SO_ORIGINAL_DST for IPv4, IP6T_SO_ORIGINAL_DST for IPv6), as a transparent proxy does.
package origdst

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"unsafe"

	"golang.org/x/sys/unix"
)

// soOriginalDst is SO_ORIGINAL_DST (linux/netfilter_ipv4.h) and IP6T_SO_ORIGINAL_DST
// (linux/netfilter_ipv6/ip6_tables.h); both are 80.
const soOriginalDst = 80

// Get returns the original destination of an accepted connection: where the client sent it
// before a REDIRECT rule delivered it here. For a connection that was not redirected it is the
// connection's own local address.
func Get(c *net.TCPConn) (netip.AddrPort, error) {
	local, ok := c.LocalAddr().(*net.TCPAddr)
	if !ok {
		return netip.AddrPort{}, fmt.Errorf("original destination: local address %v is not TCP", c.LocalAddr())
	}
	v4 := local.IP.To4() != nil
	raw, err := c.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("original destination: %w", err)
	}
	var buf [unix.SizeofSockaddrInet6]byte
	var sockErr error
	err = raw.Control(func(fd uintptr) {
		level := unix.SOL_IPV6
		if v4 {
			level = unix.SOL_IP
		}
		size := uint32(len(buf))
		_, _, errno := unix.Syscall6(unix.SYS_GETSOCKOPT, fd, uintptr(level), soOriginalDst,
			uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&size)), 0)
		if errno != 0 {
			sockErr = errno
		}
	})
	if err == nil {
		err = sockErr
	}
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("original destination of %v: %w", c.RemoteAddr(), err)
	}
	// struct sockaddr_in{,6}: family (host order), port (network order), then the address
	// (sockaddr_in6 has 4 bytes of flow info before it).
	port := binary.BigEndian.Uint16(buf[2:4])
	if v4 {
		return netip.AddrPortFrom(netip.AddrFrom4([4]byte(buf[4:8])), port), nil
	}
	return netip.AddrPortFrom(netip.AddrFrom16([16]byte(buf[8:24])), port), nil
}
