package testprog

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"time"

	"github.com/detourmesh/detour/internal/origdst"
)

// The proxy's default ports: detour's (webhook.DefaultProxyOutboundPort, ...InboundPort,
// ...AdminPort; a test keeps them equal without linking the webhook into the program).
const (
	DefaultOutbound = ":4140"
	DefaultInbound  = ":4143"
	DefaultAdmin    = ":4191"
)

// Proxy is the test proxy: a transparent proxy for connections detour's rules redirect to it.
type Proxy struct {
	// Outbound receives the pod's redirected outgoing connections; the proxy recovers each
	// one's original destination (SO_ORIGINAL_DST, IP6T_SO_ORIGINAL_DST), connects there and
	// copies bytes both ways.
	Outbound string
	// Inbound receives redirected incoming connections; the proxy forwards each to
	// 127.0.0.1:<original port>, where the app listens ([::1] for an IPv6 connection).
	Inbound string
	// Admin serves HTTP /ready (200 "ready").
	Admin string
	// Log gets one line per connection.
	Log *log.Logger
	// DialTimeout bounds the proxy's own connection to a destination (default 5s; the
	// NetworkPolicy analysis, upstream.NetpolDialTimeout, counts on it).
	DialTimeout time.Duration
	// ListenDelay is how long the proxy waits after its start before it listens: a production
	// proxy that loads its configuration and identity first (the start gate's stories).
	ListenDelay time.Duration
}

// RunProxy parses the proxy's flags (-outbound, -inbound, -admin) and runs it until ctx ends,
// logging to stdout.
func RunProxy(ctx context.Context, args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("testproxy", flag.ContinueOnError)
	p := &Proxy{Log: log.New(stdout, "", 0)}
	fs.StringVar(&p.Outbound, "outbound", DefaultOutbound, "listen address for redirected outbound connections")
	fs.StringVar(&p.Inbound, "inbound", DefaultInbound, "listen address for redirected inbound connections")
	fs.StringVar(&p.Admin, "admin", DefaultAdmin, "listen address of the admin server (/ready)")
	fs.DurationVar(&p.ListenDelay, "listen-delay", 0, "wait this long after the start before listening, as a proxy that loads its configuration first")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	return p.Run(ctx)
}

// Run listens on the three addresses and serves until ctx ends; then it closes the listeners
// and returns nil. An address without a host (":4140") gets one IPv4 and one IPv6 listener,
// so each family's connections come in on a socket of that family (the IPv6 one is skipped
// where the namespace has no IPv6).
func (p *Proxy) Run(ctx context.Context) error {
	if p.Log == nil {
		p.Log = log.New(io.Discard, "", 0)
	}
	if p.DialTimeout == 0 {
		p.DialTimeout = 5 * time.Second
	}
	if p.ListenDelay > 0 {
		p.Log.Printf("proxy starting: listening in %s", p.ListenDelay)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(p.ListenDelay):
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var lns []net.Listener
	defer func() {
		for _, ln := range lns {
			ln.Close()
		}
	}()
	var wg sync.WaitGroup
	errc := make(chan error, 8)
	for _, l := range []struct {
		what, addr string
		handle     func(context.Context, *net.TCPConn)
	}{
		{"outbound", p.Outbound, p.outbound},
		{"inbound", p.Inbound, p.inbound},
	} {
		ls, err := listenFamilies(ctx, l.addr)
		if err != nil {
			return fmt.Errorf("proxy %s listener: %w", l.what, err)
		}
		for _, ln := range ls {
			lns = append(lns, ln)
			p.Log.Printf("proxy %s listening on %s", l.what, ln.Addr())
			wg.Add(1)
			go func() {
				defer wg.Done()
				errc <- acceptLoop(ctx, ln, l.handle)
			}()
		}
	}
	admin, err := (&net.ListenConfig{}).Listen(ctx, "tcp", p.Admin)
	if err != nil {
		return fmt.Errorf("proxy admin listener: %w", err)
	}
	lns = append(lns, admin)
	p.Log.Printf("proxy admin listening on %s", admin.Addr())
	mux := http.NewServeMux()
	mux.HandleFunc("/ready", func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ready") })
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	wg.Add(1)
	go func() {
		defer wg.Done()
		if err := srv.Serve(admin); err != nil && !errors.Is(err, http.ErrServerClosed) && ctx.Err() == nil {
			errc <- fmt.Errorf("proxy admin: %w", err)
		}
	}()

	select {
	case <-ctx.Done():
		err = nil
	case err = <-errc:
	}
	cancel()
	srv.Close()
	for _, ln := range lns {
		ln.Close()
	}
	wg.Wait()
	return err
}

// listenFamilies listens on addr; a wildcard address gets a listener per family.
func listenFamilies(ctx context.Context, addr string) ([]net.Listener, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, err
	}
	lc := &net.ListenConfig{}
	if host != "" {
		ln, err := lc.Listen(ctx, "tcp", addr)
		if err != nil {
			return nil, err
		}
		return []net.Listener{ln}, nil
	}
	ln4, err := lc.Listen(ctx, "tcp4", addr)
	if err != nil {
		return nil, err
	}
	// "tcp6" on the wildcard address is IPv6-only, beside the IPv4 listener on the same port.
	ln6, err := lc.Listen(ctx, "tcp6", addr)
	if err != nil {
		return []net.Listener{ln4}, nil
	}
	return []net.Listener{ln4, ln6}, nil
}

func acceptLoop(ctx context.Context, ln net.Listener, handle func(context.Context, *net.TCPConn)) error {
	for {
		c, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return fmt.Errorf("accept on %s: %w", ln.Addr(), err)
		}
		go handle(ctx, c.(*net.TCPConn))
	}
}

// outbound forwards a redirected outgoing connection to its original destination.
func (p *Proxy) outbound(ctx context.Context, c *net.TCPConn) {
	defer c.Close()
	dst, err := origdst.Get(c)
	if err != nil {
		p.Log.Printf("proxy outbound %s -> ? failed: %v", c.RemoteAddr(), err)
		return
	}
	dst = netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())
	if notRedirected(c, dst) {
		p.Log.Printf("proxy outbound %s -> %s failed: not a redirected connection", c.RemoteAddr(), dst)
		return
	}
	p.forward(ctx, c, fmt.Sprintf("proxy outbound %s -> %s", c.RemoteAddr(), dst), dst.String())
}

// inbound forwards a redirected incoming connection to the app on the loopback address of
// its family (127.0.0.1 or ::1) and the original port.
func (p *Proxy) inbound(ctx context.Context, c *net.TCPConn) {
	defer c.Close()
	dst, err := origdst.Get(c)
	if err != nil {
		p.Log.Printf("proxy inbound %s -> ? failed: %v", c.RemoteAddr(), err)
		return
	}
	dst = netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())
	if notRedirected(c, dst) {
		p.Log.Printf("proxy inbound %s -> %s failed: not a redirected connection", c.RemoteAddr(), dst)
		return
	}
	lo := netip.AddrFrom4([4]byte{127, 0, 0, 1})
	if dst.Addr().Is6() {
		lo = netip.IPv6Loopback()
	}
	app := netip.AddrPortFrom(lo, dst.Port()).String()
	p.forward(ctx, c, fmt.Sprintf("proxy inbound %s -> %s app %s", c.RemoteAddr(), dst, app), app)
}

// notRedirected reports whether the connection came to the listener's port directly: its
// original destination is the listener's own port, where forwarding would loop back.
func notRedirected(c *net.TCPConn, dst netip.AddrPort) bool {
	return c.LocalAddr().(*net.TCPAddr).AddrPort().Port() == dst.Port()
}

// forward connects to addr, logs line (with the error if it fails) and copies bytes both ways
// until both directions are done.
func (p *Proxy) forward(ctx context.Context, c *net.TCPConn, line, addr string) {
	dctx, cancel := context.WithTimeout(ctx, p.DialTimeout)
	up, err := (&net.Dialer{}).DialContext(dctx, "tcp", addr)
	cancel()
	if err != nil {
		p.Log.Printf("%s failed: %v", line, err)
		return
	}
	p.Log.Print(line)
	u := up.(*net.TCPConn)
	defer u.Close()
	stop := context.AfterFunc(ctx, func() { c.Close(); u.Close() })
	defer stop()
	var wg sync.WaitGroup
	wg.Add(2)
	pipe := func(dst, src *net.TCPConn) {
		defer wg.Done()
		io.Copy(dst, src)
		dst.CloseWrite()
	}
	go pipe(u, c)
	go pipe(c, u)
	wg.Wait()
}
