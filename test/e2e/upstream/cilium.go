package upstream

import (
	"net/netip"
	"regexp"
	"strconv"
	"strings"
)

// CiliumVerdict is one policy verdict as `cilium-dbg monitor --type policy-verdict --numeric`
// prints it: the identity Cilium judged the connection's peer by, the direction, the action and
// the connection's addresses (after Cilium's own service translation: the backend pod's).
type CiliumVerdict struct {
	Remote   uint32
	Egress   bool
	Action   string // allow, deny, redirect, audit
	Src, Dst netip.AddrPort
}

// ByCIDR reports whether Cilium judged the peer by a CIDR of a policy (a local identity, 2^24
// and up) rather than as an endpoint it manages (a pod's identity, or a reserved one).
func (v CiliumVerdict) ByCIDR() bool { return v.Remote >= 1<<24 }

var ciliumVerdictRE = regexp.MustCompile(`^Policy verdict log: flow 0x[0-9a-f]+ local EP ID \d+, remote ID (\d+), proto \d+, (egress|ingress), action (\w+), auth: [^,]*, match [^,]*, (\S+) -> (\S+) `)

// ParseCiliumVerdicts reads the policy verdicts of a cilium-dbg monitor log; other lines (drops,
// its banner) are skipped.
func ParseCiliumVerdicts(log string) []CiliumVerdict {
	var out []CiliumVerdict
	for line := range strings.SplitSeq(log, "\n") {
		m := ciliumVerdictRE.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		remote, err := strconv.ParseUint(m[1], 10, 32)
		src, serr := netip.ParseAddrPort(m[4])
		dst, derr := netip.ParseAddrPort(m[5])
		if err != nil || serr != nil || derr != nil {
			continue
		}
		out = append(out, CiliumVerdict{Remote: uint32(remote), Egress: m[2] == "egress", Action: m[3], Src: src, Dst: dst})
	}
	return out
}

// ciliumDeniedByIdentity returns, of the verdicts, the identity Cilium judged dst by when it
// denied every egress SYN from the pod at src to dst on port, each time judging dst as an endpoint
// (a pod's identity: not a policy's CIDR's, nor a reserved one below 256 such as world), and
// how many; ok is false when there is no such verdict, or Cilium allowed one, or judged one
// otherwise.
func ciliumDeniedByIdentity(verdicts []CiliumVerdict, src, dst netip.Addr, port uint16) (remote uint32, n int, ok bool) {
	for _, v := range verdicts {
		if !v.Egress || v.Src.Addr() != src || v.Dst.Addr() != dst || v.Dst.Port() != port {
			continue
		}
		if v.Action != "deny" || v.ByCIDR() || v.Remote < 256 || (n > 0 && v.Remote != remote) {
			return 0, 0, false
		}
		remote = v.Remote
		n++
	}
	return remote, n, n > 0
}
