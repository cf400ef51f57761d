package images

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/detourmesh/detour/inject"
	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/test/testenv"
)

// TestIntegrationTestProxy runs the built testproxy and workload binaries in a pod-like network
// namespace with detour's own rules (iptables.Build, one Executor), as the proxy UID and an
// app UID, and a peer namespace on a veth, over IPv4 and IPv6:
//   - the app's outbound connection is redirected to the proxy, which recovers the original
//     destination (SO_ORIGINAL_DST, IP6T_SO_ORIGINAL_DST) and connects there;
//   - the peer's inbound connection is redirected to the proxy, which forwards it to the app on
//     127.0.0.1 (the app sees the proxy as its peer);
//   - /ready answers, and every program exits 0 on SIGTERM.
func TestIntegrationTestProxy(t *testing.T) {
	testenv.Privileged(t)
	const appUID, proxyUID = 1500, inject.DefaultProxyUID
	ctx := context.Background()

	_, built := buildForUIDs(t)

	l := newPodAndPeer(t, 99)
	pod, peer, podIP4, peerIP4, podIP6, peerIP6 := l.pod, l.peer, l.pod4, l.peer4, l.pod6, l.peer6

	var rulesets []iptables.Ruleset
	for _, f := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
		rs, err := iptables.Build(iptables.Config{
			Family:       f,
			ProxyUID:     proxyUID,
			InboundPort:  inject.DefaultProxyInboundPort,
			OutboundPort: inject.DefaultProxyOutboundPort,
		})
		if err != nil {
			t.Fatal(err)
		}
		rulesets = append(rulesets, rs)
	}
	if err := iptables.NewExecutor().Apply(ctx, pod.Path, rulesets...); err != nil {
		t.Fatal(err)
	}

	proxyLog := start(t, pod, proxyUID, built.Bin(proxyProg)) // detour's default ports
	waitLog(t, proxyLog, `proxy admin listening`)
	start(t, pod, appUID, built.Bin(workloadProg), "serve", "-listen", ":8080", "-name", "app")
	start(t, peer, 0, built.Bin(workloadProg), "serve", "-listen", ":8080", "-name", "peer")

	// The admin port, from inside the pod.
	var ready string
	if err := pod.Do(func() error {
		c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", inject.DefaultProxyAdminPort), 5*time.Second)
		if err != nil {
			return err
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(5 * time.Second))
		fmt.Fprint(c, "GET /ready HTTP/1.0\r\n\r\n")
		status, err := bufio.NewReader(c).ReadString('\n')
		ready = strings.TrimSpace(status)
		return err
	}); err != nil || ready != "HTTP/1.0 200 OK" {
		t.Errorf("/ready: %q, %v", ready, err)
	}

	for _, fam := range []struct {
		name      string
		pod, peer netip.Addr
		lo        string // where the proxy hands an inbound connection to the app
	}{
		{"ipv4", podIP4, peerIP4, `127\.0\.0\.1`},
		{"ipv6", podIP6, peerIP6, `\[::1\]`},
	} {
		t.Run(fam.name, func(t *testing.T) {
			peerAddr := netip.AddrPortFrom(fam.peer, 8080)
			podAddr := netip.AddrPortFrom(fam.pod, 8080)

			// Outbound: the app dials the peer; the proxy takes the connection there.
			out := run(t, pod, appUID, built.Bin(workloadProg), "dial", "-addr", peerAddr.String(), "-must", "-retry", "5s")
			want := regexp.MustCompile(`^dial ` + regexp.QuoteMeta(peerAddr.String()) + ` ok: peer uid=0 gid=0 groups=\S* peer=` +
				regexp.QuoteMeta(addrPrefix(fam.pod)) + `\d+ local=` + regexp.QuoteMeta(peerAddr.String()) + `$`)
			if !want.MatchString(out) {
				t.Errorf("outbound: %q, want %s", out, want)
			}
			waitLog(t, proxyLog, `proxy outbound `+regexp.QuoteMeta(addrPrefix(fam.pod))+`\d+ -> `+regexp.QuoteMeta(peerAddr.String())+`\n`)

			// Inbound: the peer dials the pod; the proxy hands the connection to the app.
			out = run(t, peer, 0, built.Bin(workloadProg), "dial", "-addr", podAddr.String(), "-must", "-retry", "5s")
			want = regexp.MustCompile(`^dial ` + regexp.QuoteMeta(podAddr.String()) + fmt.Sprintf(` ok: app uid=%d gid=%d groups=\S* peer=%s:\d+ local=%s:8080$`, appUID, appUID, fam.lo, fam.lo))
			if !want.MatchString(out) {
				t.Errorf("inbound: %q, want %s", out, want)
			}
			waitLog(t, proxyLog, `proxy inbound `+regexp.QuoteMeta(addrPrefix(fam.peer))+`\d+ -> `+regexp.QuoteMeta(podAddr.String())+` app `+fam.lo+`:8080\n`)
		})
	}
	t.Logf("proxy log:\n%s", readLog(proxyLog))
}

// podAndPeer is a pod-like network namespace and a peer linked by a veth (eth0 in each), with
// their IPv4 and IPv6 addresses.
type podAndPeer struct {
	pod, peer                *testenv.NetNS
	pod4, peer4, pod6, peer6 netip.Addr
}

// newPodAndPeer links a new pod and peer: 10.<n>.0.2 and fd<n>::2 the pod's, 10.<n>.0.1 and
// fd<n>::1 the peer's (n from 10 to 99, one per test of the package).
func newPodAndPeer(t testing.TB, n int) podAndPeer {
	t.Helper()
	l := podAndPeer{
		pod: testenv.NewNetNS(t), peer: testenv.NewNetNS(t),
		pod4: netip.MustParseAddr(fmt.Sprintf("10.%d.0.2", n)), peer4: netip.MustParseAddr(fmt.Sprintf("10.%d.0.1", n)),
		pod6: netip.MustParseAddr(fmt.Sprintf("fd%d::2", n)), peer6: netip.MustParseAddr(fmt.Sprintf("fd%d::1", n)),
	}
	testenv.Link(t, l.pod, "eth0", []netip.Prefix{netip.PrefixFrom(l.pod4, 24), netip.PrefixFrom(l.pod6, 64)},
		l.peer, "eth0", []netip.Prefix{netip.PrefixFrom(l.peer4, 24), netip.PrefixFrom(l.peer6, 64)})
	return l
}

// buildForUIDs builds the test images and programs into a directory of their own, which the
// proxy and app UIDs may read and execute (t.TempDir's parents are private), removed when the
// test ends.
func buildForUIDs(t testing.TB) (string, *Built) {
	t.Helper()
	dir, err := os.MkdirTemp("", "detour-images-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	built, err := Build(context.Background(), dir)
	if err != nil {
		t.Fatal(err)
	}
	return dir, built
}

// addrPrefix is how an address:port of a starts, without the port: "10.0.0.1:", "[fd::1]:".
func addrPrefix(a netip.Addr) string {
	s := netip.AddrPortFrom(a, 1).String()
	return s[:len(s)-1]
}

// start runs bin with args in ns as uid (and the same gid) until the test ends, when it must
// exit 0 on SIGTERM. It returns the file its output goes to.
func start(t testing.TB, ns *testenv.NetNS, uid int, bin string, args ...string) string {
	t.Helper()
	log := filepath.Join(t.TempDir(), filepath.Base(bin)+".log")
	f, err := os.Create(log)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cmd := command(bin, uid, f, args...)
	if err := ns.Do(cmd.Start); err != nil {
		t.Fatalf("start %s %q: %v", bin, args, err)
	}
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("%s %q on SIGTERM: %v\n%s", filepath.Base(bin), args, err, readLog(log))
			}
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			t.Errorf("%s %q did not exit on SIGTERM", filepath.Base(bin), args)
			<-done
		}
	})
	return log
}

// run runs bin with args in ns as uid and returns its output, failing the test if it fails.
func run(t testing.TB, ns *testenv.NetNS, uid int, bin string, args ...string) string {
	t.Helper()
	log := filepath.Join(t.TempDir(), "run.log")
	f, err := os.Create(log)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cmd := command(bin, uid, f, args...)
	if err := ns.Do(cmd.Start); err != nil {
		t.Fatalf("start %s %q: %v", bin, args, err)
	}
	err = cmd.Wait()
	out := strings.TrimSpace(readLog(log))
	if err != nil {
		t.Errorf("%s %q: %v\n%s", filepath.Base(bin), args, err, out)
	}
	return out
}

// command is bin with args as uid:uid (no supplementary groups), its output in f. Started from
// a thread in a network namespace, it runs there; with a file for its output, no goroutine
// copies it. It is not bound to the test's context: start stops it with SIGTERM at cleanup.
func command(bin string, uid int, f *os.File, args ...string) *exec.Cmd {
	cmd := testenv.Identity{UID: uint32(uid), GID: uint32(uid)}.Command(context.Background(), bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	return cmd
}

func readLog(path string) string {
	b, _ := os.ReadFile(path)
	return string(b)
}

// waitLog waits until the file at path matches re.
func waitLog(t testing.TB, path, re string) {
	t.Helper()
	r := regexp.MustCompile(re)
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if r.MatchString(readLog(path)) {
			return
		}
	}
	t.Fatalf("no %q in %s:\n%s", re, filepath.Base(path), readLog(path))
}
