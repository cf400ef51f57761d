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
	if err = e.Apply(ctx, nsPath, rulesets...); err == nil || IsLockTimeout(err) {
		return nil, err
	}
	fallback, ok := InboundFallback(rulesets)
	if !ok {
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

// Installed names the form of the rules [Executor.CheckInstalled] found in a pod's namespace.
type Installed int

const (
	// AsBuilt: exactly the rulesets asked for.
	AsBuilt Installed = iota
	// InboundFallbackInstalled: their [InboundFallback], what ADD installs where the kernel
	// refuses the socket lookup (every inbound connection goes to the proxy).
	InboundFallbackInstalled
	// V010Installed: what detour-cni v0.1.0 installs for the pod's annotations
	// ([V010Rules]): a pod a newer webhook injected during an upgrade, before the node's agent
	// installed the newer plugin.
	V010Installed
)

// V010Rules returns rulesets as detour-cni v0.1.0 installs them: it knows neither
// detour.dev/redirect-inbound: listening nor detour.dev/validator-check-port, so every inbound
// connection goes to the proxy and the check's connections to the outbound port (where the check
// at the proxy's start looks again, --fallback-port). ok is false when the rulesets use neither,
// and v0.1.0 installs them as they are.
func V010Rules(rulesets []Ruleset) (older []Ruleset, ok bool) {
	for _, rs := range rulesets {
		c := rs.Config
		if c.InboundListening || c.CheckPort != 0 {
			ok = true
			c.InboundListening, c.CheckPort = false, 0
		}
		out, err := Build(c)
		if err != nil { // less than rs's config, which built: unreachable
			return nil, false
		}
		older = append(older, out)
	}
	return older, ok
}

// CheckInstalled is [Executor.Check], except that the namespace may hold another form of
// rulesets that ADD installed, and how says which: their [InboundFallback] (where the kernel
// refused the socket lookup), or [V010Rules] (a plugin older than the webhook that injected
// the pod). It does not ask the kernel: the fallback carries its own comment, so a pod that fell
// back passes after its node gained the lookup (an admin loaded the module) as before. Its error
// is the difference from rulesets.
func (e *Executor) CheckInstalled(ctx context.Context, nsPath string, rulesets ...Ruleset) (how Installed, err error) {
	err = e.Check(ctx, nsPath, rulesets...)
	if err == nil {
		return AsBuilt, nil
	}
	if fallback, ok := InboundFallback(rulesets); ok && e.Check(ctx, nsPath, fallback...) == nil {
		return InboundFallbackInstalled, nil
	}
	if older, ok := V010Rules(rulesets); ok && e.Check(ctx, nsPath, older...) == nil {
		return V010Installed, nil
	}
	return AsBuilt, err
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
