package validator

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
)

// Socket tables as a little-endian machine's kernel prints them: a pod's namespace with an app
// listening on 0.0.0.0:4142 and [::]:4142 as uid 1000, the proxy on 127.0.0.1:8080 and [::1]:4002,
// the validator's connection to a sentinel (SYN_SENT), a connection in TIME_WAIT on 4142 (uid
// and inode 0, fewer columns), and the IPv6 ones.
const (
	tcpHeader  = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode                                                     \n"
	tcp6Header = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"

	appTCP    = "   0: 00000000:102E 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 48213 1 0000000000000000 100 0 0 10 0                     \n"
	proxyTCP  = "   1: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  2102        0 48301 1 0000000000000000 100 0 0 10 0                     \n"
	synSent   = "   2: 0200FA0A:C2D6 FE7100CB:0050 02 00000001:00000000 01:00000FA0 00000002  2103        0 48400 2 0000000000000000 200 0 0 10 -1                    \n"
	timeWait  = "   3: 0100007F:102E 0100007F:9C40 06 00000000:00000000 03:00001770 00000000     0        0 0 3 0000000000000000\n"
	appTCP6   = "   0: 00000000000000000000000000000000:102E 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 51234 1 0000000000000000 100 0 0 10 0\n"
	proxyTCP6 = "   1: 00000000000000000000000001000000:0FA2 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  2102        0 51240 1 0000000000000000 100 0 0 10 0\n"
	synSent6  = "   2: 000025FD000000000000000002000000:C350 B80D01200000000000000000FE000000:0050 02 00000001:00000000 01:00000FA0 00000002  2103        0 51300 2 0000000000000000 200 0 0 10 -1\n"
	mapped6   = "   3: 0000000000000000FFFF00000100007F:102E 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000    65534        0 51301 1 0000000000000000 100 0 0 10 0\n"
)

func sock(addr string, state uint8, uid uint32) socket {
	return socket{local: netip.MustParseAddrPort(addr), state: state, uid: uid}
}

func TestParseSocketTable(t *testing.T) {
	for _, tc := range []struct {
		name  string
		table string
		order binary.ByteOrder
		want  []socket
		err   string
	}{
		{"ipv4, several sockets", tcpHeader + appTCP + proxyTCP + synSent + timeWait, binary.LittleEndian, []socket{
			sock("0.0.0.0:4142", tcpListen, 1000), sock("127.0.0.1:8080", tcpListen, 2102),
			sock("10.250.0.2:49878", 0x02, 2103), sock("127.0.0.1:4142", 0x06, 0),
		}, ""},
		{"ipv6, several sockets", tcp6Header + appTCP6 + proxyTCP6 + synSent6 + mapped6, binary.LittleEndian, []socket{
			sock("[::]:4142", tcpListen, 1000), sock("[::1]:4002", tcpListen, 2102),
			sock("[fd25::2]:50000", 0x02, 2103), sock("[::ffff:127.0.0.1]:4142", tcpListen, 65534),
		}, ""},
		{"none listening", tcpHeader + synSent + timeWait, binary.LittleEndian, []socket{
			sock("10.250.0.2:49878", 0x02, 2103), sock("127.0.0.1:4142", 0x06, 0),
		}, ""},
		{"header only", tcpHeader, binary.LittleEndian, nil, ""},
		{"empty", "", binary.LittleEndian, nil, ""},
		{"a big-endian machine", tcpHeader + "   0: 7F000001:102E 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 1 1 0\n", binary.BigEndian,
			[]socket{sock("127.0.0.1:4142", tcpListen, 1000)}, ""},
		{"no header", appTCP, binary.LittleEndian, []socket{sock("0.0.0.0:4142", tcpListen, 1000)}, ""},
		{"a short line", tcpHeader + "   0: 00000000:102E 00000000:0000 0A\n", binary.LittleEndian, nil, "line 2: not a socket"},
		{"a bad address", tcpHeader + strings.Replace(appTCP, "00000000:102E", "0000000:102E", 1), binary.LittleEndian, nil, `line 2: local address "0000000:102E"`},
		{"a bad hex digit", tcpHeader + strings.Replace(appTCP, "00000000:102E", "0000000G:102E", 1), binary.LittleEndian, nil, "line 2: local address"},
		{"a bad uid", tcpHeader + strings.Replace(appTCP, "  1000  ", " -1000  ", 1), binary.LittleEndian, nil, `line 2: uid "-1000"`},
		{"a bad state", tcpHeader + strings.Replace(appTCP, " 0A ", " XY ", 1), binary.LittleEndian, nil, `line 2: state "XY"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseSocketTable([]byte(tc.table), tc.order)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("parseSocketTable = %v, %v; want an error containing %q", got, err, tc.err)
				}
				return
			}
			if err != nil || !slices.Equal(got, tc.want) {
				t.Errorf("parseSocketTable = %v, %v\nwant %v", got, err, tc.want)
			}
		})
	}
}

// Only a socket in LISTEN on the port, at the address the check listens on or an unspecified
// one, keeps the check from listening.
func TestHolders(t *testing.T) {
	socks := []socket{
		sock("0.0.0.0:4142", tcpListen, 1000), sock("127.0.0.1:8080", tcpListen, 2102), sock("10.250.0.2:4142", tcpListen, 1001),
		sock("127.0.0.1:4142", 0x06, 0), sock("[::]:4142", tcpListen, 1002), sock("[::1]:4142", tcpListen, 1003),
		sock("[::ffff:127.0.0.1]:4142", tcpListen, 1004),
	}
	for _, tc := range []struct {
		addr string
		want []uint32
	}{
		{"127.0.0.1:4142", []uint32{1000, 1002, 1004}},
		{"[::1]:4142", []uint32{1000, 1002, 1003}},
		{"127.0.0.1:4140", nil},
	} {
		var got []uint32
		for _, s := range holders(socks, netip.MustParseAddrPort(tc.addr)) {
			got = append(got, s.uid)
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("holders of %s: uids %v, want %v", tc.addr, got, tc.want)
		}
	}
}

// The message of exit 43 names who holds the port and says what to do where the check runs.
func TestPortInUseMessage(t *testing.T) {
	check := netip.MustParseAddrPort("127.0.0.1:4142")
	outbound := netip.MustParseAddrPort("127.0.0.1:4140")
	app := []socket{sock("0.0.0.0:4142", tcpListen, 1000), sock("0.0.0.0:4140", tcpListen, 1000), sock("127.0.0.1:8080", tcpListen, 2102)}
	for _, tc := range []struct {
		name      string
		use       portUse
		addr      netip.AddrPort
		socks     []socket
		lookupErr error
		self      uint32
		want      []string // the message's beginning (the whole message in the first case), then parts of it
	}{
		{"at the proxy's start: an app on the check port", onCheckPort, check, app, nil, 2102, []string{
			"port 4142 is taken by a socket listening on 0.0.0.0:4142 owned by uid 1000, not by the proxy (uid 2102): a container of this pod listens on the port where the redirect check at the proxy's start listens (validator.checkPort). " +
				"The check cannot run while it does, so the proxy cannot start again until the pod is recreated: move that container's port, or have the cluster admin set the webhook's validator.checkPort to a port no container of the pod uses"}},
		{"at the proxy's start: on the outbound port (a plugin from before the check port)", onOutboundPort, outbound, app, nil, 2102, []string{
			"port 4140 is taken by a socket listening on 0.0.0.0:4140 owned by uid 1000, not by the proxy (uid 2102): ", "(this node's detour-cni predates the check port)", "move that container's port"}},
		{"the validator container", inValidator, outbound, app, nil, 2103, []string{
			"port 4140 is taken by a socket listening on 0.0.0.0:4140 owned by uid 1000, not by the validator (uid 2103): ", "detour.dev/proxy-outbound-port", "starts before detour-validator"}},
		{"the proxy's own UID", onCheckPort, check, []socket{sock("0.0.0.0:4142", tcpListen, 2102)}, nil, 2102, []string{
			"port 4142 is taken by a socket listening on 0.0.0.0:4142 owned by uid 2102, the UID the proxy runs as (uid 2102): another container of this pod runs as that UID: ", "validator.checkPort"}},
		{"two sockets", onCheckPort, check, []socket{sock("0.0.0.0:4142", tcpListen, 1000), sock("[::]:4142", tcpListen, 1000)}, nil, 2102, []string{
			"port 4142 is taken by sockets listening on 0.0.0.0:4142 owned by uid 1000 and [::]:4142 owned by uid 1000, not by the proxy (uid 2102): "}},
		{"none listening any more", onCheckPort, check, []socket{sock("127.0.0.1:4142", 0x06, 0)}, nil, 2102, []string{
			"port 4142 is already in use in this pod's network namespace (listen on 127.0.0.1:4142: address already in use; no socket listens on it now in /proc/net/tcp or tcp6: it may have closed since): a container of this pod listens"}},
		{"the tables unreadable", inValidator, outbound, nil, errors.New("open /proc/thread-self/net/tcp: permission denied"), 2103, []string{
			"port 4140 is already in use in this pod's network namespace (listen on 127.0.0.1:4140: address already in use; who holds it is unknown: open /proc/thread-self/net/tcp: permission denied): the validator must listen"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := portInUse(tc.use, tc.addr, tc.socks, tc.lookupErr, tc.self)
			if err.Code != ExitPortInUse || strings.Contains(err.Msg, "\n") {
				t.Errorf("exit code %d, message %q: want %d on one line", err.Code, err.Msg, ExitPortInUse)
			}
			if !strings.HasPrefix(err.Msg, tc.want[0]) {
				t.Errorf("message\n%s\ndoes not start with\n%s", err.Msg, tc.want[0])
			}
			for _, w := range tc.want[1:] {
				if !strings.Contains(err.Msg, w) {
					t.Errorf("message\n%s\nlacks\n%s", err.Msg, w)
				}
			}
		})
	}
}

// formatSocket prints s as a little-endian kernel prints a line of its table.
func formatSocket(i int, s socket) string {
	raw := s.local.Addr().AsSlice()
	var addr strings.Builder
	for w := 0; w < len(raw); w += 4 {
		fmt.Fprintf(&addr, "%08X", binary.LittleEndian.Uint32(raw[w:]))
	}
	zero := strings.Repeat("0", addr.Len())
	return fmt.Sprintf("%4d: %s:%04X %s:0000 %02X 00000000:00000000 00:00000000 00000000 %5d        0 %d 1 0000000000000000 100 0 0 10 0\n",
		i, addr.String(), s.local.Port(), zero, s.state, s.uid, 1000+i)
}

// Whatever the table holds, the parser does not panic, and what it accepts prints back as the
// same sockets: an address of 4 or 16 bytes, the port, state and uid as they were.
func FuzzParseSocketTable(f *testing.F) {
	for _, table := range []string{
		tcpHeader + appTCP + proxyTCP + synSent + timeWait,
		tcp6Header + appTCP6 + proxyTCP6 + synSent6 + mapped6,
		tcpHeader, "", "   0: 00000000:102E 00000000:0000 0A\n", appTCP + "\n\n" + appTCP6,
	} {
		f.Add([]byte(table), false)
		f.Add([]byte(table), true)
	}
	f.Fuzz(func(t *testing.T, table []byte, bigEndian bool) {
		var order binary.ByteOrder = binary.LittleEndian
		if bigEndian {
			order = binary.BigEndian
		}
		socks, err := parseSocketTable(table, order)
		if err != nil {
			return
		}
		for _, s := range socks {
			if !s.local.Addr().IsValid() || s.local.Addr().Zone() != "" {
				t.Fatalf("accepted a socket without a valid address: %+v", s)
			}
		}
		if bigEndian {
			return // formatSocket prints little-endian tables
		}
		var back strings.Builder
		back.WriteString(tcpHeader)
		for i, s := range socks {
			back.WriteString(formatSocket(i, s))
		}
		again, err := parseSocketTable([]byte(back.String()), order)
		if err != nil || !slices.Equal(again, socks) {
			t.Fatalf("%v does not parse back from\n%s: %v, %v", socks, back.String(), again, err)
		}
	})
}
