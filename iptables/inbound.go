package iptables

import (
	"context"
	"fmt"

	"github.com/detourmesh/detour/internal/nsutil"
)

// inboundFallbackComment labels the inbound rule of [Config.InboundFallback].
const inboundFallbackComment = "redirect-inbound-fallback"

// InboundFallback returns rulesets with every inbound connection redirected, for a kernel
// without the socket lookup InboundListening needs (xt_socket for the iptables backends,
// nft_socket for nftables), marked as such ([Config.InboundFallback]); ok is false when no
// ruleset uses the lookup.
func InboundFallback(rulesets []Ruleset) (fallback []Ruleset, ok bool) {
	for _, rs := range rulesets {
		c := rs.Config
		if c.InboundListening {
			ok = true
			c.InboundListening, c.InboundFallback = false, true
		}
		out, err := Build(c)
		if err != nil { // rs was built from the same config: unreachable
			return nil, false
		}
		fallback = append(fallback, out)
	}
	return fallback, ok
}

// ApplyWithInboundFallback is [Executor.Apply], except that where the kernel refuses the
// socket lookup of rulesets that ask for it, it installs their [InboundFallback] instead and
// returns the kernel's refusal as refused (nil when it did not fall back). It falls back only
// on the lookup's own refusal: the rulesets must fail twice in a row, neither time for the
// xtables lock, while the fallback — the same rules but for the lookup — goes in. Any other
// failure (a lock held by another program, a netlink error that goes away) is err, and the
// runtime retries the sandbox: a pod that fell back keeps every inbound connection redirected
// for its sandbox's life, a permanent change that a passing error must not cause.
func (e *Executor) ApplyWithInboundFallback(ctx context.Context, nsPath string, rulesets ...Ruleset) (refused, err error) {
	err = e.Apply(ctx, nsPath, rulesets...)
	fallback, ok := InboundFallback(rulesets)
	if err == nil || !ok || IsLockTimeout(err) {
		return nil, err
	}
	if err = e.Apply(ctx, nsPath, rulesets...); err == nil || IsLockTimeout(err) {
		return nil, err
	}
	if ferr := e.Apply(ctx, nsPath, fallback...); ferr != nil {
		return nil, err
	}
	return err, nil
}

// CheckWithInboundFallback is [Executor.Check], except that where rulesets ask for the socket
// lookup the namespace may hold their [InboundFallback] instead — what ADD installed where the
// kernel refused the lookup — and fellBack then says so. It does not ask the kernel: the rules
// carry the fallback's own comment, so a pod that fell back passes after its node gained the
// lookup (an admin loaded the module) as before.
func (e *Executor) CheckWithInboundFallback(ctx context.Context, nsPath string, rulesets ...Ruleset) (fellBack bool, err error) {
	err = e.Check(ctx, nsPath, rulesets...)
	if err == nil {
		return false, nil
	}
	if fallback, ok := InboundFallback(rulesets); ok && e.Check(ctx, nsPath, fallback...) == nil {
		return true, nil
	}
	return false, err
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
