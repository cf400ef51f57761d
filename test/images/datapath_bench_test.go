package images

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/inject"
	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/test/testenv"
)

// linkerdRules are the nat rules Linkerd's proxy-init writes for a pod with its defaults
// (iptablesMode legacy; proxy UID 2102; inbound 4143, outbound 4140; the admin ports 4190 and
// 4191 and the ignored ports 4567 and 4568 skipped), as Linkerd's "IPTables Reference" lists
// them. Its Go module (github.com/linkerd/linkerd2-proxy-init) is not served to this machine,
// so the rules are written out here, chain for chain and match for match.
const linkerdRules = `*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:PROXY_INIT_REDIRECT - [0:0]
:PROXY_INIT_OUTPUT - [0:0]
-A PREROUTING -m comment --comment "proxy-init/install-proxy-init-prerouting" -j PROXY_INIT_REDIRECT
-A OUTPUT -m comment --comment "proxy-init/install-proxy-init-output" -j PROXY_INIT_OUTPUT
-A PROXY_INIT_REDIRECT -p tcp -m multiport --dports 4190,4191,4567,4568 -m comment --comment "proxy-init/ignore-port" -j RETURN
-A PROXY_INIT_REDIRECT -p tcp -m comment --comment "proxy-init/redirect-all-incoming-to-proxy-port" -j REDIRECT --to-ports 4143
-A PROXY_INIT_OUTPUT -m owner --uid-owner 2102 -m comment --comment "proxy-init/ignore-proxy-user-id" -j RETURN
-A PROXY_INIT_OUTPUT -o lo -m comment --comment "proxy-init/ignore-loopback" -j RETURN
-A PROXY_INIT_OUTPUT -p tcp -m multiport --dports 4567,4568 -m comment --comment "proxy-init/ignore-port" -j RETURN
-A PROXY_INIT_OUTPUT -p tcp -m comment --comment "proxy-init/redirect-all-outgoing-to-proxy-port" -j REDIRECT --to-ports 4140
COMMIT
`

// Row (f)'s clients dial natPort, which one NAT rule in the pod turns into natServerPort, where
// servers of row (f)'s own listen: the other rows' connections to 8080 leave conntrack entries
// (120 s in TIME_WAIT) that a NAT'd connection to the same server would clash with.
const (
	natPort       = 8081
	natServerPort = 8082
)

// natRules are row (f)'s: one NAT rule each way, as a redirect's first packet meets it, and no
// proxy: outbound to the peer's natPort is sent to its natServerPort, inbound to the pod's
// natPort to the pod's natServerPort.
func natRules(peer netip.Addr) string {
	return fmt.Sprintf(`*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
-A PREROUTING -p tcp --dport %[1]d -j REDIRECT --to-ports %[3]d
-A OUTPUT -d %[2]s -p tcp --dport %[1]d -j DNAT --to-destination %[2]s:%[3]d
COMMIT
`, natPort, peer, natServerPort)
}

// emptyNat flushes the legacy nat table.
const emptyNat = "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n"

// The direct frontends of row (b): the client dials HAProxy itself, which connects to the same
// server; the proxy's own cost, without the capture.
const (
	directOutboundPort = 4150
	directInboundPort  = 4151
)

// dataPathRow is one way between the client and the server.
type dataPathRow struct {
	name string
	// against is the index of the row its figures are set against, or -1.
	against int
	// setup installs the row's rules in the pod (after every other row's are gone).
	setup func(ctx context.Context) error
	// out and in are the addresses the outbound client (in the pod) and the inbound one (in
	// the peer) dial.
	out, in string
}

// dataPathCell gathers one row's figures for one direction over every round.
type dataPathCell struct {
	samples     []time.Duration
	cps1, cps16 []float64
	mibs        []float64
}

var loadLine = regexp.MustCompile(`cps@1=(\d+) cps@16=(\d+) bytes=\d+ seconds=[0-9.]+ MiB/s=([0-9.]+)`)

// BenchmarkDataPath measures the data path through HAProxy (the HAProxy image's configuration
// and binary, as the proxy UID) in a pod-like network namespace, outbound (the app in the pod
// dials a peer namespace) and inbound (the peer dials the app), over IPv4, six ways:
//
//	(a) no mesh: the client dials the server;
//	(b) the client dials HAProxy directly, which connects to the server (the proxy's own cost);
//	(c) detour's nftables rules, with the inbound socket lookup (listening);
//	(d) detour's iptables-legacy rules, the same;
//	(e) Linkerd's rules as its proxy-init writes them (linkerdRules);
//	(f) no mesh, through one NAT rule (natRules): what a redirect costs the kernel, without a
//	    proxy, set against (a).
//
// Each round runs every row in a new random order, and each row, in each direction, a client
// (the workload program's load) that times DATAPATH_CONNS connections one after another (connect
// to the server's first line), counts connections per second with 1 and 16 concurrent clients
// for DATAPATH_RATE_FOR each, and sends DATAPATH_BYTES through one connection. It prints a table
// over DATAPATH_ROUNDS rounds (make bench-datapath; docs/benchmarks.md). DATAPATH_MAX_TW sets
// the namespaces' tcp_max_tw_buckets: 0 keeps no TIME_WAIT socket, which shows what the app's
// and the proxy's TIME_WAITs towards the same destination cost the rows that redirect.
func BenchmarkDataPath(b *testing.B) {
	testenv.Privileged(b)
	if _, err := os.Stat(HAProxyBinary); err != nil {
		b.Fatalf("%s: %v (bash hack/host-deps.sh installs Debian's haproxy package)", HAProxyBinary, err)
	}
	rounds, conns := envInt(b, "DATAPATH_ROUNDS", 20), envInt(b, "DATAPATH_CONNS", 500)
	size := envInt(b, "DATAPATH_BYTES", 128<<20)
	rateFor := 1 * time.Second
	if s := os.Getenv("DATAPATH_RATE_FOR"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil {
			b.Fatalf("DATAPATH_RATE_FOR=%q: %v", s, err)
		}
		rateFor = d
	}
	const appUID, proxyUID = 1500, inject.DefaultProxyUID
	ctx := context.Background()
	dir, built := buildForUIDs(b)

	l := newPodAndPeer(b, 97) // the rows run over IPv4
	pod, peer, podIP, peerIP := l.pod, l.peer, l.pod4, l.peer4
	// Thousands of connections a second between the same two addresses: HAProxy closes its
	// side to the server first, and each such connection waits 60 s in TIME_WAIT holding its
	// port. Let new connections reuse those ports, in every row alike, or HAProxy runs out
	// ("Connect() failed ...: no free ports").
	for _, ns := range []*testenv.NetNS{pod, peer} {
		err := ns.Do(func() error {
			if err := os.WriteFile("/proc/sys/net/ipv4/tcp_tw_reuse", []byte("1"), 0o644); err != nil {
				return err
			}
			if v := os.Getenv("DATAPATH_MAX_TW"); v != "" {
				if err := os.WriteFile("/proc/sys/net/ipv4/tcp_max_tw_buckets", []byte(v), 0o644); err != nil {
					return err
				}
			}
			return os.WriteFile("/proc/sys/net/ipv4/ip_local_port_range", []byte("1024 65535"), 0o644)
		})
		if err != nil {
			b.Fatalf("set the namespaces' TCP port reuse: %v", err)
		}
	}

	cfg := haproxyTestConfig(b, dir) + fmt.Sprintf(`
frontend direct-outbound
  bind 127.0.0.1:%d
  default_backend peer
backend peer
  server peer %s:8080

frontend direct-inbound
  bind %s:%d
  default_backend app
backend app
  server app %s:8080
`, directOutboundPort, peerIP, podIP, directInboundPort, podIP)
	cfgPath := filepath.Join(dir, "haproxy-bench.cfg")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		b.Fatal(err)
	}
	_, haproxyLog := startHAProxy(b, pod, dir, cfgPath, podIP)
	for _, port := range []int{8080, natServerPort} {
		listen := fmt.Sprintf(":%d", port)
		waitLog(b, start(b, pod, appUID, built.Bin(workloadProg), "serve", "-listen", listen, "-name", "app", "-sink"), "listening")
		waitLog(b, start(b, peer, 0, built.Bin(workloadProg), "serve", "-listen", listen, "-name", "peer", "-sink"), "listening")
	}
	// HAProxy listens once the direct frontend answers.
	run(b, pod, appUID, built.Bin(workloadProg), "dial", "-addr", fmt.Sprintf("127.0.0.1:%d", directOutboundPort), "-must", "-retry", "10s")
	// The clients write their samples here, as the app's UID.
	sampleDir := filepath.Join(dir, "samples")
	if err := os.Mkdir(sampleDir, 0o777); err != nil {
		b.Fatal(err)
	}
	os.Chmod(sampleDir, 0o777)

	detour := func(backend iptables.Backend) func(context.Context) error {
		return func(ctx context.Context) error {
			rs, err := iptables.Build(iptables.Config{
				Family: iptables.IPv4, ProxyUID: proxyUID, InboundListening: true,
				InboundPort: inject.DefaultProxyInboundPort, OutboundPort: inject.DefaultProxyOutboundPort,
				SkipInboundPorts: []annotations.PortRange{{First: inject.DefaultProxyAdminPort, Last: inject.DefaultProxyAdminPort}},
			})
			if err != nil {
				return err
			}
			return iptables.NewExecutor(iptables.WithBackend(backend)).Apply(ctx, pod.Path, rs)
		}
	}
	none := func(context.Context) error { return nil }
	peerAddr, podAddr := netip.AddrPortFrom(peerIP, 8080).String(), netip.AddrPortFrom(podIP, 8080).String()
	rows := []dataPathRow{
		{"(a) no mesh", -1, none, peerAddr, podAddr},
		{"(b) HAProxy dialled directly", -1, none, fmt.Sprintf("127.0.0.1:%d", directOutboundPort), netip.AddrPortFrom(podIP, directInboundPort).String()},
		{"(c) detour, nftables", 1, detour(iptables.BackendNFTables), peerAddr, podAddr},
		{"(d) detour, iptables-legacy", 1, detour(iptables.BackendLegacy), peerAddr, podAddr},
		{"(e) Linkerd's rules, iptables-legacy", 1, func(ctx context.Context) error { return legacyRestore(ctx, pod, linkerdRules) }, peerAddr, podAddr},
		{"(f) no mesh, one NAT rule", 0, func(ctx context.Context) error { return legacyRestore(ctx, pod, natRules(peerIP)) },
			netip.AddrPortFrom(peerIP, natPort).String(), netip.AddrPortFrom(podIP, natPort).String()},
	}
	clearRules := func(ctx context.Context) error {
		if err := iptables.NewExecutor(iptables.WithBackend(iptables.BackendNFTables)).Remove(ctx, pod.Path, iptables.IPv4); err != nil {
			return err
		}
		return legacyRestore(ctx, pod, emptyNat)
	}

	cells := map[string]*dataPathCell{}
	r := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 0))
	b.ResetTimer()
	for round := range rounds {
		order := slices.Clone(rows)
		r.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
		for _, row := range order {
			if err := clearRules(ctx); err != nil {
				b.Fatalf("round %d, %s: clear the rules: %v", round, row.name, err)
			}
			if err := row.setup(ctx); err != nil {
				b.Fatalf("round %d, %s: %v", round, row.name, err)
			}
			for _, d := range []struct {
				name string
				ns   *testenv.NetNS
				uid  int
				addr string
			}{{"out", pod, appUID, row.out}, {"in", peer, 0, row.in}} {
				samples := filepath.Join(sampleDir, "samples")
				out := run(b, d.ns, d.uid, built.Bin(workloadProg), "load", "-addr", d.addr, "-conns", strconv.Itoa(conns),
					"-bytes", strconv.Itoa(size), "-rate", "1,16", "-rate-for", rateFor.String(), "-samples", samples)
				m := loadLine.FindStringSubmatch(out)
				if m == nil {
					b.Fatalf("round %d, %s, %s: load printed %q\nHAProxy's log:\n%s", round, row.name, d.name, out, readLog(haproxyLog))
				}
				c := cells[row.name+"/"+d.name]
				if c == nil {
					c = &dataPathCell{}
					cells[row.name+"/"+d.name] = c
				}
				raw, err := os.ReadFile(samples)
				if err != nil {
					b.Fatal(err)
				}
				for _, f := range strings.Fields(string(raw)) {
					ns, _ := strconv.ParseInt(f, 10, 64)
					c.samples = append(c.samples, time.Duration(ns))
				}
				cps1, _ := strconv.ParseFloat(m[1], 64)
				cps16, _ := strconv.ParseFloat(m[2], 64)
				mibs, _ := strconv.ParseFloat(m[3], 64)
				c.cps1, c.cps16, c.mibs = append(c.cps1, cps1), append(c.cps16, cps16), append(c.mibs, mibs)
			}
		}
	}
	b.StopTimer()
	fmt.Print(dataPathTable(rows, cells, rounds, conns, size, rateFor))
}

// dataPathTable is the benchmark's table: per row and direction, the connection set-up p50 and
// p99 over every timed connection, the median over the rounds of the connections per second and
// of the bulk MiB/s, and each figure's difference from the row it is set against.
func dataPathTable(rows []dataPathRow, cells map[string]*dataPathCell, rounds, conns, size int, rateFor time.Duration) string {
	var s strings.Builder
	fmt.Fprintf(&s, "\nData path through HAProxy, IPv4: %d rounds, rows in random order in each; per round and direction %d timed connections, %s at 1 and at 16 clients, %d MiB through one connection.\n\n",
		rounds, conns, rateFor, size>>20)
	fmt.Fprintln(&s, "| row | dir | set-up p50 | p99 | conn/s, 1 client | conn/s, 16 clients | bulk MiB/s |")
	fmt.Fprintln(&s, "|---|---|---|---|---|---|---|")
	type figures struct{ p50, p99, cps1, cps16, mibs float64 }
	get := func(c *dataPathCell) figures {
		sorted := slices.Clone(c.samples)
		slices.Sort(sorted)
		us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
		return figures{
			p50: us(sorted[len(sorted)/2]), p99: us(sorted[min(len(sorted)-1, len(sorted)*99/100)]),
			cps1: median(c.cps1), cps16: median(c.cps16), mibs: median(c.mibs),
		}
	}
	for _, dir := range []string{"out", "in"} {
		for _, row := range rows {
			f := get(cells[row.name+"/"+dir])
			var base figures
			if row.against >= 0 {
				base = get(cells[rows[row.against].name+"/"+dir])
			}
			delta := func(v, b float64) string {
				if row.against < 0 {
					return ""
				}
				return fmt.Sprintf(" (%+.1f%%)", (v-b)/b*100)
			}
			fmt.Fprintf(&s, "| %s | %s | %.0f µs%s | %.0f µs%s | %.0f%s | %.0f%s | %.0f%s |\n", row.name, dir,
				f.p50, delta(f.p50, base.p50), f.p99, delta(f.p99, base.p99), f.cps1, delta(f.cps1, base.cps1),
				f.cps16, delta(f.cps16, base.cps16), f.mibs, delta(f.mibs, base.mibs))
		}
	}
	fmt.Fprintf(&s, "\nPercentages: (c) to (e) against (b), HAProxy dialled directly; (f) against (a). Set-up: %d connections per row and direction.\n", rounds*conns)
	return s.String()
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

func envInt(b *testing.B, name string, def int) int {
	s := os.Getenv(name)
	if s == "" {
		return def
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 {
		b.Fatalf("%s=%q: a positive whole number", name, s)
	}
	return n
}

// legacyRestore replaces the pod's legacy IPv4 nat table with input.
func legacyRestore(ctx context.Context, ns *testenv.NetNS, input string) error {
	cmd := exec.CommandContext(ctx, "iptables-legacy-restore", "-w", "5")
	cmd.Stdin = strings.NewReader(input)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := ns.Do(cmd.Run); err != nil {
		return fmt.Errorf("iptables-legacy-restore in %s: %w: %s", ns.Path, err, out.String())
	}
	return nil
}
