package cniplugin_test

import (
	"bytes"
	"os/exec"
	"slices"
	"testing"
	"time"

	"github.com/detourmesh/detour/internal/testenv"
)

// BenchmarkStatus measures one STATUS as the runtime runs it (containerd 2.x does about every
// 5 s): a process started with the network's configuration on stdin. It reports the median in
// ms; the figure and what STATUS checks are in docs/benchmarks.md and docs/cni-plugin.md.
func BenchmarkStatus(b *testing.B) {
	bin := testenv.DetourCNI(b)
	conf := []byte(`{"cniVersion":"1.1.0","name":"k8s","type":"detour-cni"}`)
	var took []time.Duration
	for b.Loop() {
		cmd := exec.Command(bin)
		cmd.Env = []string{"CNI_COMMAND=STATUS", "CNI_PATH=/opt/cni/bin", "PATH=/usr/sbin:/usr/bin:/sbin:/bin"}
		cmd.Stdin = bytes.NewReader(conf)
		start := time.Now()
		if out, err := cmd.CombinedOutput(); err != nil {
			b.Fatalf("%s STATUS: %v\n%s", bin, err, out)
		}
		took = append(took, time.Since(start))
	}
	slices.Sort(took)
	b.ReportMetric(ms(median(took)), "median-ms")
}
