package iptables_test

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/test/testenv"
)

func benchConfig(f iptables.Family) iptables.Config {
	return iptables.Config{
		Family: f, ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140,
		SkipInboundPorts:  []annotations.PortRange{{First: 4190, Last: 4191}},
		SkipOutboundPorts: []annotations.PortRange{{First: 25, Last: 25}, {First: 3306, Last: 3306}},
		ExemptUIDs:        []uint32{1000},
		ExemptGIDs:        []uint32{2601},
		InboundListening:  true, // what pods get since detour wrote detour.dev/redirect-inbound
	}
}

// BenchmarkBuild measures rendering a typical ruleset to iptables-restore text.
func BenchmarkBuild(b *testing.B) {
	c := benchConfig(iptables.IPv4)
	for b.Loop() {
		rs, err := iptables.Build(c)
		if err != nil {
			b.Fatal(err)
		}
		_ = rs.Restore()
	}
}

// BenchmarkApply measures Executor.Apply of a typical ruleset into a fresh namespace, the work
// the CNI plugin does per pod and family (the nftables backend also both families at once, as
// the plugin does for a dual-stack pod: one netlink transaction); namespace creation is not
// timed. Run it with -benchtime=30x or more: besides the mean (ns/op) it reports the median and
// p90 in ms.
func BenchmarkApply(b *testing.B) {
	testenv.Privileged(b)
	ctx := context.Background()
	type run struct {
		backend  iptables.Backend
		families []iptables.Family
		all      bool // every inbound connection redirected, without the socket lookup
	}
	var runs []run
	for _, backend := range []iptables.Backend{iptables.BackendAuto, iptables.BackendLegacy, iptables.BackendNFT, iptables.BackendNFTables} {
		for _, f := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
			runs = append(runs, run{backend, []iptables.Family{f}, false})
		}
	}
	dual := []iptables.Family{iptables.IPv4, iptables.IPv6}
	runs = append(runs, run{iptables.BackendNFTables, dual, false}, run{iptables.BackendNFTables, dual, true},
		run{iptables.BackendLegacy, []iptables.Family{iptables.IPv4}, true})
	for _, r := range runs {
		name := string(r.backend) + "-" + r.families[0].String()
		if len(r.families) > 1 {
			name = string(r.backend) + "-dual"
		}
		if r.all {
			name += "-inbound-all"
		}
		b.Run(name, func(b *testing.B) {
			var rulesets []iptables.Ruleset
			for _, f := range r.families {
				c := benchConfig(f)
				c.InboundListening = !r.all
				rs, err := iptables.Build(c)
				if err != nil {
					b.Fatal(err)
				}
				rulesets = append(rulesets, rs)
			}
			exec := iptables.NewExecutor(iptables.WithBackend(r.backend))
			var took []time.Duration
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				ns := testenv.NewNetNS(b)
				b.StartTimer()
				start := time.Now()
				if err := exec.Apply(ctx, ns.Path, rulesets...); err != nil {
					b.Fatal(err)
				}
				took = append(took, time.Since(start))
				b.StopTimer()
				ns.Remove()
				b.StartTimer()
			}
			slices.Sort(took)
			ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
			b.ReportMetric(ms(took[len(took)/2]), "p50-ms")
			b.ReportMetric(ms(took[len(took)*9/10]), "p90-ms")
		})
	}
}

// BenchmarkCheckNFTables measures CHECK of the nftables backend: reading detour's table back
// over netlink and comparing it, both families.
func BenchmarkCheckNFTables(b *testing.B) {
	testenv.Privileged(b)
	ctx := context.Background()
	rulesets := []iptables.Ruleset{}
	for _, f := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
		rs, _ := iptables.Build(benchConfig(f))
		rulesets = append(rulesets, rs)
	}
	exec := iptables.NewExecutor(iptables.WithBackend(iptables.BackendNFTables))
	ns := testenv.NewNetNS(b)
	if err := exec.Apply(ctx, ns.Path, rulesets...); err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if err := exec.Check(ctx, ns.Path, rulesets...); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkBuildNFT measures building the nftables table of both families (no I/O).
func BenchmarkBuildNFT(b *testing.B) {
	for b.Loop() {
		if _, err := iptables.BuildNFT(benchConfig(iptables.IPv4), benchConfig(iptables.IPv6)); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkInboundConnection measures what the inbound rule costs each connection: a client in
// another namespace connects to the app's port of a pod, the redirect delivers the connection to
// the proxy's inbound listener, which answers one line; connect, read and close are timed. Two
// pods on one link, one whose rules redirect every inbound connection (all) and one that
// redirects only where a socket listens (listening: one socket-table lookup per connection's
// first packet), are dialled in turn, so that both see the same load. It reports, for each,
// connections per second and the median and p99 latency in µs.
func BenchmarkInboundConnection(b *testing.B) {
	testenv.Privileged(b)
	for _, backend := range []iptables.Backend{iptables.BackendNFTables, iptables.BackendLegacy} {
		b.Run(string(backend), func(b *testing.B) {
			remote := testenv.NewNetNS(b)
			var addrs []string
			for i, listening := range []bool{false, true} {
				pod := testenv.NewNetNS(b)
				podIP, remoteIP := fmt.Sprintf("10.79.%d.2", i), fmt.Sprintf("10.79.%d.1", i)
				testenv.Link(b, pod, "eth0", []netip.Prefix{netip.MustParsePrefix(podIP + "/24")},
					remote, fmt.Sprintf("eth%d", i), []netip.Prefix{netip.MustParsePrefix(remoteIP + "/24")})
				c := benchConfig(iptables.IPv4)
				c.InboundListening = listening
				rs, err := iptables.Build(c)
				if err != nil {
					b.Fatal(err)
				}
				if err := iptables.NewExecutor(iptables.WithBackend(backend)).Apply(context.Background(), pod.Path, rs); err != nil {
					b.Fatal(err)
				}
				testenv.Serve(b, pod, "inbound", "tcp4", "0.0.0.0:4143")
				testenv.Serve(b, pod, "app", "tcp4", "0.0.0.0:8080")
				addrs = append(addrs, podIP+":8080")
			}
			latencies := dialLoop(b, remote, addrs)
			for i, name := range []string{"all", "listening"} {
				d := latencies[i]
				slices.Sort(d)
				var total time.Duration
				for _, x := range d {
					total += x
				}
				b.ReportMetric(float64(len(d))/total.Seconds(), name+"-conn/s")
				b.ReportMetric(float64(d[len(d)/2].Microseconds()), name+"-p50-µs")
				b.ReportMetric(float64(d[len(d)*99/100].Microseconds()), name+"-p99-µs")
			}
		})
	}
}

// dialLoop connects b.N times to each of addrs in turn from a thread in ns, reading the
// answer's line each time, and returns each connection's duration, per address.
func dialLoop(b *testing.B, ns *testenv.NetNS, addrs []string) [][]time.Duration {
	b.Helper()
	out := make([][]time.Duration, len(addrs))
	err := ns.Do(func() error {
		b.ResetTimer()
		for range b.N {
			for i, addr := range addrs {
				start := time.Now()
				c, err := net.Dial("tcp4", addr)
				if err != nil {
					return err
				}
				if _, err := bufio.NewReader(c).ReadString('\n'); err != nil {
					c.Close()
					return err
				}
				c.Close()
				out[i] = append(out[i], time.Since(start))
			}
		}
		b.StopTimer()
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
	return out
}
