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
  serve -listen :8080 [-name N]   answer each connection with one line (name, identity, addresses)
  dial -addr H:P [-must] [-retry D] [-timeout D]
                                  connect and print the line the server sends
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
		run = func() error { return serve(ctx, *listen, *name, stdout) }
	case "dial":
		addr := fs.String("addr", "", "address to connect to (host:port)")
		must := fs.Bool("must", false, "fail the chain (exit 1) when the dial fails")
		retry := fs.Duration("retry", 0, "keep trying for this long")
		timeout := fs.Duration("timeout", 5*time.Second, "time for one attempt (connect and read a line)")
		run = func() error {
			line, err := dialRetry(ctx, *addr, *retry, *timeout)
			if err != nil {
				fmt.Fprintf(stdout, "dial %s failed: %v\n", *addr, err)
				if *must && ctx.Err() == nil {
					return fmt.Errorf("dial %s failed: %w", *addr, err)
				}
				return nil
			}
			fmt.Fprintf(stdout, "dial %s ok: %s\n", *addr, line)
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
	case args[0] == "dial" && fs.Lookup("addr").Value.String() == "":
		return nil, errors.New("dial: -addr is required")
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
// "<name> uid= gid= groups= peer=<remote> local=<local>", and closes it, until ctx ends.
func serve(ctx context.Context, addr, name string, stdout io.Writer) error {
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
		}()
	}
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
