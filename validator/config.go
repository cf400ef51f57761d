package validator

import (
	"errors"
	"fmt"
	"net/netip"
	"time"
)

// Exit codes of `detour validate`. They are a contract: the repair controller keys on
// ExitNoRedirect, and docs/validator.md documents each one.
const (
	// ExitOK: every checked family is redirected to the validator's listener.
	ExitOK = 0
	// ExitFailure: the check could not run (for example the listener could not be opened for a
	// reason other than the port being taken).
	ExitFailure = 1
	// ExitUsage: bad flags or arguments.
	ExitUsage = 2
	// ExitNoRedirect: a connection to the sentinel did not come back to this pod's port — no
	// redirect is in place. The repair controller recreates controller-owned pods that fail so.
	ExitNoRedirect = 42
	// ExitPortInUse: another process already listens on the check's port, so the check cannot
	// tell whose listener a redirected connection would reach. The message names the socket
	// that holds the port and its owner's UID. A new sandbox would not help (the port is the
	// pod's own doing), so the repair controller deletes nothing: it records an Event.
	ExitPortInUse = 43
	// ExitNoRoute: no family the pod has can reach its sentinel (no address of the family, or no
	// route to the sentinel), so nothing could be checked: unknown, not "no redirect". The
	// repair controller leaves such pods alone.
	ExitNoRoute = 44
)

// Defaults of the flags. The sentinels are in documentation ranges (RFC 5737 TEST-NET-3,
// RFC 3849), which no network routes, so an unredirected connection cannot reach a real server.
const (
	DefaultPort      = 4140
	DefaultSentinel  = "203.0.113.254:80"
	DefaultSentinel6 = "[2001:db8::fe]:80"
	DefaultTimeout   = 5 * time.Second
	maxTimeout       = 5 * time.Minute
)

// DeprecatedIPv6 are the --ipv6 values of earlier releases, still accepted, and what they mean
// now: detour says auto, always and never wherever it has an IPv6 setting.
var DeprecatedIPv6 = map[string]IPv6Mode{"on": IPv6Always, "off": IPv6Never}

// IPv6Mode says whether the IPv6 redirect is checked too.
type IPv6Mode string

const (
	// IPv6Auto checks IPv6 when the pod has a global IPv6 address.
	IPv6Auto IPv6Mode = "auto"
	// IPv6Always always checks IPv6.
	IPv6Always IPv6Mode = "always"
	// IPv6Never never checks IPv6.
	IPv6Never IPv6Mode = "never"
)

// Flags are the raw command-line values; [Flags.Parse] turns them into a Config.
type Flags struct {
	Port         int
	FallbackPort int
	Sentinel     string
	Sentinel6    string
	Timeout      time.Duration
	IPv6         string
}

// DefaultFlags returns the flags' default values.
func DefaultFlags() Flags {
	return Flags{
		Port:      DefaultPort,
		Sentinel:  DefaultSentinel,
		Sentinel6: DefaultSentinel6,
		Timeout:   DefaultTimeout,
		IPv6:      string(IPv6Auto),
	}
}

// Config is a validated validator configuration; only [Flags.Parse] makes one.
type Config struct {
	// Port is where the redirect sends the check's connections, and where the check listens:
	// the proxy's outbound port for the validator container, the check port
	// (detour.dev/validator-check-port) for the check at the proxy's start, which runs as the
	// proxy's UID.
	Port uint16
	// FallbackPort, when not 0, is where a node's detour-cni that predates the check port sends
	// the proxy UID's connections to a sentinel (the proxy's outbound port): a family whose
	// connection to Port is refused is checked again listening there. 0 checks Port alone.
	// The webhook sets it for the check at the proxy's start only, so it also tells the two
	// apart, where the messages need to (a port in use).
	FallbackPort uint16
	// Sentinel and Sentinel6 are the addresses the validator connects to; they must be outside
	// the pod (not loopback, which the redirect leaves alone).
	Sentinel  netip.AddrPort
	Sentinel6 netip.AddrPort
	// Timeout bounds the whole check.
	Timeout time.Duration
	IPv6    IPv6Mode
}

// Parse validates the flags and returns the Config. Its errors name the flag, the value and
// what a valid one looks like, and carry [ExitUsage].
func (f Flags) Parse() (Config, error) {
	var c Config
	if f.Port < 1 || f.Port > 65535 {
		return c, usageError("--port", fmt.Sprint(f.Port), "must be the port the redirect sends the check's connections to, 1-65535: the proxy's outbound port (detour.dev/proxy-outbound-port), or the check port at the proxy's start (detour.dev/validator-check-port)")
	}
	c.Port = uint16(f.Port)
	if f.FallbackPort != 0 {
		if f.FallbackPort < 0 || f.FallbackPort > 65535 || f.FallbackPort == f.Port {
			return c, usageError("--fallback-port", fmt.Sprint(f.FallbackPort), "must be the proxy's outbound port, 1-65535 and not --port (or 0 for none)")
		}
		c.FallbackPort = uint16(f.FallbackPort)
	}
	var err error
	if c.Sentinel, err = parseSentinel("--sentinel", f.Sentinel, false); err != nil {
		return c, err
	}
	if c.Sentinel6, err = parseSentinel("--sentinel6", f.Sentinel6, true); err != nil {
		return c, err
	}
	if f.Timeout <= 0 || f.Timeout > maxTimeout {
		return c, usageError("--timeout", f.Timeout.String(), fmt.Sprintf("must be a duration above 0 and at most %s, such as 5s", maxTimeout))
	}
	c.Timeout = f.Timeout
	switch m := IPv6Mode(f.IPv6); m {
	case IPv6Auto, IPv6Always, IPv6Never:
		c.IPv6 = m
	case "on", "off":
		c.IPv6 = DeprecatedIPv6[f.IPv6]
	default:
		return c, usageError("--ipv6", f.IPv6, `must be "auto" (check IPv6 when the pod has a global IPv6 address), "always" or "never"`)
	}
	return c, nil
}

func parseSentinel(flag, value string, six bool) (netip.AddrPort, error) {
	ap, rule := ParseSentinel(value, six)
	if rule != "" {
		return ap, usageError(flag, value, rule)
	}
	return ap, nil
}

// ParseSentinel parses a sentinel address: an IPv4 (or, when six, IPv6) unicast address outside
// the pod and a port. When value is not one, rule says what it must be ("must be an IPv4
// address and port, such as 203.0.113.254:80"). The webhook checks its configuration with it,
// so that a sentinel the validator would refuse never reaches a pod.
func ParseSentinel(value string, six bool) (ap netip.AddrPort, rule string) {
	example, family := DefaultSentinel, "an IPv4"
	if six {
		example, family = DefaultSentinel6, "an IPv6"
	}
	ap, err := netip.ParseAddrPort(value)
	if err != nil {
		return ap, fmt.Sprintf("must be %s address and port, such as %s", family, example)
	}
	a := ap.Addr()
	switch {
	case a.Is4() == six || a.Is4In6():
		return ap, fmt.Sprintf("must be %s address and port, such as %s", family, example)
	case a.IsLoopback() || a.IsUnspecified() || a.IsMulticast() || a.Zone() != "":
		return ap, "must be a unicast address outside the pod (loopback is never redirected), such as " + example
	case ap.Port() == 0:
		return ap, "must have a port from 1 to 65535, such as " + example
	}
	return ap, ""
}

// Error is a validator failure with the exit code it stands for. Its message is one line for a
// person reading `kubectl logs`: what was expected, what happened and the likely cause.
type Error struct {
	Code int
	Msg  string
}

func (e *Error) Error() string { return e.Msg }

// Code returns the exit code for err: ExitOK for nil, an [*Error]'s code, else ExitFailure.
func Code(err error) int {
	if err == nil {
		return ExitOK
	}
	if e, ok := errors.AsType[*Error](err); ok {
		return e.Code
	}
	return ExitFailure
}

func usageError(flag, value, rule string) error {
	return &Error{Code: ExitUsage, Msg: fmt.Sprintf("invalid %s %q: it %s", flag, value, rule)}
}
