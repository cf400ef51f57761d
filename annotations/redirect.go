package annotations

import (
	"net/netip"
	"strconv"
	"strings"
)

// Redirect is everything the webhook writes on an injected pod for the CNI plugin: who the
// proxy is, where traffic goes, and who bypasses it. [Redirect.Annotations] writes it and
// [ParseRedirect] reads it back; the two round-trip exactly.
type Redirect struct {
	// Version is the detour version that injected the pod (the value of [Injected]).
	Version           string
	ProxyUID          uint32
	InboundPort       uint16
	OutboundPort      uint16
	SkipInboundPorts  []PortRange
	SkipOutboundPorts []PortRange
	SkipOutboundCIDRs []netip.Prefix
	ExemptUIDs        []uint32
	ExemptGIDs        []uint32
	// Sentinels are the validator's probe destinations.
	Sentinels []netip.AddrPort
	// CheckPort is where the proxy UID's connections to the sentinels go (the check at the
	// proxy's start listens there); 0 on a pod injected before detour wrote it.
	CheckPort uint16
	// InboundListening redirects inbound connections only where a socket of the pod listens
	// on their destination (detour.dev/redirect-inbound: listening); false on a pod injected
	// before detour wrote the key, which had every inbound connection redirected.
	InboundListening bool
}

// IsInjected reports whether annotations carry the webhook's injected marker.
func IsInjected(annotations map[string]string) bool {
	_, ok := annotations[Injected]
	return ok
}

// ParseRedirect reads the webhook-written annotations of an injected pod. The caller checks
// [IsInjected] first; ParseRedirect fails on a pod without the marker.
func ParseRedirect(a map[string]string) (Redirect, error) {
	var r Redirect
	var err error
	version, ok := a[Injected]
	if !ok {
		return r, errorf(Injected, "", "the pod was not injected by the detour webhook (the annotation is missing)")
	}
	if r.Version, err = parseVersion(version); err != nil {
		return r, err
	}
	if r.ProxyUID, err = ParseID(ProxyUID, required(a, ProxyUID)); err != nil {
		return r, err
	}
	if r.InboundPort, err = ParsePort(ProxyInboundPort, required(a, ProxyInboundPort)); err != nil {
		return r, err
	}
	if r.OutboundPort, err = ParsePort(ProxyOutboundPort, required(a, ProxyOutboundPort)); err != nil {
		return r, err
	}
	if r.SkipInboundPorts, err = ParsePorts(RedirectSkipInboundPorts, a[RedirectSkipInboundPorts]); err != nil {
		return r, err
	}
	if r.SkipOutboundPorts, err = ParsePorts(RedirectSkipOutboundPorts, a[RedirectSkipOutboundPorts]); err != nil {
		return r, err
	}
	if r.SkipOutboundCIDRs, err = ParseCIDRs(RedirectSkipOutboundCIDRs, a[RedirectSkipOutboundCIDRs]); err != nil {
		return r, err
	}
	if r.ExemptUIDs, err = ParseIDs(ExemptUIDs, a[ExemptUIDs]); err != nil {
		return r, err
	}
	if r.ExemptGIDs, err = ParseIDs(ExemptGIDs, a[ExemptGIDs]); err != nil {
		return r, err
	}
	if r.Sentinels, err = ParseSentinels(ValidatorSentinels, a[ValidatorSentinels]); err != nil {
		return r, err
	}
	if v, ok := a[RedirectInbound]; ok {
		m, err := ParseInboundCapture(RedirectInbound, v)
		if err != nil {
			return r, err
		}
		r.InboundListening = m == InboundListening
	}
	if v, ok := a[ValidatorCheckPort]; ok {
		if r.CheckPort, err = ParsePort(ValidatorCheckPort, v); err != nil {
			return r, err
		}
		if r.CheckPort == r.OutboundPort || r.CheckPort == r.InboundPort {
			return r, errorf(ValidatorCheckPort, v, "the check's port must differ from the proxy's inbound and outbound ports (%d, %d)", r.InboundPort, r.OutboundPort)
		}
	}
	return r, nil
}

// required returns the value of key, or a value no parser accepts when it is missing, so the
// parser's error names the key.
func required(a map[string]string, key string) string {
	if v, ok := a[key]; ok {
		return v
	}
	return "<missing>"
}

// parseVersion accepts a version label of up to 63 printable, space-free ASCII characters.
func parseVersion(v string) (string, error) {
	if v == "" || len(v) > 63 || strings.ContainsFunc(v, func(c rune) bool { return c <= ' ' || c > '~' }) {
		return "", errorf(Injected, v, "the marker holds the detour version, up to 63 printable characters without spaces")
	}
	return v, nil
}

// Annotations returns the webhook-written annotations for r; empty lists are left out.
func (r Redirect) Annotations() map[string]string {
	a := map[string]string{
		Injected:          r.Version,
		ProxyUID:          strconv.FormatUint(uint64(r.ProxyUID), 10),
		ProxyInboundPort:  strconv.Itoa(int(r.InboundPort)),
		ProxyOutboundPort: strconv.Itoa(int(r.OutboundPort)),
	}
	set := func(key, value string) {
		if value != "" {
			a[key] = value
		}
	}
	set(RedirectSkipInboundPorts, FormatPorts(r.SkipInboundPorts))
	set(RedirectSkipOutboundPorts, FormatPorts(r.SkipOutboundPorts))
	set(RedirectSkipOutboundCIDRs, FormatCIDRs(r.SkipOutboundCIDRs))
	set(ExemptUIDs, FormatIDs(r.ExemptUIDs))
	set(ExemptGIDs, FormatIDs(r.ExemptGIDs))
	set(ValidatorSentinels, FormatSentinels(r.Sentinels))
	if r.CheckPort != 0 {
		a[ValidatorCheckPort] = strconv.Itoa(int(r.CheckPort))
	}
	a[RedirectInbound] = string(InboundAll)
	if r.InboundListening {
		a[RedirectInbound] = string(InboundListening)
	}
	return a
}
