package e2e

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

// The breakdown reads containerd's lines in either form of the CRI's metadata, and the
// kubelet's PLEG lines.
func TestReadPodTimes(t *testing.T) {
	dir := t.TempDir()
	containerd := `time="2026-12-05T13:49:05.425000000Z" level=info msg="RunPodSandbox for name:\"p0-1-4\"  uid:\"61d7\" namespace:\"bench-hook\""
time="2026-12-05T13:49:05.800000000Z" level=info msg="RunPodSandbox for name:\"p0-1-4\"  uid:\"61d7\" namespace:\"bench-hook\" returns sandbox id \"aa01\""
time="2026-12-05T13:49:05.810000000Z" level=info msg="CreateContainer within sandbox \"aa01\" for container name:\"detour-proxy\""
time="2026-12-05T13:49:05.830000000Z" level=info msg="CreateContainer within sandbox \"aa01\" for name:\"detour-proxy\" returns container id \"cc01\""
time="2026-12-05T13:49:05.850000000Z" level=info msg="StartContainer for \"cc01\" returns successfully"
time="2026-12-05T13:49:05.940000000Z" level=info msg="CreateContainer within sandbox \"aa01\" for container &ContainerMetadata{Name:init,Attempt:0,}"
time="2026-12-05T13:49:05.945000000Z" level=info msg="CreateContainer within sandbox \"aa01\" for &ContainerMetadata{Name:init,Attempt:0,} returns container id \"cc02\""
time="2026-12-05T13:49:05.960000000Z" level=info msg="StartContainer for \"cc02\" returns successfully"
time="2026-12-05T13:49:07.000000000Z" level=info msg="CreateContainer within sandbox \"aa01\" for container name:\"init\" attempt:1"
`
	kubelet := `I1205 13:49:06.092732   27122 kubelet.go:2788] "SyncLoop (PLEG): event for pod" pod="bench-hook/p0-1-4" event={"ID":"61d7","Type":"ContainerDied","Data":"cc02"}
`
	for name, text := range map[string]string{"containerd.log": containerd, "kubelet.log": kubelet} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	created := time.Date(2026, 12, 5, 13, 49, 5, 100e6, time.UTC).In(time.Local)
	p := &podTimes{created: created}
	if err := readPodTimes(dir, map[string]*podTimes{"bench-hook/p0-1-4": p}); err != nil {
		t.Fatal(err)
	}
	ms := func(a, b time.Time) int64 { return b.Sub(a).Milliseconds() }
	if got := ms(p.created, p.sandbox); got != 700 {
		t.Errorf("sandbox after %d ms, want 700", got)
	}
	if got := ms(native(p), p.requested["init"]); got != 90 {
		t.Errorf("the gate: %d ms, want 90 (the retry's request ignored)", got)
	}
	if got := ms(p.started["init"], p.died["init"]); got != 132 {
		t.Errorf("init's exit seen after %d ms, want 132", got)
	}
}
