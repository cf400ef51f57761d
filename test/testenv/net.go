package testenv

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/vishvananda/netns"

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
// as id and returns its standard output; the error carries its standard error. Like
// [ChildCommand], the child is the test binary re-executed through /proc/self/exe as id.
func RunHelper(ns *NetNS, id Identity, helper string, args ...string) (string, error) {
	var stdout, stderr bytes.Buffer
	cmd := id.Command(context.Background(), netlab.Self, args...)
	cmd.Env = append(os.Environ(), helperEnv+"="+helper)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := ns.Do(cmd.Run); err != nil {
		return stdout.String(), fmt.Errorf("%s %s as %s in %s: %w: %s", helper, strings.Join(args, " "), id, ns.Name, err, strings.TrimSpace(stderr.String()))
	}
	return stdout.String(), nil
}

const helperEnv = "DETOUR_TESTENV_HELPER"

// runHelper is the child side of RunHelper: it runs the helper, already as its identity.
func runHelper(name string) int {
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

func dialHelper(addr string) error {
	line, err := netlab.DialLine(addr, 3*time.Second)
	if err == nil {
		fmt.Println(line)
	}
	return err
}

// DialAs is [Dial] without a child process: it connects to addr from inside ns as id, with
// groups as its supplementary groups, on a goroutine locked to an OS thread of its own. That
// thread enters ns and takes on id through raw setgroups/setresgid/setresuid system calls,
// which (unlike the syscall package's, which change every thread of the process) change the
// calling thread only; it is never unlocked, so the Go runtime ends it with the goroutine
// instead of reusing a thread in another namespace and identity. It is fast enough to check
// thousands of identities in one test.
func DialAs(ns *NetNS, id Identity, groups []uint32, addr netip.AddrPort, timeout time.Duration) (string, error) {
	type result struct {
		line string
		err  error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: see above
		line, err := func() (string, error) {
			target, err := netns.GetFromPath(ns.Path)
			if err != nil {
				return "", fmt.Errorf("open network namespace %s: %w", ns.Path, err)
			}
			defer target.Close()
			if err := netns.Set(target); err != nil {
				return "", fmt.Errorf("enter network namespace %s: %w", ns.Path, err)
			}
			if err := becomeOnThread(id, groups); err != nil {
				return "", err
			}
			return netlab.DialLine(addr.String(), timeout)
		}()
		done <- result{line, err}
	}()
	r := <-done
	if r.err != nil {
		return "", fmt.Errorf("dial %s as %s in %s: %w", addr, id, ns.Name, r.err)
	}
	return r.line, nil
}

// becomeOnThread sets the calling thread's supplementary groups, GID and UID (real, effective
// and saved), in that order: once the UID is not root, the groups can no longer change.
func becomeOnThread(id Identity, groups []uint32) error {
	var list unsafe.Pointer
	if len(groups) > 0 {
		list = unsafe.Pointer(&groups[0])
	}
	if _, _, errno := syscall.RawSyscall(syscall.SYS_SETGROUPS, uintptr(len(groups)), uintptr(list), 0); errno != 0 {
		return fmt.Errorf("setgroups %v: %w", groups, errno)
	}
	gid, uid := uintptr(id.GID), uintptr(id.UID)
	if _, _, errno := syscall.RawSyscall(syscall.SYS_SETRESGID, gid, gid, gid); errno != 0 {
		return fmt.Errorf("setresgid %d: %w", id.GID, errno)
	}
	if _, _, errno := syscall.RawSyscall(syscall.SYS_SETRESUID, uid, uid, uid); errno != 0 {
		return fmt.Errorf("setresuid %d: %w", id.UID, errno)
	}
	return nil
}
