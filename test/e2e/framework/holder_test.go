package framework

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/detourmesh/detour/test/testenv"
)

// TestIntegrationHolder checks the holder's promises without a node: the processes it starts
// share its network and mount namespaces, machine-wide sysctls and the host's /run are out
// of their reach, and closing it ends every process of the run, its grandchildren included.
func TestIntegrationHolder(t *testing.T) {
	testenv.Privileged(t)
	dir := t.TempDir()
	cgroup := filepath.Base(dir) + "-holder"
	if err := createCgroup(cgroup); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { killCgroup(cgroup, 0); removeCgroup(cgroup) })
	hostPanic, err := os.ReadFile("/proc/sys/kernel/panic")
	if err != nil {
		t.Fatal(err)
	}
	h, err := startHolder(holderSpec{
		RunDir: dir, Cgroup: cgroup, Sysctls: machineSysctls(),
		Net: netSpec{Link: "node0", NodeIP: NodeIP},
	}, filepath.Join(dir, "holder.log"))
	if err != nil {
		t.Fatal(err)
	}
	run := func(script string) string {
		t.Helper()
		out := filepath.Join(dir, "out")
		os.Remove(out)
		pid, err := h.start([]string{"/bin/sh", "-c", script}, []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin"}, out, "")
		if err != nil {
			t.Fatal(err)
		}
		exited, code, err := h.wait(pid, 20*time.Second)
		data, _ := os.ReadFile(out)
		if err != nil || !exited || code != 0 {
			t.Fatalf("%s: exited %v, code %d, err %v, output %s", script, exited, code, err, data)
		}
		return string(data)
	}

	if got := run("echo 99 > /proc/sys/kernel/panic; cat /proc/sys/kernel/panic"); strings.TrimSpace(got) != "99" {
		t.Errorf("kernel.panic inside the node reads %q after writing 99", got)
	}
	if got, _ := os.ReadFile("/proc/sys/kernel/panic"); string(got) != string(hostPanic) {
		t.Errorf("the host's kernel.panic changed to %q (was %q)", got, hostPanic)
	}
	run("touch /run/detour-e2e-holder-test")
	if _, err := os.Stat("/run/detour-e2e-holder-test"); !os.IsNotExist(err) {
		t.Errorf("a file the node wrote in /run reached the host's /run (%v)", err)
	}
	if got := run("cat /proc/net/fib_trie"); !strings.Contains(got, NodeIP.String()) {
		t.Errorf("the node's namespace has no %s:\n%s", NodeIP, got)
	}
	if got := run("readlink /proc/self/ns/net"); got == mustReadlink(t, "/proc/self/ns/net")+"\n" {
		t.Errorf("a process the holder started is in the host's network namespace %s", got)
	}

	// A grandchild that outlives its parent (as containerd's shims do) still ends with the run.
	out := filepath.Join(dir, "bg")
	if _, err := h.start([]string{"/bin/sh", "-c", "sleep 600 & echo $!"}, nil, out, ""); err != nil {
		t.Fatal(err)
	}
	var orphan int
	for deadline := time.Now().Add(10 * time.Second); orphan == 0 && time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		data, _ := os.ReadFile(out)
		orphan = atoi(strings.TrimSpace(string(data)))
	}
	if orphan == 0 {
		t.Fatal("the background sleep did not report its PID")
	}
	if err := h.close(); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(orphan, 0); err == nil {
		t.Errorf("process %d of the run still runs after the holder closed", orphan)
	}
	if pids := CgroupPIDs(cgroup); len(pids) != 0 {
		t.Errorf("cgroup %s still holds %v", cgroup, pids)
	}
}

func mustReadlink(t *testing.T, p string) string {
	s, err := os.Readlink(p)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func atoi(s string) int {
	n := 0
	for _, c := range s {
		if c < '0' || c > '9' {
			return 0
		}
		n = n*10 + int(c-'0')
	}
	return n
}
