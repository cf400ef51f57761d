package testenv

import (
	"bytes"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/detourmesh/detour/internal/netlab"
	"github.com/detourmesh/detour/internal/origdst"
)

// Server is a TCP listener in a namespace that answers every connection with one line,
// "<name> <original destination>", and closes it: a client learns who answered and where the
// connection was headed before any redirect.
type Server struct {
	Name string
	Addr netip.AddrPort
}

// Serve starts a Server named name on addr inside ns and stops it when the test ends. The
// network is "tcp4" or "tcp6" (IPv6-only), so one port can have a listener of each family.
func Serve(t testing.TB, ns *NetNS, name, network, addr string) *Server {
	t.Helper()
	var ln net.Listener
	err := ns.Do(func() (err error) {
		ln, err = net.Listen(network, addr)
		return err
	})
	if err != nil {
		t.Fatalf("listen on %s in %s: %v", addr, ns.Name, err)
	}
	t.Cleanup(func() { ln.Close() })
	s := &Server{Name: name, Addr: ln.Addr().(*net.TCPAddr).AddrPort()}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go s.answer(c.(*net.TCPConn))
		}
	}()
	return s
}

func (s *Server) answer(c *net.TCPConn) {
	defer c.Close()
	dst, err := origdst.Get(c)
	if err != nil {
		dst = c.LocalAddr().(*net.TCPAddr).AddrPort()
	}
	fmt.Fprintf(c, "%s %s\n", s.Name, netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port()))
}

// Identity is who a test client runs as (see netlab.Identity); the zero value is root.
type Identity = netlab.Identity

// Dial connects to addr from inside ns as id — in a child process, since a process's UID and
// GID are what iptables owner matches see — and returns the answering Server's line, such as
// "outbound 10.1.0.2:80". An error means the connection failed (refused, timed out...).
func Dial(t testing.TB, ns *NetNS, id Identity, addr netip.AddrPort) (string, error) {
	t.Helper()
	out, err := RunHelper(ns, id, "dial", addr.String())
	return strings.TrimSpace(out), err
}

// RunHelper runs one of this package's helper commands in a child of the test binary inside ns
// as id and returns its standard output; the error carries its standard error.
func RunHelper(ns *NetNS, id Identity, helper string, args ...string) (string, error) {
	var stdout, stderr bytes.Buffer
	err := ns.Do(func() error {
		cmd := exec.Command(os.Args[0], args...)
		cmd.Env = append(os.Environ(), helperEnv+"="+helper,
			"DETOUR_HELPER_UID="+strconv.FormatUint(uint64(id.UID), 10),
			"DETOUR_HELPER_GID="+strconv.FormatUint(uint64(id.GID), 10))
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		return cmd.Run()
	})
	if err != nil {
		return stdout.String(), fmt.Errorf("%s %s as %s in %s: %w: %s", helper, strings.Join(args, " "), id, ns.Name, err, strings.TrimSpace(stderr.String()))
	}
	return stdout.String(), nil
}

const helperEnv = "DETOUR_TESTENV_HELPER"

// runHelper is the child side of RunHelper: it takes on the requested identity (the test
// binary may not be executable by that UID, so the child starts as root and drops), then runs
// the helper.
func runHelper(name string) int {
	uid, _ := strconv.ParseUint(os.Getenv("DETOUR_HELPER_UID"), 10, 32)
	gid, _ := strconv.ParseUint(os.Getenv("DETOUR_HELPER_GID"), 10, 32)
	if err := becomeIdentity(int(uid), int(gid)); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	var err error
	switch name {
	case "dial":
		err = dialHelper(os.Args[1])
	case "id":
		fmt.Println(os.Getuid(), os.Getgid())
	default:
		err = fmt.Errorf("unknown helper %q", name)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return 0
}

func becomeIdentity(uid, gid int) error {
	return Identity{UID: uint32(uid), GID: uint32(gid)}.Become()
}

func dialHelper(addr string) error {
	line, err := netlab.DialLine(addr, 3*time.Second)
	if err == nil {
		fmt.Println(line)
	}
	return err
}
