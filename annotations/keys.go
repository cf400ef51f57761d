package annotations

// Prefix is the prefix of every detour annotation, label and taint key.
const Prefix = "detour.dev/"

// Keys written by users on a pod or its namespace (the pod's value wins).
const (
	// Inject opts a namespace or a pod in ("enabled") or out ("disabled").
	Inject = Prefix + "inject"
	// InitEgress selects the init containers that keep direct egress before the proxy starts:
	// "*" (all), "none", or a comma-separated list of container names.
	InitEgress = Prefix + "init-egress"
	// SkipOutboundPorts lists destination ports and ranges that are never redirected.
	SkipOutboundPorts = Prefix + "skip-outbound-ports"
	// SkipInboundPorts lists pod ports and ranges whose inbound connections are never redirected.
	SkipInboundPorts = Prefix + "skip-inbound-ports"
	// SkipOutboundCIDRs lists destination networks (IPv4 and IPv6) that are never redirected.
	SkipOutboundCIDRs = Prefix + "skip-outbound-cidrs"
	// SidecarMode overrides where the proxy goes: "container" or "native".
	SidecarMode = Prefix + "sidecar-mode"
	// ValidatorMode overrides where the validator's check runs: "auto" (the webhook's
	// decision), "init-container" or "image-volume" (in the proxy's own start).
	ValidatorMode = Prefix + "validator-mode"
	// InboundCapture says which inbound connections go to the proxy: "listening" (only where a
	// socket of the pod listens on the destination) or "all" (every one, for proxies that
	// serve ports with no app behind them).
	InboundCapture = Prefix + "inbound-capture"
	// ProxyStartGate overrides what holds the pod's next containers until the proxy has
	// started: "auto" (the webhook's configuration), "probe" (the proxy's startup probe) or
	// "hook" (a postStart hook of detour's binary that waits for the proxy's port).
	ProxyStartGate = Prefix + "proxy-start-gate"
)

// Keys written by the webhook only. The webhook recomputes them on every admission and
// overwrites whatever a pod author put there; the CNI plugin reads them through [ParseRedirect].
const (
	// Injected marks a pod the webhook injected; its value is the detour version that did it.
	Injected = Prefix + "injected"
	// ProxyUID is the UID the proxy runs as; its traffic is never redirected.
	ProxyUID = Prefix + "proxy-uid"
	// ProxyInboundPort is the port inbound connections are redirected to.
	ProxyInboundPort = Prefix + "proxy-inbound-port"
	// ProxyOutboundPort is the port outbound connections are redirected to.
	ProxyOutboundPort = Prefix + "proxy-outbound-port"
	// RedirectSkipInboundPorts is the compiled inbound skip list (the user's list plus the
	// proxy's admin ports).
	RedirectSkipInboundPorts = Prefix + "redirect-skip-inbound-ports"
	// RedirectSkipOutboundPorts is the compiled outbound port skip list.
	RedirectSkipOutboundPorts = Prefix + "redirect-skip-outbound-ports"
	// RedirectSkipOutboundCIDRs is the compiled outbound CIDR skip list.
	RedirectSkipOutboundCIDRs = Prefix + "redirect-skip-outbound-cidrs"
	// ExemptUIDs lists the init containers' UIDs whose traffic bypasses the redirect.
	ExemptUIDs = Prefix + "exempt-uids"
	// ExemptGIDs lists the dedicated GIDs whose traffic bypasses the redirect.
	ExemptGIDs = Prefix + "exempt-gids"
	// ValidatorSentinels lists the destinations the validator probes ("203.0.113.254:80,
	// [2001:db8::fe]:80"). The plugin redirects them ahead of the skip lists, so the validator
	// passes whenever detour's rules are installed, whatever the pod's skip lists say.
	ValidatorSentinels = Prefix + "validator-sentinels"
	// ValidatorCheckPort is the port the proxy UID's connections to a sentinel are redirected
	// to: only the check at the proxy's start listens there, so outside a check they are
	// refused, and a proxy forwarding a connection to a sentinel never reaches its own outbound
	// listener again. A pod injected before this key existed has none.
	ValidatorCheckPort = Prefix + "validator-check-port"
	// InitEgressStatus records, for people, what the webhook decided for each init container.
	// It is informational; the plugin does not read it.
	InitEgressStatus = Prefix + "init-egress-status"
	// Validator records where the validator's check runs in the pod: "init-container" (the
	// detour-validator init container) or "image-volume" (the start of the detour-proxy
	// container, from detour's image mounted as a volume). The repair controller and detour
	// check read it to find the check's exit code.
	Validator = Prefix + "validator"
	// RedirectInbound is the compiled inbound capture: "listening" or "all" (the value of
	// [InboundCapture], else the webhook's configuration). A pod injected before this key
	// existed has none, and the plugin redirects every inbound connection, as it did then.
	RedirectInbound = Prefix + "redirect-inbound"
)

// WebhookKeys lists every key only the webhook may write, in a fixed order.
var WebhookKeys = []string{
	Injected, ProxyUID, ProxyInboundPort, ProxyOutboundPort,
	RedirectSkipInboundPorts, RedirectSkipOutboundPorts, RedirectSkipOutboundCIDRs,
	ExemptUIDs, ExemptGIDs, ValidatorSentinels, ValidatorCheckPort, RedirectInbound, InitEgressStatus, Validator,
}

// RecreateRequired is set by the repair controller on a bare pod whose validator found no
// redirect, telling people to recreate it.
const RecreateRequired = Prefix + "recreate-required"

// InboundFallback is set by the node agent on a pod whose sandbox got every inbound connection
// redirected although its [RedirectInbound] is "listening": the kernel refused the socket
// lookup when detour-cni set the sandbox up. Its value says so, with the kernel's words. It
// belongs to that sandbox: the webhook strips it from a new pod.
const InboundFallback = Prefix + "inbound-fallback"

// userKeys are the keys users write, in the order of docs/annotations.md.
var userKeys = []string{Inject, InitEgress, SkipOutboundPorts, SkipInboundPorts, SkipOutboundCIDRs, SidecarMode, ValidatorMode, InboundCapture, ProxyStartGate}

// MaxListItems bounds every list-valued annotation, so a pod cannot make the plugin build an
// arbitrarily large ruleset.
const MaxListItems = 64
