package iptables_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/internal/testenv"
	"github.com/detourmesh/detour/iptables"
)

func benchConfig(f iptables.Family) iptables.Config {
	return iptables.Config{
		Family: f, ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140,
		SkipInboundPorts:  []annotations.PortRange{{First: 4190, Last: 4191}},
		SkipOutboundPorts: []annotations.PortRange{{First: 25, Last: 25}, {First: 3306, Last: 3306}},
		ExemptUIDs:        []uint32{1000},
		ExemptGIDs:        []uint32{2601},
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
	}
	var runs []run
	for _, backend := range []iptables.Backend{iptables.BackendAuto, iptables.BackendLegacy, iptables.BackendNFT, iptables.BackendNFTables} {
		for _, f := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
			runs = append(runs, run{backend, []iptables.Family{f}})
		}
	}
	runs = append(runs, run{iptables.BackendNFTables, []iptables.Family{iptables.IPv4, iptables.IPv6}})
	for _, r := range runs {
		name := string(r.backend) + "-" + r.families[0].String()
		if len(r.families) > 1 {
			name = string(r.backend) + "-dual"
		}
		b.Run(name, func(b *testing.B) {
			var rulesets []iptables.Ruleset
			for _, f := range r.families {
				rs, err := iptables.Build(benchConfig(f))
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
