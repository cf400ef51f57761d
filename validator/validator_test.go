package validator_test

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/detourmesh/detour/validator"
)

func TestFlagsParse(t *testing.T) {
	cfg, err := validator.DefaultFlags().Parse()
	if err != nil {
		t.Fatalf("default flags: %v", err)
	}
	if cfg.Port != 4140 || cfg.Sentinel.String() != "203.0.113.254:80" || cfg.Sentinel6.String() != "[2001:db8::fe]:80" ||
		cfg.Timeout != 5*time.Second || cfg.IPv6 != validator.IPv6Auto {
		t.Errorf("default config = %+v", cfg)
	}

	for _, tc := range []struct {
		name   string
		modify func(*validator.Flags)
		want   string // in the message, besides the flag name
	}{
		{"port zero", func(f *validator.Flags) { f.Port = 0 }, `--port "0"`},
		{"port too big", func(f *validator.Flags) { f.Port = 65536 }, `--port "65536"`},
		{"sentinel without port", func(f *validator.Flags) { f.Sentinel = "203.0.113.254" }, `--sentinel "203.0.113.254"`},
		{"sentinel loopback", func(f *validator.Flags) { f.Sentinel = "127.0.0.1:80" }, "loopback is never redirected"},
		{"sentinel unspecified", func(f *validator.Flags) { f.Sentinel = "0.0.0.0:80" }, "loopback is never redirected"},
		{"sentinel multicast", func(f *validator.Flags) { f.Sentinel = "224.0.0.1:80" }, "unicast"},
		{"sentinel port zero", func(f *validator.Flags) { f.Sentinel = "203.0.113.1:0" }, "must have a port"},
		{"sentinel is ipv6", func(f *validator.Flags) { f.Sentinel = "[2001:db8::1]:80" }, "must be an IPv4 address"},
		{"sentinel6 is ipv4", func(f *validator.Flags) { f.Sentinel6 = "203.0.113.1:80" }, "must be an IPv6 address"},
		{"sentinel6 mapped ipv4", func(f *validator.Flags) { f.Sentinel6 = "[::ffff:203.0.113.1]:80" }, "must be an IPv6 address"},
		{"sentinel6 loopback", func(f *validator.Flags) { f.Sentinel6 = "[::1]:80" }, "loopback"},
		{"timeout zero", func(f *validator.Flags) { f.Timeout = 0 }, `--timeout "0s"`},
		{"timeout negative", func(f *validator.Flags) { f.Timeout = -time.Second }, `--timeout "-1s"`},
		{"timeout huge", func(f *validator.Flags) { f.Timeout = time.Hour }, "at most 5m0s"},
		{"ipv6 mode", func(f *validator.Flags) { f.IPv6 = "yes" }, `--ipv6 "yes"`},
		{"fallback port is the port", func(f *validator.Flags) { f.FallbackPort = f.Port }, `--fallback-port "4140"`},
		{"fallback port too big", func(f *validator.Flags) { f.FallbackPort = 70000 }, `--fallback-port "70000"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := validator.DefaultFlags()
			tc.modify(&f)
			_, err := f.Parse()
			if err == nil {
				t.Fatalf("Parse(%+v) succeeded", f)
			}
			if validator.Code(err) != validator.ExitUsage {
				t.Errorf("exit code %d, want %d (usage)", validator.Code(err), validator.ExitUsage)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("message %q does not contain %q", err, tc.want)
			}
		})
	}
}

func TestCode(t *testing.T) {
	if got := validator.Code(nil); got != validator.ExitOK {
		t.Errorf("Code(nil) = %d", got)
	}
	if got := validator.Code(errors.New("boom")); got != validator.ExitFailure {
		t.Errorf("Code(plain error) = %d", got)
	}
	wrapped := errors.Join(errors.New("context"), &validator.Error{Code: validator.ExitNoRedirect, Msg: "x"})
	if got := validator.Code(wrapped); got != validator.ExitNoRedirect {
		t.Errorf("Code(wrapped no-redirect) = %d", got)
	}
}

// Dialers standing in for the kernel: one that behaves like a REDIRECT to the listener's port,
// and ones that fail the way an unredirected connection does.
type redirectDialer struct{ port uint16 }

func (d redirectDialer) DialContext(ctx context.Context, network, _ string) (net.Conn, error) {
	host := "127.0.0.1"
	if network == "tcp6" {
		host = "::1"
	}
	return (&net.Dialer{}).DialContext(ctx, network, net.JoinHostPort(host, strconv.Itoa(int(d.port))))
}

type blackholeDialer struct{}

func (blackholeDialer) DialContext(ctx context.Context, _, _ string) (net.Conn, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

type errDialer struct{ err error }

func (d errDialer) DialContext(context.Context, string, string) (net.Conn, error) {
	return nil, &net.OpError{Op: "dial", Net: "tcp", Err: d.err}
}

// familyDialer sends each family to its own dialer.
type familyDialer struct{ v4, v6 validator.Dialer }

func (d familyDialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	if network == "tcp6" {
		return d.v6.DialContext(ctx, network, addr)
	}
	return d.v4.DialContext(ctx, network, addr)
}

// freePort returns a port free on both loopback addresses of this namespace.
func freePort(t *testing.T) uint16 {
	t.Helper()
	for range 20 {
		ln, err := net.Listen("tcp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		ln.Close()
		if ln6, err := net.Listen("tcp6", net.JoinHostPort("::1", strconv.Itoa(port))); err == nil {
			ln6.Close()
			return uint16(port)
		}
	}
	t.Fatal("no port free on both 127.0.0.1 and ::1")
	return 0
}

func config(t *testing.T, port uint16, ipv6 validator.IPv6Mode) validator.Config {
	t.Helper()
	f := validator.DefaultFlags()
	f.Port, f.IPv6, f.Timeout = int(port), string(ipv6), 2*time.Second
	cfg, err := f.Parse()
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

func has6(bool6 bool) validator.Option {
	return validator.WithIPv6Detector(func() (bool, error) { return bool6, nil })
}

func TestRunRedirected(t *testing.T) {
	for _, tc := range []struct {
		name     string
		mode     validator.IPv6Mode
		podHas6  bool
		families []string
	}{
		{"ipv4 only", validator.IPv6Auto, false, []string{"ipv4"}},
		{"auto with ipv6", validator.IPv6Auto, true, []string{"ipv4", "ipv6"}},
		{"always", validator.IPv6Always, false, []string{"ipv4", "ipv6"}},
		{"never", validator.IPv6Never, true, []string{"ipv4"}},
		{"on, the deprecated always", "on", false, []string{"ipv4", "ipv6"}},
		{"off, the deprecated never", "off", true, []string{"ipv4"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			port := freePort(t)
			res, err := newValidator(config(t, port, tc.mode), validator.WithDialer(redirectDialer{port}), has6(tc.podHas6)).Run(context.Background())
			if err != nil {
				t.Fatalf("Run: %v", err)
			}
			var got []string
			for _, c := range res.Checks {
				got = append(got, c.Family)
			}
			if strings.Join(got, ",") != strings.Join(tc.families, ",") {
				t.Errorf("checked %v, want %v", got, tc.families)
			}
			if line := res.String(); !strings.HasPrefix(line, "redirect in place: ipv4 connection to 203.0.113.254:80 came back to port "+strconv.Itoa(int(port))) {
				t.Errorf("success line %q", line)
			}
		})
	}
}

func TestRunNotRedirected(t *testing.T) {
	const cause = "the detour CNI plugin did not run for this pod — was the node's CNI config in place when the pod started?"
	otherServer := func(t *testing.T) validator.Dialer {
		ln, err := net.Listen("tcp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close() })
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				c.Write([]byte("HTTP/1.1 400 Bad Request\r\n\r\n"))
				c.Close()
			}
		}()
		return redirectDialer{uint16(ln.Addr().(*net.TCPAddr).Port)}
	}
	for _, tc := range []struct {
		name   string
		dialer func(t *testing.T) validator.Dialer
		want   string
	}{
		{"timeout", func(*testing.T) validator.Dialer { return blackholeDialer{} }, "the ipv4 connection to 203.0.113.254:80 timed out after 2s: " + cause},
		{"refused", func(*testing.T) validator.Dialer { return errDialer{syscall.ECONNREFUSED} }, "the ipv4 connection to 203.0.113.254:80 was refused: " + cause},
		{"unreachable", func(*testing.T) validator.Dialer { return errDialer{syscall.ENETUNREACH} }, "the network is unreachable: " + cause},
		{"another server", otherServer, `reached a server other than this validator (it answered "HTTP/1.1 400 Bad Request")`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			port := freePort(t)
			_, err := newValidator(config(t, port, validator.IPv6Never), validator.WithDialer(tc.dialer(t))).Run(context.Background())
			if code := validator.Code(err); code != validator.ExitNoRedirect {
				t.Fatalf("exit code %d (%v), want %d", code, err, validator.ExitNoRedirect)
			}
			msg := err.Error()
			want := "no redirect in this pod's network namespace: expected connections to 203.0.113.254:80 to be redirected to port " + strconv.Itoa(int(port)) + " of this pod, but "
			if !strings.HasPrefix(msg, want) || !strings.Contains(msg, tc.want) || strings.Contains(msg, "\n") {
				t.Errorf("message\n%s\nwants prefix\n%s\nand\n%s\non one line", msg, want, tc.want)
			}
		})
	}
}

func TestRunOneFamilyMissing(t *testing.T) {
	port := freePort(t)
	d := familyDialer{v4: redirectDialer{port}, v6: errDialer{syscall.ENETUNREACH}}
	_, err := newValidator(config(t, port, validator.IPv6Auto), validator.WithDialer(d), has6(true)).Run(context.Background())
	if validator.Code(err) != validator.ExitNoRedirect {
		t.Fatalf("Run = %v, want exit %d", err, validator.ExitNoRedirect)
	}
	for _, want := range []string{"203.0.113.254:80 and [2001:db8::fe]:80", "the ipv6 connection to [2001:db8::fe]:80 failed", "the redirect of one IP family only"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("message %q does not contain %q", err, want)
		}
	}
	if strings.Contains(err.Error(), "ipv4 connection") {
		t.Errorf("message %q blames the ipv4 check, which passed", err)
	}
}

// A port held when the check listens: exit 43, and the message names the socket that holds it
// (here the test's own listener, read from this namespace's /proc/net/tcp) and says what to do
// where the check runs — the validator container, or the proxy's start, whose check port is
// validator.checkPort.
func TestRunPortInUse(t *testing.T) {
	for _, tc := range []struct {
		name  string
		cfg   func(t *testing.T, port uint16) validator.Config
		who   string
		where string
	}{
		{"the validator container", func(t *testing.T, port uint16) validator.Config { return config(t, port, validator.IPv6Never) },
			"the validator", "the validator must listen on the proxy's outbound port itself"},
		{"the proxy's start", func(t *testing.T, port uint16) validator.Config { return configWithFallback(t, port, freePort(t)) },
			"the proxy", "a container of this pod listens on the port where the redirect check at the proxy's start listens (validator.checkPort)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			port := freePort(t)
			held, err := net.Listen("tcp4", "127.0.0.1:"+strconv.Itoa(int(port)))
			if err != nil {
				t.Fatal(err)
			}
			defer held.Close()
			_, err = newValidator(tc.cfg(t, port), validator.WithDialer(redirectDialer{port})).Run(context.Background())
			if validator.Code(err) != validator.ExitPortInUse {
				t.Fatalf("Run = %v, want exit %d", err, validator.ExitPortInUse)
			}
			p, uid := strconv.Itoa(int(port)), strconv.Itoa(os.Getuid())
			for _, want := range []string{
				"port " + p + " is taken by a socket listening on 127.0.0.1:" + p + " owned by uid " + uid + ", the UID " + tc.who + " runs as (uid " + uid + ")",
				tc.where,
			} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("message\n%s\nlacks\n%s", err, want)
				}
			}
		})
	}
}

func TestRunIPv6DetectionFails(t *testing.T) {
	port := freePort(t)
	detect := validator.WithIPv6Detector(func() (bool, error) { return false, errors.New("netlink: permission denied") })
	_, err := newValidator(config(t, port, validator.IPv6Auto), validator.WithDialer(redirectDialer{port}), detect).Run(context.Background())
	if validator.Code(err) != validator.ExitFailure || !strings.Contains(err.Error(), "set --ipv6=always or --ipv6=never") {
		t.Errorf("Run = %v (exit %d), want exit %d naming the fix", err, validator.Code(err), validator.ExitFailure)
	}
}

// newValidator is validator.New for a pod with an IPv4 address and routes to every sentinel;
// opts may override both.
func newValidator(cfg validator.Config, opts ...validator.Option) *validator.Validator {
	return validator.New(cfg, append([]validator.Option{
		validator.WithIPv4Detector(func() (bool, error) { return true, nil }),
		validator.WithRouteCheck(func(string, netip.AddrPort) error { return nil }),
	}, opts...)...)
}

// Issue 15.10: an IPv6-only pod is checked over IPv6 only (it has no IPv4 to be redirected).
func TestRunIPv6Only(t *testing.T) {
	port := freePort(t)
	no4 := validator.WithIPv4Detector(func() (bool, error) { return false, nil })
	res, err := newValidator(config(t, port, validator.IPv6Auto), validator.WithDialer(redirectDialer{port}), has6(true), no4).Run(context.Background())
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if len(res.Checks) != 1 || res.Checks[0].Family != "ipv6" || !strings.Contains(res.String(), "not checked: ipv4: the pod has no IPv4 address") {
		t.Errorf("result %q", res)
	}
}

// Issue 15.10: a family the pod cannot route is "no route to check with" (exit 44), not "no
// redirect" (42, which the repair controller acts on); with another family checked, it passes.
func TestRunNoRoute(t *testing.T) {
	port := freePort(t)
	noRoute := func(families ...string) validator.Option {
		return validator.WithRouteCheck(func(network string, _ netip.AddrPort) error {
			if slices.Contains(families, network) {
				return errors.New("the network is unreachable")
			}
			return nil
		})
	}
	_, err := newValidator(config(t, port, validator.IPv6Auto), validator.WithDialer(redirectDialer{port}), has6(false), noRoute("tcp4")).Run(context.Background())
	if validator.Code(err) != validator.ExitNoRoute || !strings.Contains(err.Error(), "nothing to check the redirect with: ipv6: the pod has no global IPv6 address; ipv4: no route to 203.0.113.254:80 (the network is unreachable)") ||
		!strings.Contains(err.Error(), "not a missing redirect") {
		t.Errorf("Run = %v (exit %d), want exit %d", err, validator.Code(err), validator.ExitNoRoute)
	}
	res, err := newValidator(config(t, port, validator.IPv6Auto), validator.WithDialer(redirectDialer{port}), has6(true), noRoute("tcp6")).Run(context.Background())
	if err != nil || len(res.Checks) != 1 || !strings.Contains(res.String(), "not checked: ipv6: no route to [2001:db8::fe]:80") {
		t.Errorf("Run = %q, %v; want the ipv4 check and ipv6 noted", res, err)
	}
}

// configWithFallback is config with the check on port and the outbound port as the fallback, as
// at the proxy's start.
func configWithFallback(t *testing.T, port, fallback uint16) validator.Config {
	t.Helper()
	f := validator.DefaultFlags()
	f.Port, f.FallbackPort, f.IPv6, f.Timeout = int(port), int(fallback), string(validator.IPv6Never), 2*time.Second
	cfg, err := f.Parse()
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// probingDialer dials the outbound port first (an app's connection while the check runs) and
// records how that ended, then behaves as a redirect to port.
type probingDialer struct {
	outbound, port uint16
	appErr         *error
}

func (d probingDialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	c, err := redirectDialer{d.outbound}.DialContext(ctx, network, addr)
	if err == nil {
		c.Close()
	}
	*d.appErr = err
	return redirectDialer{d.port}.DialContext(ctx, network, addr)
}

// At the proxy's start the check listens on the check port alone (issue 32, item 7): an app's
// connection to the proxy's outbound port while the check runs again (after a proxy restart) is
// refused, as when the proxy is down, instead of being answered with the check's token.
func TestRunAtTheProxysStartLeavesTheOutboundPortAlone(t *testing.T) {
	check, outbound := freePort(t), freePort(t)
	var appErr error
	res, err := newValidator(configWithFallback(t, check, outbound), validator.WithDialer(probingDialer{outbound, check, &appErr})).Run(context.Background())
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if !errors.Is(appErr, syscall.ECONNREFUSED) {
		t.Errorf("a connection to the outbound port during the check: %v, want refused", appErr)
	}
	if len(res.Checks) != 1 || res.Checks[0].Port != check {
		t.Errorf("checks %+v, want one that came back to the check port %d", res.Checks, check)
	}
}

// A node whose plugin predates detour.dev/validator-check-port sends the proxy's probe to the
// outbound port: refused on the check port, the check passes there. A probe that is not
// refused but lost (no redirect at all) is not tried again, and the check still ends within its
// timeout.
func TestRunFallsBackToTheOutboundPort(t *testing.T) {
	check, outbound := freePort(t), freePort(t)
	res, err := newValidator(configWithFallback(t, check, outbound), validator.WithDialer(redirectDialer{outbound})).Run(context.Background())
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if len(res.Checks) != 1 || res.Checks[0].Port != outbound || !strings.Contains(res.String(), "came back to port "+strconv.Itoa(int(outbound))) {
		t.Errorf("result %q, want the ipv4 check passed on the outbound port %d", res, outbound)
	}

	start := time.Now()
	_, err = newValidator(configWithFallback(t, check, outbound), validator.WithDialer(blackholeDialer{})).Run(context.Background())
	if code := validator.Code(err); code != validator.ExitNoRedirect {
		t.Fatalf("exit code %d (%v), want %d", code, err, validator.ExitNoRedirect)
	}
	if elapsed := time.Since(start); elapsed > 3*time.Second {
		t.Errorf("a lost probe took %s, want at most the 2s timeout", elapsed)
	}
}
