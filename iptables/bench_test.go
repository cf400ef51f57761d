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
// the CNI plugin does per pod and family; namespace creation is not timed. Run it with
// -benchtime=30x or more: besides the mean (ns/op) it reports the median and p90 in ms.
func BenchmarkApply(b *testing.B) {
	testenv.Privileged(b)
	ctx := context.Background()
	for _, backend := range []iptables.Backend{iptables.BackendAuto, iptables.BackendLegacy, iptables.BackendNFT} {
		for _, f := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
			b.Run(string(backend)+"-"+f.String(), func(b *testing.B) {
				rs, err := iptables.Build(benchConfig(f))
				if err != nil {
					b.Fatal(err)
				}
				exec := iptables.NewExecutor(iptables.WithBackend(backend))
				var took []time.Duration
				for i := 0; i < b.N; i++ {
					b.StopTimer()
					ns := testenv.NewNetNS(b)
					b.StartTimer()
					start := time.Now()
					if err := exec.Apply(ctx, ns.Path, rs); err != nil {
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
}
