package annotations

import (
	"fmt"
	"math"
	"net/netip"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Error is a malformed annotation value: which annotation, which part of its value, and the
// rule that part broke, worded so that the person who wrote it knows what to change.
type Error struct {
	Key   string // the annotation key
	Value string // the offending item (or the whole value)
	Rule  string // what a valid value looks like
}

func (e *Error) Error() string {
	return fmt.Sprintf("annotation %s: %s is not valid: %s", e.Key, Quote(e.Value), e.Rule)
}

// maxQuoted is how much of a value a message repeats. The API server calls the webhook before
// it checks the annotations' size, so a value can be as large as the request (a 1 MiB value
// reached the webhook in the e2e story badinput); repeated whole, it would be all of
// kubectl's output and a line of the webhook's log.
const maxQuoted = 64

// Quote quotes s for a message, as %q does, shortened to its first 64 bytes (and the number of
// bytes in all) when it is longer.
func Quote(s string) string {
	if len(s) <= maxQuoted {
		return strconv.Quote(s)
	}
	cut := maxQuoted
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return fmt.Sprintf("%s (%d bytes in all)", strconv.Quote(s[:cut]+"…"), len(s))
}

func errorf(key, value, rule string, args ...any) error {
	return &Error{Key: key, Value: value, Rule: fmt.Sprintf(rule, args...)}
}

// PortRange is an inclusive range of TCP ports; a single port has First == Last.
type PortRange struct {
	First, Last uint16
}

// String formats r as "25" or "8000-8100".
func (r PortRange) String() string {
	if r.First == r.Last {
		return strconv.Itoa(int(r.First))
	}
	return strconv.Itoa(int(r.First)) + "-" + strconv.Itoa(int(r.Last))
}

const portRule = "ports are whole numbers from 1 to 65535 and ranges are written first-last " +
	"with first <= last, separated by commas (e.g. \"25,3306,8000-8100\")"

// items splits a comma-separated list, trimming spaces; an empty or blank value is an empty list.
func items(key, value string) ([]string, error) {
	if strings.TrimSpace(value) == "" {
		return nil, nil
	}
	parts := strings.Split(value, ",")
	if len(parts) > MaxListItems {
		return nil, errorf(key, value, "at most %d items are allowed, found %d", MaxListItems, len(parts))
	}
	for i, p := range parts {
		parts[i] = strings.TrimSpace(p)
		if parts[i] == "" {
			return nil, errorf(key, value, "the list has an empty item; separate items with single commas")
		}
	}
	return parts, nil
}

// ParsePort parses one TCP port (1–65535) from the annotation key.
func ParsePort(key, value string) (uint16, error) {
	p, ok := port(strings.TrimSpace(value))
	if !ok {
		return 0, errorf(key, value, "a port is a whole number from 1 to 65535")
	}
	return p, nil
}

func port(s string) (uint16, bool) {
	n, err := strconv.ParseUint(s, 10, 16)
	if err != nil || n == 0 || s[0] == '+' {
		return 0, false
	}
	return uint16(n), true
}

// ParsePorts parses a list of ports and ranges such as "25,3306,8000-8100".
func ParsePorts(key, value string) ([]PortRange, error) {
	parts, err := items(key, value)
	if err != nil {
		return nil, err
	}
	var out []PortRange
	for _, p := range parts {
		first, last, isRange := strings.Cut(p, "-")
		if !isRange {
			last = first
		}
		a, ok1 := port(strings.TrimSpace(first))
		b, ok2 := port(strings.TrimSpace(last))
		if !ok1 || !ok2 {
			return nil, errorf(key, p, portRule)
		}
		if a > b {
			return nil, errorf(key, p, "the range's first port is above its last; write it as %d-%d", b, a)
		}
		out = append(out, PortRange{First: a, Last: b})
	}
	return out, nil
}

// FormatPorts formats ranges as ParsePorts reads them.
func FormatPorts(ranges []PortRange) string {
	s := make([]string, len(ranges))
	for i, r := range ranges {
		s[i] = r.String()
	}
	return strings.Join(s, ",")
}

// ParseCIDRs parses a list of IPv4 and IPv6 networks such as "10.0.0.0/8,fd00::/8"; a bare
// address is a single-host network (/32 or /128).
func ParseCIDRs(key, value string) ([]netip.Prefix, error) {
	parts, err := items(key, value)
	if err != nil {
		return nil, err
	}
	var out []netip.Prefix
	for _, p := range parts {
		prefix, err := cidr(p)
		if err != nil {
			return nil, errorf(key, p, "%s", err)
		}
		out = append(out, prefix)
	}
	return out, nil
}

func cidr(s string) (netip.Prefix, error) {
	const rule = "a CIDR is an IPv4 or IPv6 network such as 10.0.0.0/8 or fd00::/8, or a single address"
	if strings.Contains(s, "%") {
		return netip.Prefix{}, fmt.Errorf("zoned addresses are not allowed; %s", rule)
	}
	if !strings.Contains(s, "/") {
		addr, err := netip.ParseAddr(s)
		if err != nil {
			return netip.Prefix{}, fmt.Errorf("%s", rule)
		}
		prefix := netip.PrefixFrom(addr, addr.BitLen())
		return prefix, unmapped(prefix)
	}
	prefix, err := netip.ParsePrefix(s)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("%s", rule)
	}
	if masked := prefix.Masked(); masked != prefix {
		return netip.Prefix{}, fmt.Errorf("the address has bits set beyond the /%d prefix; write the network as %s", prefix.Bits(), masked)
	}
	return prefix, unmapped(prefix)
}

// unmapped rejects an IPv4-mapped IPv6 network (::ffff:a.b.c.d): the IPv4 traffic it names
// never meets the IPv6 rules, so skipping it would skip nothing. The error gives the IPv4 form.
func unmapped(p netip.Prefix) error {
	if !p.Addr().Is4In6() || p.Bits() < 96 {
		return nil
	}
	const why = "IPv4-mapped IPv6 addresses reach only the IPv6 rules, so the IPv4 traffic they name would still be redirected"
	v4 := netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
	if v4.IsSingleIP() {
		return fmt.Errorf("%s; write the IPv4 address %s", why, v4.Addr())
	}
	return fmt.Errorf("%s; write the IPv4 network %s", why, v4)
}

// FormatCIDRs formats networks as ParseCIDRs reads them.
func FormatCIDRs(prefixes []netip.Prefix) string {
	s := make([]string, len(prefixes))
	for i, p := range prefixes {
		s[i] = p.String()
	}
	return strings.Join(s, ",")
}

const idRule = "a UID or GID is a whole number from 1 to 4294967294 (0, root, is never exempt)"

// ParseID parses one non-zero UID or GID in decimal.
func ParseID(key, value string) (uint32, error) {
	id, ok := parseID(strings.TrimSpace(value))
	if !ok {
		return 0, errorf(key, value, idRule)
	}
	return id, nil
}

func parseID(s string) (uint32, bool) {
	n, err := strconv.ParseUint(s, 10, 32)
	// 4294967295 is (uid_t)-1, which the kernel treats as "no change", never a real owner.
	if err != nil || n == 0 || n == math.MaxUint32 || s[0] == '+' {
		return 0, false
	}
	return uint32(n), true
}

// ParseIDs parses a list of non-zero UIDs or GIDs such as "1000,1001".
func ParseIDs(key, value string) ([]uint32, error) {
	parts, err := items(key, value)
	if err != nil {
		return nil, err
	}
	var out []uint32
	for _, p := range parts {
		id, ok := parseID(p)
		if !ok {
			return nil, errorf(key, p, idRule)
		}
		out = append(out, id)
	}
	return out, nil
}

// FormatIDs formats IDs as ParseIDs reads them.
func FormatIDs(ids []uint32) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = strconv.FormatUint(uint64(id), 10)
	}
	return strings.Join(s, ",")
}

const sentinelRule = "a sentinel is a unicast IPv4 or IPv6 address outside the pod and a port, " +
	"such as 203.0.113.254:80 or [2001:db8::fe]:80"

// ParseSentinels parses a list of TCP destinations such as "203.0.113.254:80,[2001:db8::fe]:80":
// unicast addresses that are not loopback (which the redirect never touches), with a port.
func ParseSentinels(key, value string) ([]netip.AddrPort, error) {
	parts, err := items(key, value)
	if err != nil {
		return nil, err
	}
	var out []netip.AddrPort
	for _, p := range parts {
		ap, err := netip.ParseAddrPort(p)
		a := ap.Addr()
		if err != nil || ap.Port() == 0 || a.Zone() != "" || a.Is4In6() || a.IsLoopback() || a.IsUnspecified() || a.IsMulticast() {
			return nil, errorf(key, p, sentinelRule)
		}
		out = append(out, ap)
	}
	return out, nil
}

// FormatSentinels formats destinations as ParseSentinels reads them.
func FormatSentinels(aps []netip.AddrPort) string {
	s := make([]string, len(aps))
	for i, ap := range aps {
		s[i] = ap.String()
	}
	return strings.Join(s, ",")
}
