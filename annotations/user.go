package annotations

import (
	"slices"
	"strings"
)

// InjectMode is the value of [Inject].
type InjectMode string

const (
	InjectEnabled  InjectMode = "enabled"
	InjectDisabled InjectMode = "disabled"
)

// ParseInjectMode parses the value of [Inject].
func ParseInjectMode(value string) (InjectMode, error) {
	return parseOneOf(Inject, value, "", InjectEnabled, InjectDisabled)
}

// SidecarModeValue is the value of [SidecarMode].
type SidecarModeValue string

const (
	SidecarContainer SidecarModeValue = "container"
	SidecarNative    SidecarModeValue = "native"
)

// ParseSidecarMode parses the value of [SidecarMode].
func ParseSidecarMode(value string) (SidecarModeValue, error) {
	return parseOneOf(SidecarMode, value, "", SidecarContainer, SidecarNative)
}

// ValidatorModeValue is where the validator's check runs: the value of [ValidatorMode] and of
// [Validator], and the webhook configuration's validator.mode.
type ValidatorModeValue string

const (
	// ValidatorAuto: the folded form where the cluster can mount image volumes and the proxy is
	// a native sidecar, else the init container.
	ValidatorAuto ValidatorModeValue = "auto"
	// ValidatorInitContainer: the detour-validator init container, first of the pod's.
	ValidatorInitContainer ValidatorModeValue = "init-container"
	// ValidatorImageVolume: the check runs at the start of the detour-proxy container, from
	// detour's image mounted as an image volume, and then execs the proxy.
	ValidatorImageVolume ValidatorModeValue = "image-volume"
)

// ParseValidatorMode parses the value of [ValidatorMode].
func ParseValidatorMode(value string) (ValidatorModeValue, error) {
	return parseOneOf(ValidatorMode, value, "", ValidatorAuto, ValidatorInitContainer, ValidatorImageVolume)
}

// StartGateValue is what holds a pod's next containers until its proxy (a native sidecar) has
// started: the value of [ProxyStartGate] and the webhook configuration's proxy.startGate.
type StartGateValue string

const (
	// StartGateAuto: the webhook's decision (its configuration's proxy.startGate).
	StartGateAuto StartGateValue = "auto"
	// StartGateProbe: the proxy's startup probe; the kubelet starts the next container once a
	// probe tick has seen the proxy listen.
	StartGateProbe StartGateValue = "probe"
	// StartGateHook: a postStart exec hook of detour's binary (from the image volume of the
	// check at the proxy's start) that waits for what the startup probe would probe and reports a
	// failed check's message; the startup probe stays beside it.
	StartGateHook StartGateValue = "hook"
)

// ParseStartGate parses the value of [ProxyStartGate].
func ParseStartGate(value string) (StartGateValue, error) {
	return parseOneOf(ProxyStartGate, value, "", StartGateAuto, StartGateProbe, StartGateHook)
}

// InboundCaptureValue is the value of [InboundCapture] and [RedirectInbound], and the webhook
// configuration's inboundCapture.
type InboundCaptureValue string

const (
	// InboundListening: an inbound connection goes to the proxy only where a socket of the pod
	// listens on its destination address and port.
	InboundListening InboundCaptureValue = "listening"
	// InboundAll: every inbound connection goes to the proxy (but the skipped ports).
	InboundAll InboundCaptureValue = "all"
)

// ParseInboundCapture parses the value of key ([InboundCapture] or [RedirectInbound]).
func ParseInboundCapture(key, value string) (InboundCaptureValue, error) {
	return parseOneOf(key, value, "use \"listening\" (inbound connections go to the proxy only where the app listens) or \"all\" (every inbound connection, for a proxy that serves ports itself)", InboundListening, InboundAll)
}

// parseOneOf parses the value of key, one of allowed (surrounding spaces ignored); the error
// lists them ("use \"a\", \"b\" or \"c\""), or says rule where one is given.
func parseOneOf[T ~string](key, value, rule string, allowed ...T) (T, error) {
	if v := T(strings.TrimSpace(value)); slices.Contains(allowed, v) {
		return v, nil
	}
	if rule == "" {
		quoted := make([]string, len(allowed))
		for i, a := range allowed {
			quoted[i] = `"` + string(a) + `"`
		}
		rule = "use " + strings.Join(quoted[:len(quoted)-1], ", ") + " or " + quoted[len(quoted)-1]
	}
	return "", errorf(key, value, "%s", rule)
}

// InitEgressSelection is the parsed value of [InitEgress]: all init containers, none, or the
// named ones.
type InitEgressSelection struct {
	All   bool
	Names []string // sorted, without duplicates; empty with All false means none
}

// Selects reports whether the init container called name is selected.
func (s InitEgressSelection) Selects(name string) bool {
	if s.All {
		return true
	}
	_, found := slices.BinarySearch(s.Names, name)
	return found
}

// String formats s as ParseInitEgress reads it.
func (s InitEgressSelection) String() string {
	switch {
	case s.All:
		return "*"
	case len(s.Names) == 0:
		return "none"
	}
	return strings.Join(s.Names, ",")
}

// ParseInitEgress parses "*", "none" or a comma-separated list of init container names.
func ParseInitEgress(value string) (InitEgressSelection, error) {
	switch strings.TrimSpace(value) {
	case "*":
		return InitEgressSelection{All: true}, nil
	case "none":
		return InitEgressSelection{}, nil
	}
	parts, err := items(InitEgress, value)
	if err != nil {
		return InitEgressSelection{}, err
	}
	if len(parts) == 0 {
		return InitEgressSelection{}, errorf(InitEgress, value, "use \"*\", \"none\" or a comma-separated list of init container names")
	}
	for _, p := range parts {
		if !isDNSLabel(p) {
			return InitEgressSelection{}, errorf(InitEgress, p,
				"a container name is a DNS label (lower-case letters, digits and '-', at most 63 characters); use \"*\", \"none\" or a list of names")
		}
	}
	slices.Sort(parts)
	return InitEgressSelection{Names: slices.Compact(parts)}, nil
}

// isDNSLabel reports whether s is an RFC 1123 label, the form of a container name.
func isDNSLabel(s string) bool {
	if len(s) == 0 || len(s) > 63 || s[0] == '-' || s[len(s)-1] == '-' {
		return false
	}
	for _, c := range []byte(s) {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
			return false
		}
	}
	return true
}
