package validator

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"
)

// socketTables is where the kernel lists the TCP sockets of the calling thread's network
// namespace — the pod's, where the check runs. The thread's, not the process's (/proc/self is
// the main thread's), so that a check run on a thread that entered another namespace (as the
// tests do) reads the namespace it listened in.
const socketTables = "/proc/thread-self/net/"

// tcpListen is the LISTEN state in the st column of /proc/net/tcp (TCP_LISTEN in the kernel).
const tcpListen = 0x0A

// socket is one row of /proc/net/tcp or /proc/net/tcp6: a TCP socket of the network namespace.
type socket struct {
	local netip.AddrPort
	state uint8
	uid   uint32 // the socket's owner: the UID of the process that created it
}

// parseSocketTable parses the text of /proc/net/tcp or /proc/net/tcp6: a header line, then one
// socket a line. The kernel prints each 32-bit word of an address as a number in hexadecimal,
// so its bytes are in the byte order of the machine (binary.NativeEndian; the tests' lines are
// from little-endian machines); the port is a number. An error names the first line that is
// not a socket: the format changed, and no socket of the table can be trusted.
func parseSocketTable(table []byte, order binary.ByteOrder) ([]socket, error) {
	var out []socket
	lines := bufio.NewScanner(bytes.NewReader(table))
	for n := 1; lines.Scan(); n++ {
		fields := strings.Fields(lines.Text())
		if len(fields) == 0 || n == 1 && fields[0] == "sl" {
			continue
		}
		s, err := parseSocketLine(fields, order)
		if err != nil {
			return nil, fmt.Errorf("line %d: %w", n, err)
		}
		out = append(out, s)
	}
	if err := lines.Err(); err != nil {
		return nil, err
	}
	return out, nil
}

// parseSocketLine parses the fields of one socket's line: sl, local_address, rem_address, st,
// tx_queue:rx_queue, tr:tm->when, retrnsmt, uid, and more that the check does not need.
func parseSocketLine(fields []string, order binary.ByteOrder) (socket, error) {
	if len(fields) < 8 || !strings.HasSuffix(fields[0], ":") {
		return socket{}, fmt.Errorf("not a socket: %q", truncate(strings.Join(fields, " "), 60))
	}
	local, err := parseSocketAddr(fields[1], order)
	if err != nil {
		return socket{}, fmt.Errorf("local address %q: %w", truncate(fields[1], 60), err)
	}
	state, err := strconv.ParseUint(fields[3], 16, 8)
	if err != nil {
		return socket{}, fmt.Errorf("state %q: %w", truncate(fields[3], 20), errors.Unwrap(err))
	}
	uid, err := strconv.ParseUint(fields[7], 10, 32)
	if err != nil {
		return socket{}, fmt.Errorf("uid %q: %w", truncate(fields[7], 20), errors.Unwrap(err))
	}
	return socket{local: local, state: uint8(state), uid: uint32(uid)}, nil
}

// parseSocketAddr parses an address of the table, "0100007F:102E": 8 hexadecimal digits for
// IPv4, 32 for IPv6 (four words), a colon and the port in 4.
func parseSocketAddr(s string, order binary.ByteOrder) (netip.AddrPort, error) {
	addrHex, portHex, ok := strings.Cut(s, ":")
	if !ok || len(portHex) != 4 || (len(addrHex) != 8 && len(addrHex) != 32) {
		return netip.AddrPort{}, errors.New("want 8 or 32 hexadecimal digits, a colon and 4 more")
	}
	port, err := strconv.ParseUint(portHex, 16, 16)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("port: %w", errors.Unwrap(err))
	}
	raw, err := hex.DecodeString(addrHex)
	if err != nil {
		return netip.AddrPort{}, err
	}
	// Each word was printed as a number: put its bytes back in the order the machine holds them.
	for i := 0; i < len(raw); i += 4 {
		order.PutUint32(raw[i:], binary.BigEndian.Uint32(raw[i:]))
	}
	addr, _ := netip.AddrFromSlice(raw)
	return netip.AddrPortFrom(addr, uint16(port)), nil
}

// readSockets reads the namespace's IPv4 and IPv6 socket tables.
func readSockets() ([]socket, error) {
	var all []socket
	for _, name := range []string{"tcp", "tcp6"} {
		path := socketTables + name
		b, err := os.ReadFile(path)
		if errors.Is(err, os.ErrNotExist) && name == "tcp6" {
			continue // a kernel without IPv6
		}
		if err != nil {
			return nil, err
		}
		socks, err := parseSocketTable(b, binary.NativeEndian)
		if err != nil {
			return nil, fmt.Errorf("parse %s: %w", path, err)
		}
		all = append(all, socks...)
	}
	return all, nil
}

// holders returns the sockets of socks that keep a listener from binding to addr: those in
// LISTEN on its port, at the same address or at the unspecified one (0.0.0.0 or ::, which an
// IPv6 socket may also hold for IPv4).
func holders(socks []socket, addr netip.AddrPort) []socket {
	var out []socket
	for _, s := range socks {
		if s.state != tcpListen || s.local.Port() != addr.Port() {
			continue
		}
		a := s.local.Addr()
		if a.IsUnspecified() || a.Unmap() == addr.Addr().Unmap() {
			out = append(out, s)
		}
	}
	return out
}

// portUse says where the check's listener is, which says who may hold its port and what to do.
type portUse int

const (
	// inValidator: the detour-validator init container, on the proxy's outbound port.
	inValidator portUse = iota
	// onCheckPort: the check at the proxy's start, on the check port (validator.checkPort).
	onCheckPort
	// onOutboundPort: the check at the proxy's start, on the proxy's outbound port, where a
	// node's detour-cni that predates the check port redirects it (--fallback-port).
	onOutboundPort
)

// portInUse is the ExitPortInUse error of a listener on addr (the check's own, on loopback):
// who holds the port (from socks, the namespace's sockets, or lookupErr when they could not be
// read), whose UID the check runs as (self), and what to do, in the words of where the check
// runs.
func portInUse(use portUse, addr netip.AddrPort, socks []socket, lookupErr error, self uint32) *Error {
	port := addr.Port()
	who := "the validator"
	if use != inValidator {
		who = "the proxy"
	}
	var b strings.Builder
	if held := holders(socks, addr); len(held) > 0 && lookupErr == nil {
		fmt.Fprintf(&b, "port %d is taken by ", port)
		if len(held) > 1 {
			b.WriteString("sockets listening on ")
		} else {
			b.WriteString("a socket listening on ")
		}
		others := false
		for i, s := range held {
			if i > 0 {
				b.WriteString(" and ")
			}
			fmt.Fprintf(&b, "%s owned by uid %d", s.local, s.uid)
			others = others || s.uid != self
		}
		if others {
			fmt.Fprintf(&b, ", not by %s (uid %d)", who, self)
		} else {
			fmt.Fprintf(&b, ", the UID %s runs as (uid %d): another container of this pod runs as that UID", who, self)
		}
	} else {
		fmt.Fprintf(&b, "port %d is already in use in this pod's network namespace (listen on %s: address already in use", port, addr)
		if lookupErr != nil {
			fmt.Fprintf(&b, "; who holds it is unknown: %v)", lookupErr)
		} else {
			b.WriteString("; no socket listens on it now in /proc/net/tcp or tcp6: it may have closed since)")
		}
	}
	switch use {
	case onCheckPort:
		b.WriteString(": a container of this pod listens on the port where the redirect check at the proxy's start listens (validator.checkPort). " +
			"The check cannot run while it does, so the proxy cannot start again until the pod is recreated: " +
			"move that container's port, or have the cluster admin set the webhook's validator.checkPort to a port no container of the pod uses")
	case onOutboundPort:
		b.WriteString(": the check at the proxy's start listens on the proxy's outbound port here (this node's detour-cni predates the check port), " +
			"and a container of this pod listens there, where the proxy must listen itself: move that container's port")
	default:
		b.WriteString(": the validator must listen on the proxy's outbound port itself to prove the redirect, and it runs first, so nothing of the pod should listen there yet: " +
			"check that --port is the pod's detour.dev/proxy-outbound-port and that no init container or native sidecar listening on it starts before detour-validator")
	}
	return &Error{Code: ExitPortInUse, Msg: b.String()}
}

// Listener is a TCP socket listening in a network namespace, and the UID that owns it.
type Listener struct {
	Addr netip.AddrPort
	UID  uint32
}

// ListenersOn returns the sockets listening on port, on any address, in the calling thread's
// network namespace (enter a pod's with nsutil.Do first): what would keep the check from
// listening there. `detour check` asks it of a pod's check port, which an app that listens on it
// takes from the check at the proxy's next start.
func ListenersOn(port uint16) ([]Listener, error) {
	socks, err := readSockets()
	if err != nil {
		return nil, err
	}
	var out []Listener
	for _, s := range socks {
		if s.state == tcpListen && s.local.Port() == port {
			out = append(out, Listener{Addr: s.local, UID: s.uid})
		}
	}
	return out, nil
}
