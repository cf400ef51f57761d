package scale

import (
	"os/exec"
	"syscall"
	"testing"
)

func TestSampleHWM(t *testing.T) {
	// A child of a process that holds 256 MiB: rusage would report the parent's peak.
	ballast := make([]byte, 256<<20)
	for i := range ballast {
		ballast[i] = 1
	}
	cmd := exec.Command("sleep", "0.3")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	peak := sampleHWM(cmd.Process.Pid)
	if err := cmd.Wait(); err != nil {
		t.Fatal(err)
	}
	got := peak()
	if got <= 0 || got > 64<<20 {
		t.Errorf("sleep's peak RSS: %d bytes, want a few MiB (not its parent's %d MiB)", got, len(ballast)>>20)
	}
	if ru := cmd.ProcessState.SysUsage().(*syscall.Rusage); ru.Maxrss<<10 < int64(len(ballast)) {
		t.Logf("rusage no longer inherits the parent's peak (%d KiB): sampleHWM could be replaced by it", ru.Maxrss)
	}
}
