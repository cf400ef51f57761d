package images

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/inject"
	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/test/testenv"
)

// TestIntegrationHAProxy checks HAProxy, with the configuration of the HAProxy image, against
// what detour needs of a proxy (docs/proxy-contract.md), behind detour's own rules in a pod-like
// network namespace, running as the proxy UID:
//   - an IPv4 app connection goes to its original destination, which HAProxy's log names;
//   - an inbound IPv4 connection reaches the app on the pod's address;
//   - an IPv6 connection, outbound or inbound, whose original destination HAProxy 2.6 cannot
//     read, is reset, and HAProxy does not connect to itself (the loop its 0.0.0.0:0 server
//     would make);
//   - /ready answers with the downward API's values, /identity serves the token file;
//   - SIGTERM ends it, as its PID namespace's init (as in a container), with exit code 0.
func TestIntegrationHAProxy(t *testing.T) {
	testenv.Privileged(t)
	if _, err := os.Stat(HAProxyBinary); err != nil {
		t.Fatalf("%s: %v (bash hack/host-deps.sh installs Debian's haproxy package)", HAProxyBinary, err)
	}
	const appUID, proxyUID = 1500, inject.DefaultProxyUID
	ctx := context.Background()
	dir, built := buildForUIDs(t)
	cfgPath := filepath.Join(dir, "haproxy.cfg")
	if err := os.WriteFile(cfgPath, []byte(haproxyTestConfig(t, dir)), 0o644); err != nil {
		t.Fatal(err)
	}

	l := newPodAndPeer(t, 98)
	pod, peer, podIP4, peerIP4, podIP6, peerIP6 := l.pod, l.peer, l.pod4, l.peer4, l.pod6, l.peer6
	var rulesets []iptables.Ruleset
	for _, f := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
		rs, err := iptables.Build(iptables.Config{
			Family: f, ProxyUID: proxyUID, InboundListening: true,
			InboundPort: inject.DefaultProxyInboundPort, OutboundPort: inject.DefaultProxyOutboundPort,
			SkipInboundPorts: []annotations.PortRange{{First: inject.DefaultProxyAdminPort, Last: inject.DefaultProxyAdminPort}},
		})
		if err != nil {
			t.Fatal(err)
		}
		rulesets = append(rulesets, rs)
	}
	if err := iptables.NewExecutor(iptables.WithBackend(iptables.BackendNFTables)).Apply(ctx, pod.Path, rulesets...); err != nil {
		t.Fatal(err)
	}

	ha, haproxyLog := startHAProxy(t, pod, dir, cfgPath, podIP4)
	start(t, pod, appUID, built.Bin(workloadProg), "serve", "-listen", ":8080", "-name", "app")
	start(t, peer, 0, built.Bin(workloadProg), "serve", "-listen", ":8080", "-name", "peer")

	// The admin frontend, from inside the pod, once HAProxy listens.
	get := func(path string) (string, error) {
		var body string
		err := pod.Do(func() error {
			// On this thread, in the pod's namespace: an http.Client would dial from another.
			c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", inject.DefaultProxyAdminPort), 2*time.Second)
			if err != nil {
				return err
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(2 * time.Second))
			fmt.Fprintf(c, "GET %s HTTP/1.0\r\n\r\n", path)
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			b, err := io.ReadAll(resp.Body)
			body = string(b)
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("%s: %s", resp.Status, body)
			}
			return err
		})
		return body, err
	}
	var ready string
	var err error
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if ready, err = get("/ready"); err == nil || time.Now().After(deadline) {
			break
		}
	}
	if ready != "ready web-0 "+podIP4.String()+"\n" || err != nil {
		t.Fatalf("/ready: %q, %v\n%s", ready, err, readLog(haproxyLog))
	}
	if id, err := get("/identity"); id != "token-for-mesh.example\n" || err != nil {
		t.Errorf("/identity: %q, %v", id, err)
	}

	// Outbound over IPv4: HAProxy reads the original destination and connects there.
	peer4, pod4 := netip.AddrPortFrom(peerIP4, 8080), netip.AddrPortFrom(podIP4, 8080)
	out := run(t, pod, appUID, built.Bin(workloadProg), "dial", "-addr", peer4.String(), "-must", "-retry", "5s")
	if !strings.HasPrefix(out, "dial "+peer4.String()+" ok: peer ") || !strings.Contains(out, "peer="+podIP4.String()+":") {
		t.Errorf("outbound: %q, want the peer's answer", out)
	}
	waitLog(t, haproxyLog, `detour-haproxy outbound `+regexp.QuoteMeta(podIP4.String())+`:\d+ original=`+regexp.QuoteMeta(peer4.String())+` server=`+regexp.QuoteMeta(peer4.String())+` `)

	// Inbound over IPv4: to the app on the pod's address, from HAProxy.
	out = run(t, peer, 0, built.Bin(workloadProg), "dial", "-addr", pod4.String(), "-must", "-retry", "5s")
	if !strings.HasPrefix(out, "dial "+pod4.String()+fmt.Sprintf(" ok: app uid=%d", appUID)) {
		t.Errorf("inbound: %q, want the app's answer", out)
	}
	waitLog(t, haproxyLog, `detour-haproxy inbound `+regexp.QuoteMeta(peerIP4.String())+`:\d+ original=`+regexp.QuoteMeta(pod4.String())+` `)

	// Outbound to an address nobody answers on the peer's link: HAProxy tries it once (retries
	// 0), so the app's connection ends when that one connect fails (the neighbour's address
	// unresolved, about 3 s), not after four tries.
	began := time.Now()
	unused := podIP4.As4()
	unused[3] = 200
	nobody := netip.AddrPortFrom(netip.AddrFrom4(unused), 8080)
	line, err := testenv.DialAs(pod, testenv.Identity{UID: appUID, GID: appUID}, nil, nobody, 30*time.Second)
	if took := time.Since(began); line != "" || took > 8*time.Second {
		t.Errorf("outbound to %s: %q, %v after %s; want the connection closed after one failed connect (under 8 s)", nobody, line, err, took.Round(time.Millisecond))
	} else {
		t.Logf("outbound to %s: closed after %s (%v)", nobody, took.Round(time.Millisecond), err)
	}

	// Outbound over IPv6: reset at once, and no connection of HAProxy to itself.
	line, err = testenv.DialAs(pod, testenv.Identity{UID: appUID, GID: appUID}, nil, netip.AddrPortFrom(peerIP6, 8080), 5*time.Second)
	if line != "" || (err != nil && !errors.Is(err, syscall.ECONNRESET)) {
		t.Errorf("IPv6 outbound: %q, %v; want a reset (HAProxy 2.6 cannot read its original destination)", line, err)
	}
	// Inbound over IPv6: the peer's connection to the app is reset the same way.
	line, err = testenv.DialAs(peer, testenv.Identity{}, nil, netip.AddrPortFrom(podIP6, 8080), 5*time.Second)
	if line != "" || (err != nil && !errors.Is(err, syscall.ECONNRESET)) {
		t.Errorf("IPv6 inbound: %q, %v; want a reset", line, err)
	}
	if n := selfConnections(t, pod); n > 0 {
		t.Errorf("HAProxy holds %d connections to its own ports: the IPv6 loop", n)
	}

	ha.stop(t)
	t.Logf("HAProxy log:\n%s", readLog(haproxyLog))
}

// haproxyTestConfig is HAProxyConfig with the volumes the webhook mounts made in dir: a
// writable run directory, and an identity token that reads "token-for-mesh.example".
func haproxyTestConfig(t testing.TB, dir string) string {
	t.Helper()
	runDir, token := filepath.Join(dir, "run"), filepath.Join(dir, "token")
	if err := os.Mkdir(runDir, 0o777); err != nil {
		t.Fatal(err)
	}
	os.Chmod(runDir, 0o777) // for the proxy UID, whatever the umask
	if err := os.WriteFile(token, []byte("token-for-mesh.example\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return strings.NewReplacer("/run/haproxy/", runDir+"/", "/var/run/secrets/mesh/token", token).Replace(string(HAProxyConfig))
}

// haproxyProcess is HAProxy started by startHAProxy.
type haproxyProcess struct {
	cmd    *exec.Cmd
	exited chan error
}

// startHAProxy runs HAProxy as the image does (HAProxyCommand) with the configuration at
// cfgPath, in ns as the proxy UID and as PID 1 of a PID namespace of its own, as in a container,
// with the downward API's POD_NAME (web-0) and POD_IP (podIP), logging to a file in dir whose
// path it returns; it is killed at the end of the test unless stop ended it.
func startHAProxy(t testing.TB, ns *testenv.NetNS, dir, cfgPath string, podIP netip.Addr) (*haproxyProcess, string) {
	t.Helper()
	log := filepath.Join(dir, "haproxy.log")
	f, err := os.Create(log)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	const uid = inject.DefaultProxyUID
	args := slices.Clone(HAProxyCommand[1:])
	args[len(args)-1] = cfgPath
	cmd := testenv.Identity{UID: uid, GID: uid}.Command(context.Background(), HAProxyBinary, args...)
	cmd.SysProcAttr.Cloneflags |= syscall.CLONE_NEWPID
	cmd.Env = append(os.Environ(), "POD_NAME=web-0", "POD_IP="+podIP.String())
	cmd.Stdout, cmd.Stderr = f, f
	if err := ns.Do(cmd.Start); err != nil {
		t.Fatal(err)
	}
	p := &haproxyProcess{cmd: cmd, exited: make(chan error, 1)}
	go func() { p.exited <- cmd.Wait() }()
	t.Cleanup(func() {
		select {
		case <-p.exited:
		default:
			cmd.Process.Kill()
			<-p.exited
		}
	})
	return p, log
}

// stop sends SIGTERM, which must end HAProxy with exit code 0: its master stops the worker.
func (p *haproxyProcess) stop(t testing.TB) {
	t.Helper()
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-p.exited:
		if err != nil {
			t.Errorf("HAProxy on SIGTERM: %v, want exit code 0", err)
		}
		p.exited <- err
	case <-time.After(10 * time.Second):
		t.Errorf("HAProxy did not exit on SIGTERM")
	}
}

// selfConnections counts the pod's TCP connections to the proxy's own redirect ports.
func selfConnections(t *testing.T, ns *testenv.NetNS) int {
	t.Helper()
	n := 0
	err := ns.Do(func() error {
		for _, file := range []string{"/proc/thread-self/net/tcp", "/proc/thread-self/net/tcp6"} {
			b, err := os.ReadFile(file)
			if err != nil {
				return err
			}
			for _, line := range strings.Split(string(b), "\n")[1:] {
				fields := strings.Fields(line)
				if len(fields) < 3 {
					continue
				}
				for _, port := range []uint16{inject.DefaultProxyOutboundPort, inject.DefaultProxyInboundPort} {
					if strings.HasSuffix(fields[2], fmt.Sprintf(":%04X", port)) {
						n++
					}
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}
