package iptables

import (
	"context"
	"fmt"

	"github.com/detourmesh/detour/internal/nsutil"
)

// InboundFallback returns rulesets with every inbound connection redirected, for a kernel
// without the socket lookup InboundListening needs (xt_socket for the iptables backends,
// nft_socket for nftables); ok is false when no ruleset uses the lookup.
func InboundFallback(rulesets []Ruleset) (fallback []Ruleset, ok bool) {
	for _, rs := range rulesets {
		c := rs.Config
		if c.InboundListening {
			ok = true
			c.InboundListening = false
		}
		out, err := Build(c)
		if err != nil { // rs was built from the same config: unreachable
			return nil, false
		}
		fallback = append(fallback, out)
	}
	return fallback, ok
}

// InboundLookupUsable reports whether the kernel does the socket lookup InboundListening needs,
// with e's backend: it installs such rules for both families in a scratch network namespace,
// which goes away with them. It needs CAP_SYS_ADMIN (`detour check` on a node, as root).
func (e *Executor) InboundLookupUsable(ctx context.Context) error {
	var rulesets []Ruleset
	for _, f := range []Family{IPv4, IPv6} {
		rs, err := Build(Config{Family: f, ProxyUID: 1, InboundPort: 2, OutboundPort: 3, InboundListening: true})
		if err != nil {
			return err
		}
		rulesets = append(rulesets, rs)
	}
	return nsutil.Scratch(func(path string) error {
		if err := e.Apply(ctx, path, rulesets...); err != nil {
			return fmt.Errorf("the kernel refused the inbound rule's socket lookup (%s backend): %w", e.pick(IPv4, IPv6), err)
		}
		return nil
	})
}
