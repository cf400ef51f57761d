package cniplugin_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/detourmesh/detour/internal/testenv"
)

// BenchmarkChain drives a conflist through libcni, as containerd does, for b.N fresh sandboxes
// per scenario — the primary plugin alone, then followed by detour-cni with the annotations
// from runtimeConfig and from the API — one at a time and four at a time. Each sandbox gets
// ADD, then CHECK, then DEL. Run it with -benchtime=30x or more (make bench-cni); it prints a
// table of min/median/p90/max per command and detour's median increment over the primary.
func BenchmarkChain(b *testing.B) {
	f := newFixture(b, false)
	pod := f.createPod("bench", redirect.Annotations())
	scenarios := []struct {
		name       string
		list       *libcni.NetworkConfigList
		viaRuntime bool
	}{
		{"bridge only", f.primaryOnly(), true},
		{"bridge + detour-cni, runtimeConfig", f.list(nil), true},
		{"bridge + detour-cni, API GET", f.list(nil), false},
	}
	results := map[string]*chainStats{}
	var order []string
	for _, conc := range []int{1, 4} {
		for _, sc := range scenarios {
			key := fmt.Sprintf("%s, %d at a time", sc.name, conc)
			order = append(order, key)
			b.Run(strings.NewReplacer(" ", "_", ",", "").Replace(key), func(b *testing.B) {
				sandboxes := make([]*testenv.Attachment, b.N)
				for i := range sandboxes {
					sandboxes[i] = f.sandbox(pod, sc.viaRuntime)
				}
				s := &chainStats{}
				b.ResetTimer()
				start := time.Now()
				s.add = run(b, conc, sandboxes, func(a *testenv.Attachment) error {
					_, err := f.cni.Add(context.Background(), sc.list, a)
					return err
				})
				s.addWall = time.Since(start)
				s.check = run(b, conc, sandboxes, func(a *testenv.Attachment) error {
					return f.cni.Config.CheckNetworkList(context.Background(), sc.list, a.Runtime)
				})
				s.del = run(b, conc, sandboxes, func(a *testenv.Attachment) error {
					return f.cni.Config.DelNetworkList(context.Background(), sc.list, a.Runtime)
				})
				b.StopTimer()
				results[key] = s
				b.ReportMetric(ms(s.add[len(s.add)/2]), "add-p50-ms")
			})
		}
	}
	printChainTable(results, order)
}

type chainStats struct {
	add, check, del []time.Duration
	addWall         time.Duration // wall time of all ADDs, for throughput
}

// run calls op for every sandbox with conc workers and returns the sorted durations.
func run(b *testing.B, conc int, sandboxes []*testenv.Attachment, op func(*testenv.Attachment) error) []time.Duration {
	var mu sync.Mutex
	var took []time.Duration
	work := make(chan *testenv.Attachment)
	var wg sync.WaitGroup
	for range conc {
		wg.Go(func() {
			for a := range work {
				start := time.Now()
				err := op(a)
				d := time.Since(start)
				if err != nil {
					b.Error(err)
				}
				mu.Lock()
				took = append(took, d)
				mu.Unlock()
			}
		})
	}
	for _, a := range sandboxes {
		work <- a
	}
	close(work)
	wg.Wait()
	slices.Sort(took)
	return took
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func printChainTable(results map[string]*chainStats, order []string) {
	if len(results) == 0 {
		return
	}
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "scenario\tN\tADD min\tmedian\tp90\tmax\tCHECK median\tp90\tDEL median\tp90\tADD/s\t")
	row := func(name string, s *chainStats) {
		q := func(d []time.Duration, p int) string { return fmt.Sprintf("%.1f", ms(d[min(len(d)-1, len(d)*p/100)])) }
		fmt.Fprintf(w, "%s\t%d\t%.1f\t%s\t%s\t%.1f\t%s\t%s\t%s\t%s\t%.0f\t\n", name, len(s.add),
			ms(s.add[0]), q(s.add, 50), q(s.add, 90), ms(s.add[len(s.add)-1]),
			q(s.check, 50), q(s.check, 90), q(s.del, 50), q(s.del, 90), float64(len(s.add))/s.addWall.Seconds())
	}
	for _, name := range order {
		if s, ok := results[name]; ok {
			row(name, s)
		}
	}
	w.Flush()
	fmt.Println("\ndetour-cni's increment over the primary plugin alone (median, ms):")
	for _, conc := range []string{"1 at a time", "4 at a time"} {
		base, ok := results["bridge only, "+conc]
		if !ok {
			continue
		}
		for _, path := range []string{"runtimeConfig", "API GET"} {
			s, ok := results["bridge + detour-cni, "+path+", "+conc]
			if !ok {
				continue
			}
			med := func(d []time.Duration) float64 { return ms(d[len(d)/2]) }
			fmt.Printf("  %-14s %-12s ADD %+6.1f   CHECK %+6.1f   DEL %+6.1f\n", path, conc,
				med(s.add)-med(base.add), med(s.check)-med(base.check), med(s.del)-med(base.del))
		}
	}
}
