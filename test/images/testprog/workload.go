package testprog

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Then separates the steps of a workload's command line.
const Then = "then"

// Workload runs the workload program's steps in order, e.g.
//
//	dial -addr 10.0.0.1:80 -must then serve -listen :8080
//
// Steps: serve, dial, id, sleep (see the usage text). It returns nil at the end of the chain
// or when ctx ends (the container is being stopped), and an error when a step fails that must
// not (dial -must) or a step is malformed.
func Workload(ctx context.Context, args []string, stdout io.Writer) error {
	if len(args) == 0 {
		return errors.New("no step given\n" + workloadUsage)
	}
	var steps [][]string
	cur := []string{}
	for _, a := range args {
		if a == Then {
			steps, cur = append(steps, cur), []string{}
			continue
		}
		cur = append(cur, a)
	}
	steps = append(steps, cur)
	// Check every step before running the first, so a typo fails at once.
	runs := make([]func() error, len(steps))
	for i, s := range steps {
		run, err := workloadStep(ctx, s, stdout)
		if err != nil {
			return fmt.Errorf("step %d %q: %w\n%s", i+1, strings.Join(s, " "), err, workloadUsage)
		}
		runs[i] = run
	}
	for _, run := range runs {
		if ctx.Err() != nil {
			return nil
		}
		if err := run(); err != nil {
			return err
		}
	}
	return nil
}

const workloadUsage = `usage: workload STEP [then STEP]...
  serve -listen :8080 [-name N] [-sink]
                                  answer each connection with one line (name, identity, addresses);
                                  with -sink, then read until the client's EOF and answer
                                  "received N bytes"
  dial -addr H:P [-must] [-retry D] [-timeout D] [-every D]
                                  connect and print the line the server sends; with -every,
                                  again at that interval until stopped, a line per dial
  load -addr H:P [-conns N] [-bytes N] [-rate C,C] [-rate-for D] [-samples F]
                                  against serve -sink: N connections one after another, each
                                  timed from connect to the server's line (p50, p99), then one
                                  that sends -bytes and waits for the count (MiB/s); with
                                  -rate, connections per second with C concurrent clients
  id                              print uid=, gid=, groups=
  sleep [D]                       sleep for D (forever without it)`

// workloadStep parses one step and returns the function that runs it.
func workloadStep(ctx context.Context, args []string, stdout io.Writer) (func() error, error) {
	if len(args) == 0 {
		return nil, errors.New("empty step")
	}
	fs := flag.NewFlagSet(args[0], flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	var run func() error
	var sleepFor time.Duration
	switch args[0] {
	case "serve":
		listen := fs.String("listen", ":8080", "address to listen on")
		name := fs.String("name", os.Getenv("HOSTNAME"), "name the answers start with (default $HOSTNAME)")
		sink := fs.Bool("sink", false, "after the line, read until EOF and answer with the count")
		run = func() error { return serve(ctx, *listen, *name, *sink, stdout) }
	case "load":
		addr := fs.String("addr", "", "address of a serve -sink (host:port)")
		conns := fs.Int("conns", 200, "connections to time")
		size := fs.Int64("bytes", 64<<20, "bytes to send through the last connection (0: none)")
		rate := fs.String("rate", "", "comma-separated numbers of concurrent clients: connections per second with each")
		rateFor := fs.Duration("rate-for", time.Second, "how long each -rate measurement runs")
		samples := fs.String("samples", "", "file to write each timed connection's nanoseconds to, one per line")
		run = func() error {
			return load(ctx, loadSpec{addr: *addr, conns: *conns, size: *size, rate: *rate, rateFor: *rateFor, samples: *samples}, stdout)
		}
	case "dial":
		addr := fs.String("addr", "", "address to connect to (host:port)")
		must := fs.Bool("must", false, "fail the chain (exit 1) when the dial fails")
		retry := fs.Duration("retry", 0, "keep trying for this long")
		timeout := fs.Duration("timeout", 5*time.Second, "time for one attempt (connect and read a line)")
		every := fs.Duration("every", 0, "after the first dial, dial again at this interval until stopped")
		run = func() error {
			line, err := dialRetry(ctx, *addr, *retry, *timeout)
			if err != nil {
				fmt.Fprintf(stdout, "dial %s failed: %v\n", *addr, err)
				if *must && ctx.Err() == nil {
					return fmt.Errorf("dial %s failed: %w", *addr, err)
				}
			} else {
				fmt.Fprintf(stdout, "dial %s ok: %s\n", *addr, line)
			}
			for *every > 0 {
				select {
				case <-ctx.Done():
					return nil
				case <-time.After(*every):
				}
				if line, err := dialLine(ctx, *addr, *timeout); err != nil {
					if ctx.Err() == nil {
						fmt.Fprintf(stdout, "dial %s failed: %v\n", *addr, err)
					}
				} else {
					fmt.Fprintf(stdout, "dial %s ok: %s\n", *addr, line)
				}
			}
			return nil
		}
	case "id":
		run = func() error {
			fmt.Fprintln(stdout, Identity())
			return nil
		}
	case "sleep":
		run = func() error { return sleep(ctx, sleepFor) }
	default:
		return nil, fmt.Errorf("unknown step %q", args[0])
	}
	if err := fs.Parse(args[1:]); err != nil {
		return nil, err
	}
	switch {
	case (args[0] == "dial" || args[0] == "load") && fs.Lookup("addr").Value.String() == "":
		return nil, fmt.Errorf("%s: -addr is required", args[0])
	case args[0] == "load" && fs.Lookup("conns").Value.(flag.Getter).Get().(int) < 1:
		return nil, errors.New("load: -conns must be at least 1")
	case args[0] == "sleep" && fs.NArg() == 1:
		d, err := time.ParseDuration(fs.Arg(0))
		if err != nil || d <= 0 {
			return nil, fmt.Errorf("sleep: %q is not a positive duration (e.g. 30s; none sleeps until stopped)", fs.Arg(0))
		}
		sleepFor = d
	case fs.NArg() != 0:
		return nil, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	return run, nil
}

// Identity is the process's identity as the workload prints it:
// "uid=1500 gid=1500 groups=1500,2600" (groups are the supplementary groups).
func Identity() string {
	groups, _ := unix.Getgroups()
	gs := make([]string, len(groups))
	for i, g := range groups {
		gs[i] = strconv.Itoa(g)
	}
	return fmt.Sprintf("uid=%d gid=%d groups=%s", os.Getuid(), os.Getgid(), strings.Join(gs, ","))
}

// serve answers every connection on addr with one line,
// "<name> uid= gid= groups= peer=<remote> local=<local>", and closes it, until ctx ends. With
// sink it then reads until the client's EOF and answers "received N bytes".
func serve(ctx context.Context, addr, name string, sink bool, stdout io.Writer) error {
	ln, err := (&net.ListenConfig{}).Listen(ctx, "tcp", addr)
	if err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	fmt.Fprintf(stdout, "serve %s listening on %s\n", name, ln.Addr())
	go func() {
		<-ctx.Done()
		ln.Close()
	}()
	id := Identity()
	for {
		c, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("serve: %w", err)
		}
		go func() {
			defer c.Close()
			c.SetWriteDeadline(time.Now().Add(5 * time.Second))
			fmt.Fprintf(c, "%s %s peer=%s local=%s\n", name, id, c.RemoteAddr(), c.LocalAddr())
			if sink {
				c.SetDeadline(time.Now().Add(5 * time.Minute))
				n, _ := io.Copy(io.Discard, c)
				fmt.Fprintf(c, "received %d bytes\n", n)
			}
		}()
	}
}

// loadSpec is what load measures.
type loadSpec struct {
	addr    string
	conns   int
	size    int64
	rate    string
	rateFor time.Duration
	samples string
}

// load measures a serve -sink at addr: conns connections one after another, each from connect
// to the server's line; with rate, the connections per second each number of concurrent clients
// completes in rateFor; then one connection that sends size bytes and reads the server's count.
// It prints "load <addr> conns=N p50=D p99=D [cps@C=N]... bytes=N seconds=S MiB/s=R".
func load(ctx context.Context, l loadSpec, stdout io.Writer) error {
	addr := l.addr
	var clients []int
	if l.rate != "" {
		for _, f := range strings.Split(l.rate, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n < 1 {
				return fmt.Errorf("load: -rate %q: write numbers of clients, e.g. 1,16", l.rate)
			}
			clients = append(clients, n)
		}
	}
	took := make([]time.Duration, 0, l.conns)
	for range l.conns {
		start := time.Now()
		if _, err := dialLine(ctx, addr, 5*time.Second); err != nil {
			return fmt.Errorf("load %s: %w", addr, err)
		}
		took = append(took, time.Since(start))
	}
	if l.samples != "" {
		var b strings.Builder
		for _, d := range took {
			fmt.Fprintln(&b, d.Nanoseconds())
		}
		if err := os.WriteFile(l.samples, []byte(b.String()), 0o644); err != nil {
			return fmt.Errorf("load: %w", err)
		}
	}
	slices.Sort(took)
	p50, p99 := took[len(took)/2], took[min(len(took)-1, len(took)*99/100)]
	line := fmt.Sprintf("load %s conns=%d p50=%s p99=%s", addr, l.conns, p50.Round(time.Microsecond), p99.Round(time.Microsecond))
	for _, n := range clients {
		cps, err := rate(ctx, addr, n, l.rateFor)
		if err != nil {
			return err
		}
		line += fmt.Sprintf(" cps@%d=%.0f", n, cps)
	}
	if l.size == 0 {
		fmt.Fprintln(stdout, line+" bytes=0")
		return nil
	}

	c, err := (&net.Dialer{Timeout: 5 * time.Second}).DialContext(ctx, "tcp", addr)
	if err != nil {
		return fmt.Errorf("load %s: %w", addr, err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Minute))
	r := bufio.NewReader(c)
	if _, err := r.ReadString('\n'); err != nil {
		return fmt.Errorf("load %s: the server's line: %w", addr, err)
	}
	start := time.Now()
	if _, err := io.CopyN(c, zeros{}, l.size); err != nil {
		return fmt.Errorf("load %s: send: %w", addr, err)
	}
	c.(*net.TCPConn).CloseWrite()
	count, err := r.ReadString('\n')
	elapsed := time.Since(start)
	if want := fmt.Sprintf("received %d bytes\n", l.size); count != want {
		return fmt.Errorf("load %s: the server answered %q (%v), want %q: is it a serve -sink?", addr, count, err, want)
	}
	fmt.Fprintf(stdout, "%s bytes=%d seconds=%.3f MiB/s=%.1f\n", line, l.size, elapsed.Seconds(), float64(l.size)/(1<<20)/elapsed.Seconds())
	return nil
}

// rate runs clients concurrent loops of connect, read the server's line, close, for d, and
// returns the connections per second they completed; any failed connection is an error.
func rate(ctx context.Context, addr string, clients int, d time.Duration) (float64, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	counts := make([]int, clients)
	errs := make(chan error, clients)
	start := time.Now()
	deadline := start.Add(d)
	for i := range clients {
		go func() {
			for time.Now().Before(deadline) {
				if _, err := dialLine(ctx, addr, 5*time.Second); err != nil {
					errs <- fmt.Errorf("load %s with %d clients: %w", addr, clients, err)
					return
				}
				counts[i]++
			}
			errs <- nil
		}()
	}
	var first error
	for range clients {
		if err := <-errs; err != nil && first == nil {
			first = err
			cancel()
		}
	}
	total := 0
	for _, n := range counts {
		total += n
	}
	return float64(total) / time.Since(start).Seconds(), first
}

// zeros reads as an endless run of zero bytes.
type zeros struct{}

func (zeros) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

// dialRetry dials addr and reads one line, trying again every 200ms for up to retry.
func dialRetry(ctx context.Context, addr string, retry, timeout time.Duration) (string, error) {
	deadline := time.Now().Add(retry)
	for {
		line, err := dialLine(ctx, addr, timeout)
		if err == nil || time.Now().After(deadline) || ctx.Err() != nil {
			return line, err
		}
		select {
		case <-ctx.Done():
			return "", err
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// dialLine connects to addr and reads the first line the server sends.
func dialLine(ctx context.Context, addr string, timeout time.Duration) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
	if err != nil {
		return "", err
	}
	defer c.Close()
	if d, ok := ctx.Deadline(); ok {
		c.SetDeadline(d)
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil && (line == "" || !errors.Is(err, io.EOF)) {
		if errors.Is(err, io.EOF) {
			return "", errors.New("connection closed before the server sent a line")
		}
		return "", err
	}
	return strings.TrimSuffix(line, "\n"), nil
}

// sleep waits for d (until ctx ends when d is 0).
func sleep(ctx context.Context, d time.Duration) error {
	if d == 0 {
		<-ctx.Done()
		return nil
	}
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
	return nil
}
