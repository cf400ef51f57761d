package validator

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// The start gate (`detour wait-proxy`) is the postStart hook of a proxy whose check runs at its
// start when the webhook's proxy.startGate is hook: the kubelet runs the hook right after it
// started the container and starts the pod's next container only once the hook has returned
// (and the container still runs), so the hook holds the pod back until the proxy answers what
// its startup probe would have asked. The proxy is exec'd only after the check passed, so a
// proxy that answers proves the check passed too. See docs/webhook.md, "The proxy's start gate".

// Target is what the start gate waits for: the proxy's startup probe, asked from inside the pod.
type Target struct {
	// Scheme is "tcp" (a connection is accepted), "http" or "https" (a GET answered 200–399).
	Scheme string
	Port   uint16
	// Path is the GET's path and query (http and https only).
	Path string
	// Header holds the GET's extra headers.
	Header http.Header
}

// ParseTarget parses tcp://:PORT, http://:PORT/PATH or https://:PORT/PATH: the form
// [Target.String] writes. The host part is empty: the gate asks the pod's own addresses, as the
// kubelet probes the pod's IP.
func ParseTarget(s string) (Target, error) {
	u, err := url.Parse(s)
	if err != nil || u.Scheme == "" || u.Opaque != "" || u.Hostname() != "" || u.User != nil || u.Fragment != "" {
		return Target{}, fmt.Errorf("probe %q: write it as tcp://:PORT, http://:PORT/PATH or https://:PORT/PATH (no host: the pod's own addresses are asked)", s)
	}
	port, err := strconv.ParseUint(u.Port(), 10, 16)
	if err != nil || port == 0 {
		return Target{}, fmt.Errorf("probe %q: the port must be a number from 1 to 65535", s)
	}
	t := Target{Scheme: u.Scheme, Port: uint16(port)}
	switch u.Scheme {
	case "tcp":
		if u.Path != "" || u.RawQuery != "" {
			return Target{}, fmt.Errorf("probe %q: a tcp probe has no path", s)
		}
	case "http", "https":
		t.Path = u.RequestURI()
	default:
		return Target{}, fmt.Errorf("probe %q: the scheme must be tcp, http or https", s)
	}
	return t, nil
}

// String is the target in the form [ParseTarget] reads.
func (t Target) String() string {
	if t.Scheme == "tcp" {
		return fmt.Sprintf("tcp://:%d", t.Port)
	}
	return fmt.Sprintf("%s://:%d%s", t.Scheme, t.Port, t.Path)
}

// WaitConfig is one wait of the start gate.
type WaitConfig struct {
	Target Target
	// Timeout bounds the whole wait: the startup probe's budget (initialDelaySeconds +
	// periodSeconds × failureThreshold), after which the kubelet would have restarted the proxy.
	Timeout time.Duration
	// AttemptTimeout bounds one attempt: the probe's timeoutSeconds.
	AttemptTimeout time.Duration
	// CheckPort, when set, is the check's port at the proxy's start: the wait joins the check's
	// socket ([GateSocket]), fails at once with the check's message when it fails, and ends the
	// check when the wait goes away first.
	CheckPort uint16
}

// Waiter runs the start gate's wait.
type Waiter struct {
	cfg     WaitConfig
	addrs   func() ([]netip.Addr, error)
	dialer  Dialer
	client  *http.Client
	backoff []time.Duration
	// joinWait is how long the wait tries to join the check's socket.
	joinWait time.Duration
}

// WaitOption configures a Waiter.
type WaitOption func(*Waiter)

// WithAddrs replaces how the gate finds the pod's addresses (default: [PodAddrs]).
func WithAddrs(f func() ([]netip.Addr, error)) WaitOption { return func(w *Waiter) { w.addrs = f } }

// startGateBackoff is the pause after each failed round of attempts: short at first, because
// the proxy usually listens within milliseconds of the check, then at most 25 ms, so that a
// proxy that takes seconds to start is seen within 25 ms of listening.
var startGateBackoff = []time.Duration{2 * time.Millisecond, 5 * time.Millisecond, 10 * time.Millisecond, 25 * time.Millisecond}

// NewWaiter returns a Waiter for cfg.
func NewWaiter(cfg WaitConfig, opts ...WaitOption) *Waiter {
	w := &Waiter{cfg: cfg, addrs: PodAddrs, dialer: &net.Dialer{}, backoff: startGateBackoff, joinWait: time.Second}
	for _, o := range opts {
		o(w)
	}
	w.client = &http.Client{
		Transport: &http.Transport{
			DialContext: w.dialer.DialContext,
			// The kubelet does not verify a probe's certificate either.
			TLSClientConfig:   &tls.Config{InsecureSkipVerify: true},
			DisableKeepAlives: true,
		},
		// A redirect answers the probe (the kubelet counts 3xx as success).
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
	return w
}

// WaitResult is a successful wait.
type WaitResult struct {
	Addr     netip.AddrPort
	Attempts int
	Elapsed  time.Duration
	// Unjoined says why the wait could not join the check's socket, when it could not.
	Unjoined string
}

// String is the line `detour wait-proxy` prints on success.
func (r WaitResult) String() string {
	s := fmt.Sprintf("proxy started: %s answered after %s (%d attempts)", r.Addr, r.Elapsed.Round(time.Microsecond), r.Attempts)
	if r.Unjoined != "" {
		s += "; the check's socket was not joined: " + r.Unjoined
	}
	return s
}

// Wait asks the target on each of the pod's addresses, again and again, until one answers
// (success) or the timeout passes (an error that says what was asked and what it last got).
func (w *Waiter) Wait(ctx context.Context) (WaitResult, error) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, w.cfg.Timeout)
	defer cancel()
	addrs, err := w.addrs()
	if err != nil {
		return WaitResult{}, fmt.Errorf("find the pod's addresses: %w", err)
	}
	var verdict <-chan gateVerdict
	var unjoined string
	if w.cfg.CheckPort != 0 {
		verdict = joinGate(ctx, w.cfg.CheckPort, w.joinWait)
	}
	var last error
	for attempts := 1; ; attempts++ {
		for _, a := range addrs {
			to := netip.AddrPortFrom(a, w.cfg.Target.Port)
			err := w.attempt(ctx, to)
			if err == nil {
				return WaitResult{Addr: to, Attempts: attempts, Elapsed: time.Since(start), Unjoined: unjoined}, nil
			}
			// Not the end of the wait cutting an attempt short: the dialer's own deadline can
			// fire just before the context says it is done.
			deadline, _ := ctx.Deadline()
			if ctx.Err() == nil && time.Now().Before(deadline) || last == nil {
				last = err
			}
		}
		pause := w.backoff[min(attempts-1, len(w.backoff)-1)]
		select {
		case <-ctx.Done():
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return WaitResult{}, fmt.Errorf("the proxy did not answer %s on %s within %s (%d attempts; the last: %v): it never started, or never listens there; its log says why. The kubelet now stops the proxy and starts it again, and the pod's other containers wait",
					w.cfg.Target, addrList(addrs), w.cfg.Timeout, attempts, last)
			}
			return WaitResult{}, fmt.Errorf("stopped waiting for the proxy (%s on %s): %w", w.cfg.Target, addrList(addrs), context.Cause(ctx))
		case v := <-verdict:
			switch {
			case v.err != nil:
				return WaitResult{}, v.err
			case v.unjoined != nil:
				unjoined, verdict = v.unjoined.Error(), nil
			default:
				verdict = nil // passed: the proxy starts now; ask again at once
				continue
			}
		case <-time.After(pause):
		}
	}
}

// attempt asks the target once at to.
func (w *Waiter) attempt(ctx context.Context, to netip.AddrPort) error {
	ctx, cancel := context.WithTimeout(ctx, w.cfg.AttemptTimeout)
	defer cancel()
	if w.cfg.Target.Scheme == "tcp" {
		c, err := w.dialer.DialContext(ctx, "tcp", to.String())
		if err != nil {
			return err
		}
		return c.Close()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, w.cfg.Target.Scheme+"://"+to.String()+w.cfg.Target.Path, nil)
	if err != nil {
		return err
	}
	req.Header.Set("User-Agent", "detour-wait-proxy")
	for k, v := range w.cfg.Target.Header {
		req.Header[k] = v
	}
	if h := req.Header.Get("Host"); h != "" {
		req.Host = h
	}
	resp, err := w.client.Do(req)
	if err != nil {
		return err
	}
	io.Copy(io.Discard, io.LimitReader(resp.Body, 10<<10))
	resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode >= 400 {
		return fmt.Errorf("HTTP %s", resp.Status)
	}
	return nil
}

// PodAddrs returns the pod's own addresses, where the kubelet probes the pod: its global
// unicast addresses, IPv4 first (the gate passes when the proxy answers on one of them; the
// kubelet probes the primary family's, so a proxy must listen on every family, proxy-contract
// item 1); 127.0.0.1 only when it has none.
func PodAddrs() ([]netip.Addr, error) {
	ifaces, err := net.Interfaces()
	if err != nil {
		return nil, err
	}
	var v4, v6 []netip.Addr
	for _, ifc := range ifaces {
		if ifc.Flags&net.FlagUp == 0 || ifc.Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, err := ifc.Addrs()
		if err != nil {
			return nil, err
		}
		for _, a := range addrs {
			n, ok := a.(*net.IPNet)
			if !ok {
				continue
			}
			ip, ok := netip.AddrFromSlice(n.IP)
			if !ok || !ip.IsGlobalUnicast() {
				continue
			}
			if ip = ip.Unmap(); ip.Is4() {
				v4 = append(v4, ip)
			} else {
				v6 = append(v6, ip)
			}
		}
	}
	if all := append(v4, v6...); len(all) > 0 {
		return all, nil
	}
	return []netip.Addr{netip.AddrFrom4([4]byte{127, 0, 0, 1})}, nil
}

func addrList(addrs []netip.Addr) string {
	s := make([]string, len(addrs))
	for i, a := range addrs {
		s[i] = a.String()
	}
	return strings.Join(s, ", ")
}
