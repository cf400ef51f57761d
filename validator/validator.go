package validator

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Dialer opens the connection to the sentinel; *net.Dialer is the real one.
type Dialer interface {
	DialContext(ctx context.Context, network, address string) (net.Conn, error)
}

// Validator runs the check of one Config.
type Validator struct {
	cfg      Config
	dialer   Dialer
	hasIPv4  func() (bool, error)
	hasIPv6  func() (bool, error)
	routable func(network string, to netip.AddrPort) error
	sockets  func() ([]socket, error) // the namespace's TCP sockets, read when the port is taken
}

// Option configures a Validator.
type Option func(*Validator)

// WithDialer replaces the dialer (tests simulate a redirect with it).
func WithDialer(d Dialer) Option { return func(v *Validator) { v.dialer = d } }

// WithIPv6Detector replaces how IPv6Auto decides whether the pod has IPv6 (default: a global
// IPv6 address on any interface).
func WithIPv6Detector(f func() (bool, error)) Option { return func(v *Validator) { v.hasIPv6 = f } }

// WithIPv4Detector replaces how the validator decides whether the pod has IPv4 (default: an
// IPv4 address other than loopback on any interface).
func WithIPv4Detector(f func() (bool, error)) Option { return func(v *Validator) { v.hasIPv4 = f } }

// WithRouteCheck replaces how the validator finds out whether the pod has a route to a sentinel
// (default: a UDP connect, which looks the route up without sending anything); its error says
// why not.
func WithRouteCheck(f func(network string, to netip.AddrPort) error) Option {
	return func(v *Validator) { v.routable = f }
}

// New returns a Validator for cfg.
func New(cfg Config, opts ...Option) *Validator {
	v := &Validator{cfg: cfg, dialer: &net.Dialer{}, hasIPv4: hasIPv4, hasIPv6: hasGlobalIPv6, routable: routeTo, sockets: readSockets}
	for _, o := range opts {
		o(v)
	}
	return v
}

// Check is the successful check of one family: its connection came back to Port.
type Check struct {
	Family   string
	Sentinel netip.AddrPort
	Port     uint16
	Elapsed  time.Duration
}

// Result is what a successful run checked, and which families it could not check.
type Result struct {
	Checks  []Check
	Skipped []string // "ipv6: no route to [2001:db8::fe]:80 (...)"
}

// String is the line `detour validate` prints on success.
func (r Result) String() string {
	parts := make([]string, len(r.Checks))
	for i, c := range r.Checks {
		parts[i] = fmt.Sprintf("%s connection to %s came back to port %d in %s", c.Family, c.Sentinel, c.Port, c.Elapsed.Round(time.Microsecond))
	}
	line := "redirect in place: " + strings.Join(parts, "; ")
	if len(r.Skipped) > 0 {
		line += " (not checked: " + strings.Join(r.Skipped, "; ") + ")"
	}
	return line
}

// family is one IP family's part of the check.
type family struct {
	name     string
	network  string
	loopback string
	sentinel netip.AddrPort
}

// Run performs the check: it listens on the configured port on loopback (where a REDIRECT
// delivers locally generated connections), connects to the sentinel of every checked family at
// once, and passes when each connection is answered with the token its listener serves. A
// family whose connection is refused is checked again on the fallback port, where one is set
// (a node's plugin that predates the check port). It returns within the configured timeout;
// its error is an [*Error] whose Code is the exit code.
func (v *Validator) Run(ctx context.Context) (Result, error) {
	var res Result
	families, err := v.families(&res)
	if err != nil {
		return res, err
	}
	token, err := newToken()
	if err != nil {
		return res, &Error{Code: ExitFailure, Msg: fmt.Sprintf("generate the validator's token: %v", err)}
	}
	ctx, cancel := context.WithTimeout(ctx, v.cfg.Timeout)
	defer cancel()
	start := time.Now()
	outcomes, err := v.check(ctx, families, v.cfg.Port, token)
	if err != nil {
		return res, err
	}
	if v.cfg.FallbackPort != 0 {
		var again []family
		for _, f := range families {
			if errors.Is(outcomes[f.name].err, errRefused) {
				again = append(again, f)
			}
		}
		if len(again) > 0 {
			retried, err := v.check(ctx, again, v.cfg.FallbackPort, token)
			if err != nil {
				return res, err
			}
			for name, o := range retried {
				if o.err == nil {
					outcomes[name] = o
				}
			}
		}
	}

	var failed []string
	for _, f := range families {
		o := outcomes[f.name]
		if o.err != nil {
			failed = append(failed, fmt.Sprintf("the %s connection to %s %v", f.name, f.sentinel, o.err))
			continue
		}
		res.Checks = append(res.Checks, Check{Family: f.name, Sentinel: f.sentinel, Port: o.port, Elapsed: o.at.Sub(start)})
	}
	if len(failed) == 0 {
		return res, nil
	}
	return res, v.noRedirect(families, failed, len(res.Checks) > 0)
}

// outcome is how one family's connection ended: on port at time at, or with err.
type outcome struct {
	port uint16
	at   time.Time
	err  error
}

// check listens on port for every family and probes them all at once. Its error is a listener
// that could not be opened; each family's own result is in the map, by family name.
func (v *Validator) check(ctx context.Context, families []family, port uint16, token string) (map[string]outcome, error) {
	var wg sync.WaitGroup
	defer wg.Wait()
	for _, f := range families {
		ln, err := v.listen(f, port)
		if err != nil {
			return nil, err
		}
		defer ln.Close()
		wg.Go(func() { serve(ln, token) })
	}
	results := make([]outcome, len(families))
	var checks sync.WaitGroup
	for i, f := range families {
		checks.Go(func() {
			err := v.probe(ctx, f, token)
			results[i] = outcome{port: port, at: time.Now(), err: err}
		})
	}
	checks.Wait()
	out := make(map[string]outcome, len(families))
	for i, f := range families {
		out[f.name] = results[i]
	}
	return out, nil
}

// families returns the families to check: IPv4 when the pod has an IPv4 address, IPv6 as --ipv6
// says, each only when the pod has a route to its sentinel. A family left out is noted in res;
// when none is left, nothing can be checked (ExitNoRoute), which is not "no redirect".
func (v *Validator) families(res *Result) ([]family, error) {
	has4, err := v.hasIPv4()
	if err != nil {
		return nil, &Error{Code: ExitFailure, Msg: fmt.Sprintf("cannot tell whether the pod has IPv4 (%v)", err)}
	}
	check6 := v.cfg.IPv6 == IPv6Always
	if v.cfg.IPv6 == IPv6Auto {
		if check6, err = v.hasIPv6(); err != nil {
			return nil, &Error{Code: ExitFailure, Msg: fmt.Sprintf("cannot tell whether the pod has IPv6 (%v): set --ipv6=always or --ipv6=never", err)}
		}
	}
	var families []family
	if has4 {
		families = append(families, family{"ipv4", "tcp4", "127.0.0.1", v.cfg.Sentinel})
	} else {
		res.Skipped = append(res.Skipped, "ipv4: the pod has no IPv4 address")
	}
	if check6 {
		families = append(families, family{"ipv6", "tcp6", "::1", v.cfg.Sentinel6})
	} else if v.cfg.IPv6 == IPv6Auto {
		res.Skipped = append(res.Skipped, "ipv6: the pod has no global IPv6 address")
	}
	var routed []family
	for _, f := range families {
		if err := v.routable(f.network, f.sentinel); err != nil {
			res.Skipped = append(res.Skipped, fmt.Sprintf("%s: no route to %s (%v)", f.name, f.sentinel, err))
			continue
		}
		routed = append(routed, f)
	}
	if len(routed) == 0 {
		return nil, &Error{Code: ExitNoRoute, Msg: fmt.Sprintf(
			"nothing to check the redirect with: %s; a connection the pod cannot route never reaches the redirect, so this is not a missing redirect — set the validator's sentinel (and sentinel6) to addresses this pod routes (webhook config validator.sentinel), or --ipv6=never for a pod without IPv6",
			strings.Join(res.Skipped, "; "))}
	}
	return routed, nil
}

// routeTo reports whether the namespace has a route to addr: connecting a UDP socket looks the
// route up and sends nothing.
func routeTo(network string, to netip.AddrPort) error {
	udp := "udp4"
	if network == "tcp6" {
		udp = "udp6"
	}
	c, err := net.DialUDP(udp, nil, net.UDPAddrFromAddrPort(to))
	if err != nil {
		if errors.Is(err, syscall.ENETUNREACH) {
			return errors.New("the network is unreachable")
		}
		return err
	}
	return c.Close()
}

// hasIPv4 reports whether an interface of the current network namespace has an IPv4 address
// other than loopback.
func hasIPv4() (bool, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return false, fmt.Errorf("list interface addresses: %w", err)
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && !n.IP.IsLoopback() {
			return true, nil
		}
	}
	return false, nil
}

// noRedirect builds the one-line ExitNoRedirect message: expected, happened, likely cause.
func (v *Validator) noRedirect(families []family, failed []string, partly bool) error {
	var sentinels []string
	for _, f := range families {
		sentinels = append(sentinels, f.sentinel.String())
	}
	cause := "the detour CNI plugin did not run for this pod — was the node's CNI config in place when the pod started?"
	if partly {
		cause = "the pod has the redirect of one IP family only — detour-cni installs IPv4 rules in every injected pod and IPv6 rules when the primary plugin reports an IPv6 address (set the plugin's ipv6 to always when it does not, or this validator's --ipv6); a pod that started with both lost the other since (something flushed that family's rules in the pod): recreate it"
	}
	return &Error{Code: ExitNoRedirect, Msg: fmt.Sprintf(
		"no redirect in this pod's network namespace: expected connections to %s to be redirected to port %d of this pod, but %s: %s",
		strings.Join(sentinels, " and "), v.cfg.Port, strings.Join(failed, ", and "), cause)}
}

// portUse says which of the check's listeners port is for: the validator container's (no
// fallback port: the check at the proxy's start always has one, the proxy's outbound port), or,
// at the proxy's start, the check port's or the outbound port's.
func (v *Validator) portUse(port uint16) portUse {
	switch {
	case v.cfg.FallbackPort == 0:
		return inValidator
	case port == v.cfg.FallbackPort:
		return onOutboundPort
	default:
		return onCheckPort
	}
}

// listen opens the family's listener on port. When the port is taken, its error names who
// holds it, from the namespace's socket tables.
func (v *Validator) listen(f family, port uint16) (net.Listener, error) {
	addr := net.JoinHostPort(f.loopback, fmt.Sprint(port))
	ln, err := net.Listen(f.network, addr)
	switch {
	case err == nil:
		return ln, nil
	case errors.Is(err, syscall.EADDRINUSE):
		socks, lookupErr := v.sockets()
		return nil, portInUse(v.portUse(port), netip.AddrPortFrom(netip.MustParseAddr(f.loopback), port), socks, lookupErr, uint32(os.Getuid()))
	default:
		return nil, &Error{Code: ExitFailure, Msg: fmt.Sprintf("cannot listen on %s to receive the redirected %s connection: %v", addr, f.name, err)}
	}
}

// serve answers every connection with the token, until the listener closes.
func serve(ln net.Listener, token string) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		_ = c.SetWriteDeadline(time.Now().Add(time.Second))
		_, _ = c.Write([]byte(token + "\n"))
		_ = c.Close()
	}
}

// probe connects to the family's sentinel and reads the answer. Its error completes the
// sentence "the ipv4 connection to 203.0.113.254:80 ...".
func (v *Validator) probe(ctx context.Context, f family, token string) error {
	c, err := v.dialer.DialContext(ctx, f.network, f.sentinel.String())
	if err != nil {
		return describeDialError(err, v.cfg.Timeout)
	}
	defer c.Close()
	if deadline, ok := ctx.Deadline(); ok {
		_ = c.SetDeadline(deadline)
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	answer := strings.TrimSpace(line)
	switch {
	case answer == token:
		return nil
	case err != nil && answer == "":
		return fmt.Errorf("was established but not by this validator's listener (reading its answer: %v)", describeReadError(err, v.cfg.Timeout))
	default:
		return fmt.Errorf("reached a server other than this validator (it answered %q)", truncate(answer, 40))
	}
}

// errRefused is a connection to the sentinel that was refused: redirected to a port where
// nothing listens (or refused by the network).
var errRefused = errors.New("was refused")

func describeDialError(err error, timeout time.Duration) error {
	switch {
	case errors.Is(err, context.DeadlineExceeded) || os.IsTimeout(err):
		return fmt.Errorf("timed out after %s", timeout)
	case errors.Is(err, syscall.ECONNREFUSED):
		return errRefused
	case errors.Is(err, syscall.ENETUNREACH):
		return errors.New("failed: the network is unreachable")
	case errors.Is(err, syscall.EHOSTUNREACH):
		return errors.New("failed: no route to host")
	default:
		return fmt.Errorf("failed: %v", err)
	}
}

func describeReadError(err error, timeout time.Duration) string {
	if os.IsTimeout(err) {
		return "timed out after " + timeout.String()
	}
	return err.Error()
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

func newToken() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return "detour-validator-" + hex.EncodeToString(b[:]), nil
}

// hasGlobalIPv6 reports whether an interface of the current network namespace has a global
// unicast IPv6 address (unique local addresses count: pods commonly get them).
func hasGlobalIPv6() (bool, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return false, fmt.Errorf("list interface addresses: %w", err)
	}
	for _, a := range addrs {
		n, ok := a.(*net.IPNet)
		if !ok {
			continue
		}
		ip, ok := netip.AddrFromSlice(n.IP)
		if ok && ip.Is6() && !ip.Is4In6() && ip.IsGlobalUnicast() {
			return true, nil
		}
	}
	return false, nil
}
