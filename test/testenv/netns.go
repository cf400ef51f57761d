package testenv

import (
	"net/netip"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/detourmesh/detour/internal/netlab"
)

// nsRoot holds the bind mounts that keep test namespaces alive, one directory per test
// process, so parallel test binaries never touch each other's.
const nsRoot = "/run/detour-test"

// NetNS is a network namespace a test created (see netlab.NetNS).
type NetNS = netlab.NetNS

// NewNetNS creates a network namespace with loopback up and removes it when the test ends.
func NewNetNS(t testing.TB) *NetNS {
	t.Helper()
	Privileged(t)
	netlab.Sweep(nsRoot)
	ns, err := netlab.Create(netlab.ProcessDir(nsRoot))
	if err != nil {
		t.Fatalf("create network namespace: %v", err)
	}
	t.Cleanup(func() {
		if err := ns.Remove(); err != nil {
			t.Errorf("remove network namespace: %v", err)
		}
	})
	return ns
}

func removeNamespaceDir() { os.Remove(netlab.ProcessDir(nsRoot)) }

// Link connects namespaces a and b with a veth pair named ifA (in a) and ifB (in b), gives each
// end its addresses (private ones, between the test's own namespaces only) and brings both up.
func Link(t testing.TB, a *NetNS, ifA string, addrsA []netip.Prefix, b *NetNS, ifB string, addrsB []netip.Prefix) {
	t.Helper()
	if err := netlab.Link(a, ifA, addrsA, b, ifB, addrsB); err != nil {
		t.Fatal(err)
	}
}

// AddRoute adds a route to dst via gw inside the namespace (default routes use 0.0.0.0/0 or ::/0).
func AddRoute(t testing.TB, ns *NetNS, dst netip.Prefix, gw netip.Addr) {
	t.Helper()
	if err := netlab.AddRoute(ns, dst, gw); err != nil {
		t.Fatal(err)
	}
}

// LockHost holds, until t ends, a lock that the tests which change the host's own network
// namespace or count its links and mounts take, so that go test's packages, which run in
// parallel, do not see each other's (the demo's bridge, a node's leftovers).
func LockHost(t testing.TB) { lockHost(t, syscall.LOCK_EX) }

// ShareHost holds, until t ends, the same lock shared: for a test that adds links to the
// host's network namespace and removes them again (a [Bridge]), beside others that do the same
// but never while a test that counts the host's links runs.
func ShareHost(t testing.TB) { lockHost(t, syscall.LOCK_SH) }

func lockHost(t testing.TB, how int) {
	t.Helper()
	if err := os.MkdirAll(nsRoot, 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(filepath.Join(nsRoot, "host.lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Flock(int(f.Fd()), how); err != nil {
		f.Close()
		t.Fatalf("lock %s: %v", f.Name(), err)
	}
	t.Cleanup(func() { f.Close() })
}
