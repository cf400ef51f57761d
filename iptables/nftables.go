package iptables

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	"golang.org/x/sys/unix"
)

// NFTTable is the name of detour's own nf_tables table (family inet) in a pod's network
// namespace, used by the nftables backend; it never changes, DEL and CHECK rely on it.
const NFTTable = "detour"

// Names of the chains of detour's nf_tables table. The base chains hook where iptables' nat
// chains do, with the same priority (-100, NF_IP_PRI_NAT_DST), so the rules of other tools keep
// their order relative to detour's; each family's rules live in chains of their own, reached
// only by that family's packets.
const (
	NFTPreroutingChain = "prerouting"
	NFTOutputChain     = "output"
)

// NFTInboundChain and NFTOutboundChain are the names of family f's chains in detour's table.
func NFTInboundChain(f Family) string  { return "inbound_" + f.String() }
func NFTOutboundChain(f Family) string { return "outbound_" + f.String() }

// NFTPriority is the priority of both base chains: iptables' nat PREROUTING and OUTPUT.
const NFTPriority = -100

// NFTRuleset is detour's nf_tables table for one or both families: the chains in order, each
// with its rules as native expressions. It is data: [BuildNFT] makes it, [NFTRuleset.String]
// prints it in `nft list` syntax, and the Executor writes it in one netlink transaction.
type NFTRuleset struct {
	Families []Family
	Chains   []NFTChain
}

// NFTChain is one chain of detour's table; Hook is nftables.ChainHookPrerouting or
// nftables.ChainHookOutput for a base chain, nil for a regular one.
type NFTChain struct {
	Name string
	Hook *nftables.ChainHook
	// Type and Priority are those of a base chain: nat and NFTPriority in what BuildNFT makes,
	// whatever the kernel says in a table read back.
	Type     nftables.ChainType
	Priority int32
	Rules    []NFTRule
}

// NFTRule is one rule: its expressions and its detour/... comment (kept in the rule's user
// data, where nft prints it from).
type NFTRule struct {
	Comment string
	Exprs   []expr.Any
}

// BuildNFT returns detour's nf_tables table for the configs, at most one per family. It applies
// the same checks and the same semantics as [Build]: rule for rule, each family's chains hold
// what Build puts in DETOUR_INBOUND and DETOUR_OUTBOUND, except that a multiport list becomes
// one rule per port or range.
func BuildNFT(configs ...Config) (NFTRuleset, error) {
	pre := NFTChain{Name: NFTPreroutingChain, Hook: nftables.ChainHookPrerouting, Type: nftables.ChainTypeNAT, Priority: NFTPriority}
	out := NFTChain{Name: NFTOutputChain, Hook: nftables.ChainHookOutput, Type: nftables.ChainTypeNAT, Priority: NFTPriority}
	var rs NFTRuleset
	var fams []NFTChain
	for _, c := range configs {
		if err := c.validate(); err != nil {
			return NFTRuleset{}, err
		}
		for _, f := range rs.Families {
			if f == c.Family {
				return NFTRuleset{}, fmt.Errorf("build nftables rules: two configs for %s", f)
			}
		}
		rs.Families = append(rs.Families, c.Family)
		in, ob := nftFamilyChains(c)
		pre.Rules = append(pre.Rules, nftJump(c.Family, NFTPreroutingChain))
		out.Rules = append(out.Rules, nftJump(c.Family, NFTOutputChain))
		fams = append(fams, in, ob)
	}
	rs.Chains = append([]NFTChain{pre, out}, fams...)
	return rs, nil
}

// nftFamilyChains are c.Family's inbound and outbound chains; see Build for why each rule is
// where it is.
// nftJump is base chain's rule for family f: its TCP goes to the family's inbound chain
// (prerouting) or outbound chain (output).
func nftJump(f Family, base string) NFTRule {
	if base == NFTPreroutingChain {
		return NFTRule{"detour/inbound", concat(nfproto(f), l4tcp(), jump(NFTInboundChain(f)))}
	}
	return NFTRule{"detour/outbound", concat(nfproto(f), l4tcp(), jump(NFTOutboundChain(f)))}
}

func nftFamilyChains(c Config) (in, out NFTChain) {
	in = NFTChain{Name: NFTInboundChain(c.Family)}
	out = NFTChain{Name: NFTOutboundChain(c.Family)}
	add := func(ch *NFTChain, comment string, exprs ...[]expr.Any) {
		ch.Rules = append(ch.Rules, NFTRule{"detour/" + comment, concat(exprs...)})
	}
	for _, r := range c.SkipInboundPorts {
		add(&in, "skip-inbound-ports", l4tcp(), dport(r.First, r.Last), verdict(expr.VerdictReturn))
	}
	switch {
	case c.InboundListening:
		// The socket lookup finds the listener the packet would reach, if any; its wildcard
		// key is 1 for one on the wildcard address and 0 for one on the packet's own: each
		// rule matches one kind, together every listener (none found: no match).
		add(&in, "redirect-inbound-listening", l4tcp(), socketWildcard(1), redirect(c.InboundPort))
		add(&in, "redirect-inbound-listening", l4tcp(), socketWildcard(0), redirect(c.InboundPort))
	case c.InboundFallback:
		add(&in, inboundFallbackComment, l4tcp(), redirect(c.InboundPort))
	default:
		add(&in, "redirect-inbound", l4tcp(), redirect(c.InboundPort))
	}

	// The same order as Build's (see there): the sentinels first, the proxy UID's to the check
	// port.
	for _, s := range c.sentinels() {
		dst := daddr(netip.PrefixFrom(s.Addr(), s.Addr().BitLen()))
		if c.CheckPort != 0 {
			add(&out, "validator-check", dst, l4tcp(), dport(s.Port(), s.Port()), owner(expr.MetaKeySKUID, c.ProxyUID), redirect(c.CheckPort))
		}
		add(&out, "validator-sentinel", dst, l4tcp(), dport(s.Port(), s.Port()), redirect(c.OutboundPort))
	}
	add(&out, "proxy-uid", owner(expr.MetaKeySKUID, c.ProxyUID), verdict(expr.VerdictReturn))
	for _, uid := range c.ExemptUIDs {
		add(&out, "exempt-uid", owner(expr.MetaKeySKUID, uid), verdict(expr.VerdictReturn))
	}
	for _, gid := range c.ExemptGIDs {
		// meta skgid is the socket's fsgid, the primary group, as xt_owner --gid-owner without
		// --suppl-groups.
		add(&out, "exempt-gid", owner(expr.MetaKeySKGID, gid), verdict(expr.VerdictReturn))
	}
	add(&out, "loopback", oifname("lo"), verdict(expr.VerdictReturn))
	for _, p := range c.SkipOutboundCIDRs {
		if p.Addr().Is4() == (c.Family == IPv4) {
			add(&out, "skip-outbound-cidr", daddr(p), verdict(expr.VerdictReturn))
		}
	}
	for _, r := range c.SkipOutboundPorts {
		add(&out, "skip-outbound-ports", l4tcp(), dport(r.First, r.Last), verdict(expr.VerdictReturn))
	}
	add(&out, "redirect-outbound", l4tcp(), redirect(c.OutboundPort))
	return in, out
}

func concat(parts ...[]expr.Any) []expr.Any {
	var out []expr.Any
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// The expressions, all native: meta, payload, bitwise, cmp, range, immediate, redir, verdict.

func nfproto(f Family) []expr.Any {
	p := byte(unix.NFPROTO_IPV4)
	if f == IPv6 {
		p = unix.NFPROTO_IPV6
	}
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{p}},
	}
}

func l4tcp() []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
	}
}

func dport(first, last uint16) []expr.Any {
	load := &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2}
	if first == last {
		return []expr.Any{load, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(first)}}
	}
	return []expr.Any{load, &expr.Range{Op: expr.CmpOpEq, Register: 1,
		FromData: binaryutil.BigEndian.PutUint16(first), ToData: binaryutil.BigEndian.PutUint16(last)}}
}

func owner(key expr.MetaKey, id uint32) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: key, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(id)},
	}
}

// socketWildcard matches a packet for which the kernel finds a socket (a listener, for a
// connection's first packet) bound to the wildcard address (1) or to a specific one (0).
func socketWildcard(v byte) []expr.Any {
	return []expr.Any{
		&expr.Socket{Key: expr.SocketKeyWildcard, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{v}},
	}
}

func oifname(name string) []expr.Any {
	data := make([]byte, unix.IFNAMSIZ)
	copy(data, name)
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyOIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: data},
	}
}

// daddr matches the destination network p; nothing for a /0, which matches every address of
// the family (the chain is reached by one family only).
func daddr(p netip.Prefix) []expr.Any {
	p = p.Masked()
	if p.Bits() == 0 {
		return nil
	}
	offset, size := uint32(16), uint32(4) // the IPv4 header's destination address
	if p.Addr().Is6() {
		offset, size = 24, 16
	}
	fam := IPv4
	if p.Addr().Is6() {
		fam = IPv6
	}
	// The family match first, as nft writes it in an inet table: the rule then says by itself
	// which header it reads, and nft list prints "ip daddr" rather than raw offsets.
	e := append(nfproto(fam), &expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: offset, Len: size})
	if p.Bits() != p.Addr().BitLen() {
		mask := make([]byte, size)
		for i := range p.Bits() {
			mask[i/8] |= 0x80 >> (i % 8)
		}
		e = append(e, &expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: size, Mask: mask, Xor: make([]byte, size)})
	}
	return append(e, &expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: p.Addr().AsSlice()})
}

// redirect is "redirect to :port", written as nft writes it and as the kernel reports it back
// (the port range's both ends in register 1, the proto-specified flag).
func redirect(port uint16) []expr.Any {
	return []expr.Any{
		&expr.Immediate{Register: 1, Data: binaryutil.BigEndian.PutUint16(port)},
		&expr.Redir{RegisterProtoMin: 1, RegisterProtoMax: 1, Flags: natRangeProtoSpecified},
	}
}

// natRangeProtoSpecified is NF_NAT_RANGE_PROTO_SPECIFIED: the redirect names a port.
const natRangeProtoSpecified = 2

func verdict(k expr.VerdictKind) []expr.Any { return []expr.Any{&expr.Verdict{Kind: k}} }

func jump(chain string) []expr.Any {
	return []expr.Any{&expr.Verdict{Kind: expr.VerdictJump, Chain: chain}}
}

// String renders the table in `nft list table inet detour` syntax.
func (rs NFTRuleset) String() string {
	var b strings.Builder
	b.WriteString("table inet " + NFTTable + " {\n")
	for i, ch := range rs.Chains {
		if i > 0 {
			b.WriteString("\n")
		}
		b.WriteString("\tchain " + ch.Name + " {\n")
		if ch.Hook != nil {
			b.WriteString("\t\t" + baseChainText(ch.Type, ch.Hook, ch.Priority) + "\n")
		}
		for _, r := range ch.Rules {
			b.WriteString("\t\t" + r.String() + "\n")
		}
		b.WriteString("\t}\n")
	}
	b.WriteString("}\n")
	return b.String()
}

// baseChainText is the line nft prints for a nat base chain.
func baseChainText(typ nftables.ChainType, h *nftables.ChainHook, prio int32) string {
	name := map[nftables.ChainHook]string{*nftables.ChainHookPrerouting: "prerouting", *nftables.ChainHookOutput: "output"}[*h]
	if name == "" {
		name = "hook" + strconv.Itoa(int(*h))
	}
	p := strconv.Itoa(int(prio))
	if prio == NFTPriority && *h == *nftables.ChainHookPrerouting {
		p = "dstnat"
	}
	return "type " + string(typ) + " hook " + name + " priority " + p + "; policy accept;"
}

// String renders the rule in nft syntax, with its comment.
func (r NFTRule) String() string {
	s := exprsText(r.Exprs)
	if r.Comment != "" {
		s += ` comment "` + r.Comment + `"`
	}
	return s
}

// userData is the rule's user data as nft writes it: the comment.
func (r NFTRule) userData() []byte {
	if r.Comment == "" {
		return nil
	}
	return userdata.AppendString(nil, userdata.TypeComment, r.Comment)
}

// exprsText renders expressions in nft syntax: the ones BuildNFT uses by name, anything else
// (read from a table someone changed) by its Go value, so a difference is always visible.
func exprsText(exprs []expr.Any) string {
	var words []string
	var load string // what register 1 holds: a meta key or payload field, in nft words
	for i, e := range exprs {
		switch e := e.(type) {
		case *expr.Meta:
			if name, ok := metaNames[e.Key]; ok && e.Register == 1 && !e.SourceRegister {
				load = name
				continue
			}
		case *expr.Payload:
			if name := payloadName(e); name != "" && e.OperationType == expr.PayloadLoad {
				load = name
				continue
			}
		case *expr.Socket:
			if e.Key == expr.SocketKeyWildcard && e.Register == 1 && e.Level == 0 {
				load = "socket wildcard"
				continue
			}
		case *expr.Bitwise:
			if strings.HasSuffix(load, " daddr") && e.SourceRegister == 1 && e.DestRegister == 1 && bytes.Count(e.Xor, []byte{0}) == len(e.Xor) {
				if bits, ok := prefixLen(e.Mask); ok {
					load += "/" + strconv.Itoa(bits)
					continue
				}
			}
		case *expr.Cmp:
			if load != "" && e.Op == expr.CmpOpEq && e.Register == 1 {
				if v, ok := value(load, e.Data); ok {
					words = withDependency(words, v)
					load = ""
					continue
				}
			}
		case *expr.Range:
			if load == "tcp dport" && e.Op == expr.CmpOpEq && e.Register == 1 && len(e.FromData) == 2 && len(e.ToData) == 2 {
				words = withDependency(words, fmt.Sprintf("tcp dport %d-%d", binary.BigEndian.Uint16(e.FromData), binary.BigEndian.Uint16(e.ToData)))
				load = ""
				continue
			}
		case *expr.Immediate:
			if r, ok := next(exprs, i).(*expr.Redir); ok && e.Register == 1 && len(e.Data) == 2 && r.RegisterProtoMin == 1 && r.RegisterProtoMax == 1 && r.Flags == natRangeProtoSpecified {
				load = "redirect to :" + strconv.Itoa(int(binary.BigEndian.Uint16(e.Data)))
				continue
			}
		case *expr.Redir:
			if strings.HasPrefix(load, "redirect to :") {
				words = append(words, load)
				load = ""
				continue
			}
		case *expr.Verdict:
			switch e.Kind {
			case expr.VerdictReturn:
				words = append(words, "return")
				continue
			case expr.VerdictJump:
				words = append(words, "jump "+e.Chain)
				continue
			case expr.VerdictGoto:
				words = append(words, "goto "+e.Chain)
				continue
			case expr.VerdictAccept:
				words = append(words, "accept")
				continue
			case expr.VerdictDrop:
				words = append(words, "drop")
				continue
			}
		}
		if load != "" {
			words = append(words, "["+load+"]")
			load = ""
		}
		words = append(words, fmt.Sprintf("[%T %+v]", e, e))
	}
	if load != "" {
		words = append(words, "["+load+"]")
	}
	return strings.Join(words, " ")
}

// withDependency appends the header match m to words as nft prints it: a "tcp dport" right
// after "meta l4proto tcp", or an "ip daddr" ("ip6 daddr") right after "meta nfproto ipv4"
// ("ipv6"), stands for both; without that match before it, the same header field is printed
// the way nft does for a raw read ("th dport", "@nh,..."), so the text still tells the rules
// apart.
func withDependency(words []string, m string) []string {
	deps := map[string]string{"tcp dport ": "meta l4proto tcp", "ip daddr ": "meta nfproto ipv4", "ip6 daddr ": "meta nfproto ipv6"}
	raw := map[string]string{"tcp dport ": "th dport ", "ip daddr ": "@nh,128,32 ", "ip6 daddr ": "@nh,192,128 "}
	for prefix, dep := range deps {
		if !strings.HasPrefix(m, prefix) {
			continue
		}
		if len(words) > 0 && words[len(words)-1] == dep {
			return append(words[:len(words)-1], m)
		}
		return append(words, raw[prefix]+strings.TrimPrefix(m, prefix))
	}
	return append(words, m)
}

func next(exprs []expr.Any, i int) expr.Any {
	if i+1 < len(exprs) {
		return exprs[i+1]
	}
	return nil
}

var metaNames = map[expr.MetaKey]string{
	expr.MetaKeyNFPROTO: "meta nfproto",
	expr.MetaKeyL4PROTO: "meta l4proto",
	expr.MetaKeySKUID:   "meta skuid",
	expr.MetaKeySKGID:   "meta skgid",
	expr.MetaKeyOIFNAME: "oifname",
}

func payloadName(p *expr.Payload) string {
	if p.DestRegister != 1 || p.CsumType != expr.CsumTypeNone || p.CsumFlags != 0 || p.CsumOffset != 0 {
		return ""
	}
	switch {
	case p.Base == expr.PayloadBaseTransportHeader && p.Offset == 2 && p.Len == 2:
		return "tcp dport"
	case p.Base == expr.PayloadBaseNetworkHeader && p.Offset == 16 && p.Len == 4:
		return "ip daddr"
	case p.Base == expr.PayloadBaseNetworkHeader && p.Offset == 24 && p.Len == 16:
		return "ip6 daddr"
	}
	return ""
}

// value renders the comparison of what load names with data, as nft prints it.
func value(load string, data []byte) (string, bool) {
	field, bits, masked := strings.Cut(load, "/")
	switch field {
	case "meta nfproto":
		if len(data) == 1 && data[0] == unix.NFPROTO_IPV4 {
			return "meta nfproto ipv4", true
		}
		if len(data) == 1 && data[0] == unix.NFPROTO_IPV6 {
			return "meta nfproto ipv6", true
		}
	case "meta l4proto":
		if len(data) == 1 && data[0] == unix.IPPROTO_TCP {
			return "meta l4proto tcp", true
		}
	case "meta skuid", "meta skgid":
		if len(data) == 4 {
			return field + " " + strconv.FormatUint(uint64(binaryutil.NativeEndian.Uint32(data)), 10), true
		}
	case "oifname":
		if len(data) == unix.IFNAMSIZ && bytes.IndexByte(data, 0) > 0 && bytes.Count(data[bytes.IndexByte(data, 0):], []byte{0}) == len(data)-bytes.IndexByte(data, 0) {
			return `oifname "` + string(data[:bytes.IndexByte(data, 0)]) + `"`, true
		}
	case "socket wildcard":
		if len(data) == 1 && data[0] <= 1 {
			return "socket wildcard " + strconv.Itoa(int(data[0])), true
		}
	case "tcp dport":
		if len(data) == 2 {
			return "tcp dport " + strconv.Itoa(int(binary.BigEndian.Uint16(data))), true
		}
	case "ip daddr", "ip6 daddr":
		a, ok := netip.AddrFromSlice(data)
		if !ok || a.Is4() != (field == "ip daddr") {
			return "", false
		}
		if masked {
			n, _ := strconv.Atoi(bits)
			p := netip.PrefixFrom(a, n)
			if p.Masked() != p {
				return "", false
			}
			return field + " " + p.String(), true
		}
		return field + " " + a.String(), true
	}
	return "", false
}

// prefixLen is the length of the network mask m, if it is one.
func prefixLen(m []byte) (int, bool) {
	n := 0
	for n < len(m)*8 && m[n/8]&(0x80>>(n%8)) != 0 {
		n++
	}
	for i := n; i < len(m)*8; i++ {
		if m[i/8]&(0x80>>(i%8)) != 0 {
			return 0, false
		}
	}
	return n, true
}
