package demo

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/detourmesh/detour/internal/netlab"
)

// childEnv names what a child process of the demo stands in for: "fetch" (an init container
// downloading a URL) or "connect" (a container opening a TCP connection).
const childEnv = "DETOUR_DEMO_CHILD"

// ChildMain runs the demo's child processes; call it first in main. It returns false in the
// demo process itself, and exits in a child, which [demo.child] started as its identity.
func ChildMain() bool {
	mode := os.Getenv(childEnv)
	if mode == "" {
		return false
	}
	var err error
	switch mode {
	case "fetch":
		err = fetch(os.Args[1])
	case "connect":
		err = connect(os.Args[1])
	default:
		err = fmt.Errorf("unknown child %q", mode)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Exit(0)
	return true
}

func fetch(url string) error {
	client := &http.Client{Timeout: 3 * time.Second}
	resp, err := client.Get(url)
	if err != nil {
		var op *net.OpError
		if errors.As(err, &op) {
			return op // "dial tcp 10.213.77.3:80: connect: connection refused"
		}
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<10))
	fmt.Printf("%s %q", resp.Status, strings.TrimSpace(string(body)))
	return nil
}

func connect(addr string) error {
	line, err := netlab.DialLine(addr, 3*time.Second)
	if err == nil {
		fmt.Print(line)
	}
	return err
}

// child runs this binary as a stand-in container process inside ns, as id, and returns what it
// printed; the error carries what it printed on stderr. It re-executes itself through
// /proc/self/exe (netlab.Self), which id can execute wherever the binary is (a test binary in
// go test's work directory, closed to other users, too).
func (d *demo) child(ctx context.Context, ns *netlab.NetNS, id netlab.Identity, mode, arg string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	cmd := id.Command(ctx, netlab.Self, arg)
	cmd.Env = append(os.Environ(), childEnv+"="+mode)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := ns.Do(cmd.Start); err != nil {
		return "", err
	}
	if err := cmd.Wait(); err != nil {
		if msg := strings.TrimSpace(stderr.String()); msg != "" {
			return "", errors.New(msg)
		}
		return "", err
	}
	return strings.TrimSpace(stdout.String()), nil
}
