package iptables

import (
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	"github.com/detourmesh/detour/annotations"
)

// Family is an IP family; each has its own nat table and tools (iptables, ip6tables).
type Family int

const (
	IPv4 Family = iota
	IPv6
)

func (f Family) String() string {
	if f == IPv6 {
		return "ipv6"
	}
	return "ipv4"
}

// Chain names never change: DEL, CHECK and people reading iptables-save rely on them.
const (
	InboundChain  = "DETOUR_INBOUND"
	OutboundChain = "DETOUR_OUTBOUND"
)

// maxMultiport is the kernel's limit of ports in one multiport match; a range counts twice.
const maxMultiport = 15

// Config is what the ruleset is built from; the CNI plugin fills it from a pod's annotations.
type Config struct {
	Family            Family
	ProxyUID          uint32
	InboundPort       uint16
	OutboundPort      uint16
	SkipInboundPorts  []annotations.PortRange
	SkipOutboundPorts []annotations.PortRange
	// SkipOutboundCIDRs may mix families; Build keeps those of Family.
	SkipOutboundCIDRs []netip.Prefix
	ExemptUIDs        []uint32
	ExemptGIDs        []uint32
	// Sentinels are the validator's probe destinations; may mix families, Build keeps those of
	// Family. They are redirected ahead of the skip lists, so the validator passes whenever the
	// rules are installed, whatever the pod's skip lists say.
	Sentinels []netip.AddrPort
	// InboundListening redirects an inbound connection to the proxy only where a socket of the
	// pod listens on its destination address and port (the kernel's own socket lookup: a
	// wildcard listener, or one on that address), so that a client or a kubelet probe meets
	// what the app does; false redirects every inbound connection, as detour did before it.
	InboundListening bool
	// InboundFallback is a pod that asked for InboundListening on a kernel that refused the
	// socket lookup when ADD ran (no xt_socket, nft_socket): every inbound connection goes to
	// the proxy, under a comment of its own (detour/redirect-inbound-fallback), so that CNI
	// CHECK and `detour check` read from the rules themselves that ADD fell back, whatever the
	// kernel can do by the time they run ([InboundFallback]).
	InboundFallback bool
	// CheckPort is where the proxy UID's connections to the sentinels are redirected: the check
	// at the proxy's start listens there. 0 (a pod injected before detour wrote
	// detour.dev/validator-check-port) sends them to OutboundPort, as detour did then.
	CheckPort uint16
}

// ConfigFromRedirect is the Config for one family from a pod's webhook-written annotations.
func ConfigFromRedirect(r annotations.Redirect, f Family) Config {
	return Config{
		Family:            f,
		ProxyUID:          r.ProxyUID,
		InboundPort:       r.InboundPort,
		OutboundPort:      r.OutboundPort,
		SkipInboundPorts:  r.SkipInboundPorts,
		SkipOutboundPorts: r.SkipOutboundPorts,
		SkipOutboundCIDRs: r.SkipOutboundCIDRs,
		ExemptUIDs:        r.ExemptUIDs,
		ExemptGIDs:        r.ExemptGIDs,
		Sentinels:         r.Sentinels,
		CheckPort:         r.CheckPort,
		InboundListening:  r.InboundListening,
	}
}

// BuildFamilies builds the ruleset of each of families from a pod's webhook-written
// annotations, in that order.
func BuildFamilies(r annotations.Redirect, families ...Family) ([]Ruleset, error) {
	rulesets := make([]Ruleset, 0, len(families))
	for _, f := range families {
		rs, err := Build(ConfigFromRedirect(r, f))
		if err != nil {
			return nil, err
		}
		rulesets = append(rulesets, rs)
	}
	return rulesets, nil
}

// Rule is one rule in the form iptables-save prints it, without the "-A CHAIN" prefix.
type Rule struct {
	Chain string
	Spec  string
}

func (r Rule) String() string { return "-A " + r.Chain + " " + r.Spec }

// Ruleset is detour's nat rules for one family: the jumps that hook its chains into the
// built-in PREROUTING and OUTPUT chains, and the rules of its own chains, in order.
type Ruleset struct {
	Family Family
	Hooks  []Rule
	Rules  []Rule
	// Config is what the ruleset was built from; the nftables backend builds its table from it.
	Config Config
}

// Chains returns detour's own chains in the order iptables-save lists them.
func Chains() []string { return []string{InboundChain, OutboundChain} }

// validate refuses a configuration that no ruleset, iptables or nftables, may be built from.
func (c Config) validate() error {
	switch {
	case c.ProxyUID == 0:
		return errors.New("build rules: the proxy UID must not be 0 (root's traffic would bypass the proxy)")
	case c.InboundPort == 0 || c.OutboundPort == 0:
		return fmt.Errorf("build rules: proxy ports must be 1-65535, got inbound %d and outbound %d", c.InboundPort, c.OutboundPort)
	case c.CheckPort != 0 && (c.CheckPort == c.OutboundPort || c.CheckPort == c.InboundPort):
		return fmt.Errorf("build rules: the check port %d must differ from the proxy's ports (a proxy forwarding a connection to a sentinel would reach itself again)", c.CheckPort)
	case c.InboundListening && c.InboundFallback:
		return errors.New("build rules: the inbound rule is either the socket lookup's or its fallback, not both")
	}
	return nil
}

// Build returns the ruleset for c. It fails only on a config no pod should have: a proxy UID
// of 0 (root would bypass the redirect) or a zero proxy port.
func Build(c Config) (Ruleset, error) {
	if err := c.validate(); err != nil {
		return Ruleset{}, err
	}
	rs := Ruleset{Family: c.Family, Hooks: hooks(), Config: c}
	add := func(chain, spec string) { rs.Rules = append(rs.Rules, Rule{chain, spec}) }

	// Inbound: TCP that arrives goes to the proxy, except the skipped ports — with
	// InboundListening only where a socket of the pod listens on the destination (xt_socket
	// with --nowildcard: a listener on the wildcard address or on that address; without it,
	// xt_socket ignores wildcard listeners). Anything else passes untouched, and the kernel
	// answers as it would without a mesh: refused where nothing listens, a port bound to
	// 127.0.0.1 unreachable from outside.
	for _, ports := range multiport(c.SkipInboundPorts) {
		add(InboundChain, "-p tcp -m multiport --dports "+ports+comment("skip-inbound-ports")+" -j RETURN")
	}
	switch {
	case c.InboundListening:
		add(InboundChain, "-p tcp -m socket --nowildcard"+comment("redirect-inbound-listening")+" -j REDIRECT --to-ports "+strconv.Itoa(int(c.InboundPort)))
	case c.InboundFallback:
		add(InboundChain, "-p tcp"+comment(inboundFallbackComment)+" -j REDIRECT --to-ports "+strconv.Itoa(int(c.InboundPort)))
	default:
		add(InboundChain, "-p tcp"+comment("redirect-inbound")+" -j REDIRECT --to-ports "+strconv.Itoa(int(c.InboundPort)))
	}

	// Outbound: the validator's probes first, ahead of every RETURN (a skip list that covers
	// them, port 80 or 0.0.0.0/0, must not make the validator fail for ever). The proxy UID's
	// go to the check port, where only the check at the proxy's start listens: outside a check
	// they are refused, so a proxy that forwards an app's connection to a sentinel never
	// reaches its own outbound listener again (which would loop until the pod ran out of
	// sockets). Everybody else's — the validator init container's — go to the outbound port.
	// Then the proxy and the exempt identities go out directly, as does anything to loopback, a
	// skipped network or a skipped port; everything else goes to the proxy.
	for _, s := range c.sentinels() {
		dst := "-d " + netip.PrefixFrom(s.Addr(), s.Addr().BitLen()).String() + " -p tcp"
		dport := " -m multiport --dports " + strconv.Itoa(int(s.Port()))
		if c.CheckPort != 0 {
			add(OutboundChain, dst+" -m owner --uid-owner "+id(c.ProxyUID)+dport+comment("validator-check")+" -j REDIRECT --to-ports "+strconv.Itoa(int(c.CheckPort)))
		}
		add(OutboundChain, dst+dport+comment("validator-sentinel")+" -j REDIRECT --to-ports "+strconv.Itoa(int(c.OutboundPort)))
	}
	add(OutboundChain, "-m owner --uid-owner "+id(c.ProxyUID)+comment("proxy-uid")+" -j RETURN")
	for _, uid := range c.ExemptUIDs {
		add(OutboundChain, "-m owner --uid-owner "+id(uid)+comment("exempt-uid")+" -j RETURN")
	}
	for _, gid := range c.ExemptGIDs {
		add(OutboundChain, "-m owner --gid-owner "+id(gid)+comment("exempt-gid")+" -j RETURN")
	}
	add(OutboundChain, "-o lo"+comment("loopback")+" -j RETURN")
	for _, p := range c.SkipOutboundCIDRs {
		if p.Addr().Is4() == (c.Family == IPv4) {
			add(OutboundChain, strings.TrimPrefix(destination(p)+comment("skip-outbound-cidr")+" -j RETURN", " "))
		}
	}
	for _, ports := range multiport(c.SkipOutboundPorts) {
		add(OutboundChain, "-p tcp -m multiport --dports "+ports+comment("skip-outbound-ports")+" -j RETURN")
	}
	add(OutboundChain, "-p tcp"+comment("redirect-outbound")+" -j REDIRECT --to-ports "+strconv.Itoa(int(c.OutboundPort)))
	return rs, nil
}

// sentinels are c's sentinels of c.Family, unmapped.
func (c Config) sentinels() []netip.AddrPort {
	var out []netip.AddrPort
	for _, s := range c.Sentinels {
		if a := s.Addr().Unmap(); a.Is4() == (c.Family == IPv4) {
			out = append(out, netip.AddrPortFrom(a, s.Port()))
		}
	}
	return out
}

// destination is the "-d" match of p as iptables-save prints it: none for a /0 network, which
// matches every address (iptables-save leaves out a match-all "-d").
func destination(p netip.Prefix) string {
	if p.Bits() == 0 {
		return ""
	}
	return "-d " + p.String()
}

// hooks are the jumps from the built-in chains into detour's; they are the same in every
// ruleset.
func hooks() []Rule {
	return []Rule{
		{"PREROUTING", "-p tcp" + comment("inbound") + " -j " + InboundChain},
		{"OUTPUT", "-p tcp" + comment("outbound") + " -j " + OutboundChain},
	}
}

// comment is the match that labels a rule; every rule carries one, so iptables-save output
// explains itself.
func comment(what string) string {
	return ` -m comment --comment "detour/` + what + `"`
}

func id(n uint32) string { return strconv.FormatUint(uint64(n), 10) }

// multiport splits ranges into multiport lists ("25,8000:8100") of at most maxMultiport ports,
// a range counting as two.
func multiport(ranges []annotations.PortRange) []string {
	var lists []string
	var cur []string
	used := 0
	for _, r := range ranges {
		item, cost := strconv.Itoa(int(r.First)), 1
		if r.First != r.Last {
			item, cost = item+":"+strconv.Itoa(int(r.Last)), 2
		}
		if used+cost > maxMultiport {
			lists = append(lists, strings.Join(cur, ","))
			cur, used = nil, 0
		}
		cur, used = append(cur, item), used+cost
	}
	if len(cur) > 0 {
		lists = append(lists, strings.Join(cur, ","))
	}
	return lists
}

// Restore renders rs as iptables-restore input for the nat table that installs it into a table
// that holds nothing of detour's. The Executor adapts it to what a namespace already holds.
func (rs Ruleset) Restore() string {
	return applyInput(rs, table{})
}
