package iptables_test

import (
	"bufio"
	"context"
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/detourmesh/detour/internal/nsutil"
	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/test/testenv"
	"github.com/vishvananda/netlink"
)

// A pod with hostUsers: false has its network namespace owned by the pod's user namespace. The
// kernel refuses xt_owner matches (--uid-owner, --gid-owner) written from another user
// namespace (xt_owner.c owner_check: current_user_ns() != net->user_ns gives EINVAL), which is
// what the plugin, running in the host's, is. nft_meta's skuid/skgid have no such check at
// init, and evaluate the socket's fsuid/fsgid as seen from the namespace's owner
// (from_kuid_munged(sock_net(sk)->user_ns, ...)), so the pod's own UIDs are the ones to write.
// This test proves both on the running kernel: a child in a new user namespace (uids 0-65535
// mapped to 100000-165535, as containerd does) and a network namespace it owns; iptables from
// the host fails, the nftables backend from the host succeeds, and connections made inside the
// user namespace as the pod's UIDs and GIDs are redirected or not as the rules say.
func TestIntegrationNFTablesUserNamespace(t *testing.T) {
	testenv.Privileged(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	// The child runs as an unprivileged host UID (100000); it can still execute the test binary
	// in go test's closed work directory, since ChildCommand re-executes it through /proc/self/exe.
	cmd := testenv.ChildCommand(ctx, testenv.Identity{}, "userns-dialer")
	cmd.SysProcAttr.Cloneflags = syscall.CLONE_NEWUSER | syscall.CLONE_NEWNET
	cmd.SysProcAttr.UidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: 100000, Size: 65536}}
	cmd.SysProcAttr.GidMappings = []syscall.SysProcIDMap{{ContainerID: 0, HostID: 100000, Size: 65536}}
	cmd.SysProcAttr.GidMappingsEnableSetgroups = true
	// Root of the new user namespace (host UID 100000), which may take any of its identities.
	cmd.SysProcAttr.Credential = &syscall.Credential{Uid: 0, Gid: 0}
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("start the child in a new user and network namespace: %v", err)
	}
	defer func() { stdin.Close(); cmd.Wait() }()
	lines := bufio.NewScanner(stdout)
	if !lines.Scan() || lines.Text() != "ready" {
		t.Fatalf("child did not start: %q %v", lines.Text(), lines.Err())
	}
	pod := &testenv.NetNS{Name: "userns-pod", Path: fmt.Sprintf("/proc/%d/ns/net", cmd.Process.Pid)}
	if !nsutil.OwnUserNamespace(pod.Path) {
		t.Fatal("the pod's network namespace is not owned by another user namespace")
	}
	remote := testenv.NewNetNS(t)
	testenv.Link(t, pod, "eth0", []netip.Prefix{netip.MustParsePrefix("10.78.0.2/24")}, remote, "eth0", []netip.Prefix{netip.MustParsePrefix("10.78.0.1/24")})
	testenv.Serve(t, pod, "outbound", "tcp4", "0.0.0.0:4140")
	testenv.Serve(t, remote, "remote", "tcp4", "0.0.0.0:8080")
	if err := setLoopbackUp(pod); err != nil {
		t.Fatal(err)
	}

	rs, err := iptables.Build(iptables.Config{Family: iptables.IPv4, ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140,
		ExemptUIDs: []uint32{1000}, ExemptGIDs: []uint32{2601}})
	if err != nil {
		t.Fatal(err)
	}
	// The iptables tools, from the host's user namespace: the owner matches are refused.
	for _, b := range []iptables.Backend{iptables.BackendLegacy, iptables.BackendNFT} {
		err := iptables.NewExecutor(iptables.WithBackend(b)).Apply(ctx, pod.Path, rs)
		switch {
		case err == nil:
			t.Errorf("%s backend: applying owner matches from the host's user namespace succeeded; the kernel was expected to refuse them", b)
		case !strings.Contains(err.Error(), "hostUsers: false") || !strings.Contains(err.Error(), "set iptablesBackend to auto or nftables"):
			t.Errorf("%s backend: the error does not say what to do: %v", b, err)
		default:
			t.Logf("%s backend, as expected: %v", b, err)
		}
		_ = iptables.NewExecutor(iptables.WithBackend(b)).Remove(ctx, pod.Path, iptables.IPv4)
	}

	// auto chooses nftables there (a fresh namespace), so it works too.
	exec := iptables.NewExecutor()
	if err := exec.Apply(ctx, pod.Path, rs); err != nil {
		t.Fatalf("auto backend: apply from the host's user namespace: %v", err)
	}
	if _, used, err := exec.Save(ctx, pod.Path, iptables.IPv4); err != nil || used != iptables.BackendNFTables {
		t.Fatalf("auto used %q (%v) in a user-namespaced pod, want nftables", used, err)
	}
	if err := exec.Check(ctx, pod.Path, rs); err != nil {
		t.Fatalf("nftables backend: check: %v", err)
	}

	// UIDs and GIDs as the pod sees them, inside its user namespace.
	for _, tc := range []struct {
		uid, gid uint32
		want     string
	}{
		{3000, 3000, "outbound"}, // the app
		{0, 0, "outbound"},       // the pod's root (host UID 100000)
		{2102, 2102, "remote"},   // the proxy
		{1000, 1000, "remote"},   // an exempt UID
		{0, 2601, "remote"},      // root with an exempt GID
	} {
		fmt.Fprintf(stdin, "%d:%d 10.78.0.1:8080\n", tc.uid, tc.gid)
		if !lines.Scan() {
			t.Fatalf("child ended: %v", lines.Err())
		}
		got := lines.Text()
		if !strings.HasPrefix(got, tc.want+" ") {
			t.Errorf("inside the user namespace as %d:%d: %q, want %s", tc.uid, tc.gid, got, tc.want)
		} else {
			t.Logf("inside the user namespace as %d:%d (host %d:%d): %s", tc.uid, tc.gid, tc.uid+100000, tc.gid+100000, got)
		}
	}
}

func setLoopbackUp(ns *testenv.NetNS) error {
	return ns.Handle(func(h *netlink.Handle) error {
		lo, err := h.LinkByName("lo")
		if err != nil {
			return err
		}
		return h.LinkSetUp(lo)
	})
}

// usernsDialer is the child of TestIntegrationNFTablesUserNamespace: it says it is ready, then
// for each line "UID:GID ADDR" connects to ADDR as that identity of its user namespace (on a
// thread of its own) and prints the answer or the error.
func usernsDialer([]string) int {
	self := &testenv.NetNS{Name: "the child's", Path: "/proc/self/ns/net"}
	fmt.Println("ready")
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		idText, addr, _ := strings.Cut(in.Text(), " ")
		u, g, _ := strings.Cut(idText, ":")
		uid, _ := strconv.ParseUint(u, 10, 32)
		gid, _ := strconv.ParseUint(g, 10, 32)
		line, err := testenv.DialAs(self, testenv.Identity{UID: uint32(uid), GID: uint32(gid)}, nil, netip.MustParseAddrPort(addr), 2*time.Second)
		if err != nil {
			line = "error " + err.Error()
		}
		fmt.Println(line)
	}
	return 0
}
