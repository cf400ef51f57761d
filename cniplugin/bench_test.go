package cniplugin_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"sync"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/containernetworking/cni/libcni"
	corev1 "k8s.io/api/core/v1"

	"github.com/detourmesh/detour/test/testenv"
)

// BenchmarkChain drives a conflist through libcni, as containerd does, on fresh sandboxes: the
// primary plugin alone, then followed by detour-cni with the pod's annotations from
// runtimeConfig and from the API — one sandbox at a time, and four at a time. Each round
// runs every scenario in turn (ADD, then CHECK, then DEL), so that whatever else the machine does
// weighs on all of them alike; b.N is the number of rounds. Run it with -benchtime=30x or more
// (make bench-cni): it prints min/median/p90/max per command and scenario, and detour-cni's
// median increment over the primary plugin alone.
func BenchmarkChain(b *testing.B) {
	f := newFixture(b, false)
	pod := f.createPod("bench", redirect.Annotations())
	plain := f.createPod("bench-plain", nil)
	scenarios := []scenario{
		{name: "bridge only", list: f.primaryOnly(), pod: pod, viaRuntime: true},
		// The floor: starting detour-cni, which passes prevResult through for a pod that is
		// not injected, and libcni's handling of one more plugin.
		{name: "bridge + detour-cni, not injected", list: f.list(nil), pod: plain, viaRuntime: true},
		{name: "bridge + detour-cni, runtimeConfig", list: f.list(nil), pod: pod, viaRuntime: true},
		{name: "bridge + detour-cni, API GET", list: f.list(nil), pod: pod, viaRuntime: false},
		// The backends side by side, annotations from runtimeConfig (auto above chooses
		// nftables in these fresh namespaces).
		{name: "bridge + detour-cni, rc, nftables", list: f.list(map[string]any{"iptablesBackend": "nftables"}), pod: pod, viaRuntime: true},
		{name: "bridge + detour-cni, rc, nft", list: f.list(map[string]any{"iptablesBackend": "nft"}), pod: pod, viaRuntime: true},
		{name: "bridge + detour-cni, rc, legacy", list: f.list(map[string]any{"iptablesBackend": "legacy"}), pod: pod, viaRuntime: true},
	}
	for _, conc := range []int{1, 4} {
		b.Run(fmt.Sprintf("%d-at-a-time", conc), func(b *testing.B) {
			stats := make([]chainStats, len(scenarios))
			for b.Loop() {
				for i, sc := range scenarios {
					sandboxes := make([]*testenv.Attachment, conc)
					for j := range sandboxes {
						sandboxes[j] = f.sandbox(sc.pod, sc.viaRuntime)
					}
					stats[i].add = append(stats[i].add, parallel(b, sandboxes, func(a *testenv.Attachment) error {
						_, err := f.cni.Add(context.Background(), sc.list, a)
						return err
					})...)
					stats[i].check = append(stats[i].check, parallel(b, sandboxes, func(a *testenv.Attachment) error {
						return f.cni.Config.CheckNetworkList(context.Background(), sc.list, a.Runtime)
					})...)
					stats[i].del = append(stats[i].del, parallel(b, sandboxes, func(a *testenv.Attachment) error {
						return f.cni.Config.DelNetworkList(context.Background(), sc.list, a.Runtime)
					})...)
					for _, a := range sandboxes {
						a.NetNS.Remove()
					}
				}
			}
			b.StopTimer()
			for i := range stats {
				stats[i].sort()
			}
			inc := func(i int, d func(chainStats) []time.Duration) float64 {
				return ms(median(d(stats[i]))) - ms(median(d(stats[0])))
			}
			b.ReportMetric(inc(2, addOf), "rc-add-increment-ms")
			b.ReportMetric(inc(3, addOf), "api-add-increment-ms")
			printChainTable(conc, scenarios, stats)
		})
	}
}

type scenario struct {
	name       string
	list       *libcni.NetworkConfigList
	pod        *corev1.Pod
	viaRuntime bool
}

type chainStats struct{ add, check, del []time.Duration }

func (s *chainStats) sort() { slices.Sort(s.add); slices.Sort(s.check); slices.Sort(s.del) }

func addOf(s chainStats) []time.Duration   { return s.add }
func checkOf(s chainStats) []time.Duration { return s.check }
func delOf(s chainStats) []time.Duration   { return s.del }

// parallel runs op on every sandbox at once and returns each one's duration.
func parallel(b *testing.B, sandboxes []*testenv.Attachment, op func(*testenv.Attachment) error) []time.Duration {
	took := make([]time.Duration, len(sandboxes))
	var wg sync.WaitGroup
	for i, a := range sandboxes {
		wg.Go(func() {
			start := time.Now()
			if err := op(a); err != nil {
				b.Error(err)
			}
			took[i] = time.Since(start)
		})
	}
	wg.Wait()
	return took
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func median(d []time.Duration) time.Duration { return d[len(d)/2] }

func quantile(d []time.Duration, p int) time.Duration { return d[min(len(d)-1, len(d)*p/100)] }

func printChainTable(conc int, scenarios []scenario, stats []chainStats) {
	fmt.Printf("\n%d at a time, %d sandboxes per scenario (ms):\n", conc, len(stats[0].add))
	w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(w, "scenario\tADD min\tmedian\tp90\tmax\tCHECK median\tp90\tDEL median\tp90\t")
	for i, sc := range scenarios {
		s := stats[i]
		fmt.Fprintf(w, "%s\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t\n", sc.name,
			ms(s.add[0]), ms(median(s.add)), ms(quantile(s.add, 90)), ms(s.add[len(s.add)-1]),
			ms(median(s.check)), ms(quantile(s.check, 90)), ms(median(s.del)), ms(quantile(s.del, 90)))
	}
	w.Flush()
	fmt.Println("detour-cni's increment over the primary plugin alone (difference of medians, ms):")
	for i := 1; i < len(scenarios); i++ {
		d := func(of func(chainStats) []time.Duration) float64 {
			return ms(median(of(stats[i]))) - ms(median(of(stats[0])))
		}
		fmt.Printf("  %-36s ADD %+6.1f   CHECK %+6.1f   DEL %+6.1f\n", scenarios[i].name, d(addOf), d(checkOf), d(delOf))
	}
}

// BenchmarkStart measures starting detour-cni with CNI_COMMAND=VERSION, the part of every
// command's latency that is process start and initialisation; it reports the median in ms.
func BenchmarkStart(b *testing.B) {
	benchCommand(b, []string{"CNI_COMMAND=VERSION"}, nil)
}

// BenchmarkStatus measures one STATUS as the runtime runs it (containerd 2.x does about every
// 5 s): a process started with the network's configuration on stdin. It reports the median in
// ms; the figure and what STATUS checks are in docs/cni-plugin.md.
func BenchmarkStatus(b *testing.B) {
	benchCommand(b, []string{"CNI_COMMAND=STATUS", "CNI_PATH=/opt/cni/bin", "PATH=/usr/sbin:/usr/bin:/sbin:/bin"},
		[]byte(`{"cniVersion":"1.1.0","name":"k8s","type":"detour-cni"}`))
}

// benchCommand runs detour-cni once per iteration with env and stdin, and reports the median
// wall time in ms.
func benchCommand(b *testing.B, env []string, stdin []byte) {
	bin := testenv.DetourCNI(b)
	var took []time.Duration
	for b.Loop() {
		cmd := exec.Command(bin)
		cmd.Env = env
		cmd.Stdin = bytes.NewReader(stdin)
		start := time.Now()
		if out, err := cmd.CombinedOutput(); err != nil {
			b.Fatalf("%s %v: %v\n%s", bin, env, err, out)
		}
		took = append(took, time.Since(start))
	}
	slices.Sort(took)
	b.ReportMetric(ms(median(took)), "median-ms")
}
