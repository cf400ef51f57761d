package e2e

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/detourmesh/detour/test/e2e/framework"
	"github.com/detourmesh/detour/test/images"
	"github.com/detourmesh/detour/test/testenv"
)

// untidyHostEnv makes the test binary, started by TestIntegrationNodeOnAnUntidyHost in a mount
// namespace of its own, play the untidy host.
const untidyHostEnv = "DETOUR_E2E_UNTIDY_HOST"

// TestIntegrationNodeOnAnUntidyHost runs a node, and the reboot fault, on a host in the state
// developers' machines and CI runners are in: iproute2's /run/netns as a shared mount with a
// namespace bound below it (any `ip netns add` leaves that), a stale /run/netns entry, a
// containerd already serving at the default socket, and the node's ports taken on the host's
// loopback. Such a host once took the soak's reboot down ("mounts left after unmounting:
// [/run/netns]"). The test binary runs again in a mount namespace of its own, where it makes
// the host untidy without touching the real one (a tmpfs over its /run, a containerd whose
// state lives there); the real host's links and mounts are compared before and after.
func TestIntegrationNodeOnAnUntidyHost(t *testing.T) {
	bin := framework.RequireNode(t)
	if os.Getenv(untidyHostEnv) == "1" {
		nodeOnUntidyHost(t, bin)
		return
	}
	testenv.LockHost(t) // no other package's test changes the host's links or mounts meanwhile
	hostLinks, hostMounts := linkNames(t), mountCount(t)
	ctx, cancel := framework.Context(t, nil, 12*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "/proc/self/exe", "-test.run", "^"+t.Name()+"$", "-test.v", "-test.count", "1", "-test.timeout", "11m")
	cmd.Env = append(os.Environ(), untidyHostEnv+"=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNS, Pdeathsig: syscall.SIGKILL}
	out, err := cmd.CombinedOutput()
	t.Logf("the test on the untidy host:\n%s", out)
	if err != nil {
		t.Fatalf("the node on the untidy host: %v (%v)", err, context.Cause(ctx))
	}
	if !strings.Contains(string(out), "--- PASS: "+t.Name()) {
		t.Fatalf("the test on the untidy host did not pass (skipped?)")
	}
	if got := linkNames(t); got != hostLinks {
		t.Errorf("the host's links changed: before %s, after %s", hostLinks, got)
	}
	if got := mountCount(t); got != hostMounts {
		t.Errorf("the host has %d mounts after the run, %d before", got, hostMounts)
	}
}

// nodeOnUntidyHost is the test's own-mount-namespace half.
func nodeOnUntidyHost(t *testing.T, bin string) {
	ctx, cancel := framework.Context(t, nil, 10*time.Minute)
	defer cancel()
	host := makeUntidyHost(t, ctx, bin)

	built, err := images.Build(ctx, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	n, err := framework.Start(ctx, bin, framework.Options{Images: []string{built.Tarball}, PauseImage: built.Refs.Pause})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := n.Stop(); err != nil {
			t.Error(err)
		}
	}()
	ctx, stopWatch := n.Watch(ctx)
	defer stopWatch()

	// The node's mount table holds nothing of the host's below the directories it replaces.
	mounts, err := framework.MountsUnder(n.HolderPID(), framework.ReplacedDirs...)
	if err != nil {
		t.Fatal(err)
	}
	if slices.ContainsFunc(mounts, func(m string) bool { return strings.HasPrefix(m, "/run/netns") }) {
		t.Errorf("the host's /run/netns mounts reached the node: %v", mounts)
	}
	if _, err := n.Run(ctx, "ls", "/run/netns"); err == nil {
		t.Errorf("the node sees the host's /run/netns")
	}

	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: metav1.NamespaceDefault},
		Spec: corev1.PodSpec{
			AutomountServiceAccountToken: ptr.To(false), TerminationGracePeriodSeconds: ptr.To[int64](1),
			Containers: []corev1.Container{{
				Name: "app", Image: built.Refs.Workload, ImagePullPolicy: corev1.PullNever,
				Args: []string{"serve", "-listen", ":8080"},
				ReadinessProbe: &corev1.Probe{
					ProbeHandler:  corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(8080)}},
					PeriodSeconds: 1,
				},
			}},
		},
	}
	pods := n.Client.CoreV1().Pods(metav1.NamespaceDefault)
	if _, err := pods.Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	serving := func(since time.Time) func() (bool, error) {
		return func() (bool, error) {
			p, err := pods.Get(ctx, "web", metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			if !framework.PodReady(p) || !startedAfter(p, since) {
				return false, framework.Seen("pod web: phase %s, ready %v, containers %s", p.Status.Phase, framework.PodReady(p), framework.ContainerStates(p))
			}
			_, err = n.Greeting(ctx, p.Status.PodIP+":8080")
			return err == nil, err
		}
	}
	framework.WaitFor(t, ctx, "pod web to serve", 2*time.Minute, serving(time.Time{}))

	rebooted := time.Now()
	detail, err := n.Reboot(ctx)
	if err != nil {
		t.Fatalf("reboot: %v", err)
	}
	t.Logf("reboot: %s", detail)
	framework.WaitFor(t, ctx, "pod web to serve again after the reboot", 3*time.Minute, serving(rebooted))

	// A reboot that fails half-way (containerd died before it) still leaves the node running.
	if err := n.StopComponent("containerd"); err != nil {
		t.Fatal(err)
	}
	if _, err := n.Reboot(ctx); err == nil || !strings.Contains(err.Error(), "stop containerd") {
		t.Fatalf("a reboot with containerd gone: got %v, want its failure to stop containerd", err)
	}
	for _, c := range []string{"containerd", "kubelet"} {
		if _, dead := n.Exited(c); dead || n.PID(c) == 0 {
			t.Errorf("%s is not running after the failed reboot", c)
		}
	}
	// Its pods were not touched: they serve on, through the restarted kubelet.
	framework.WaitFor(t, ctx, "pod web to serve after the failed reboot", time.Minute, serving(time.Time{}))
	if ready, msg := framework.NodeCondition(ctx, n); !ready {
		t.Errorf("the node is not Ready after the failed reboot: %s", msg)
	}

	host.check(t)

	// A component that dies ends every wait on the watched context at once, saying which.
	if err := syscall.Kill(n.PID("kubelet"), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	err = framework.Poll(ctx, time.Minute, func() (bool, error) { return false, framework.Seen("a condition that never holds") })
	t.Logf("a wait with the kubelet dead: %v", err)
	if err == nil || !strings.Contains(err.Error(), "component kubelet exited") || time.Since(start) > 10*time.Second {
		t.Errorf("a wait while the kubelet was dead ended after %s with %v; want it to end at once naming the kubelet", time.Since(start).Round(time.Millisecond), err)
	}
}

// untidyHost is the host state the test made, to check it is still there after the node.
type untidyHost struct {
	netns, stale string
	containerd   *exec.Cmd
	ctr          []string
}

// makeUntidyHost makes the test's mount namespace an untidy host, and undoes what would
// outlive it when the test ends.
func makeUntidyHost(t *testing.T, ctx context.Context, bin string) *untidyHost {
	// Nothing mounted from here on reaches the real host.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		t.Fatal(err)
	}
	// The host's own /run, its mounts below still in the table (as a real host's are).
	if err := unix.Mount("tmpfs", "/run", "tmpfs", 0, "mode=0755"); err != nil {
		t.Fatal(err)
	}
	h := &untidyHost{netns: fmt.Sprintf("detour-untidy-%d", os.Getpid())}
	h.stale = "/run/netns/" + h.netns + "-stale"
	if out, err := exec.CommandContext(ctx, "ip", "netns", "add", h.netns).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v\n%s", err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "netns", "del", h.netns).Run() })
	if err := os.WriteFile(h.stale, nil, 0o444); err != nil {
		t.Fatal(err)
	}

	// A containerd at the default address, its root in the test's directory.
	dir := t.TempDir()
	config := filepath.Join(dir, "config.toml")
	if err := os.WriteFile(config, fmt.Appendf(nil, `version = 3
root = %q
state = "/run/containerd"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime", "io.containerd.cri.v1.images", "io.containerd.nri.v1.nri"]
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins.'io.containerd.internal.v1.opt']
  path = %q
`, filepath.Join(dir, "root"), filepath.Join(dir, "opt")), 0o644); err != nil {
		t.Fatal(err)
	}
	log, err := os.Create(filepath.Join(dir, "containerd.log"))
	if err != nil {
		t.Fatal(err)
	}
	h.containerd = exec.Command(filepath.Join(bin, "containerd"), "--config", config)
	h.containerd.Stdout, h.containerd.Stderr = log, log
	h.containerd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := h.containerd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.containerd.Process.Kill(); h.containerd.Wait(); log.Close() })
	h.ctr = []string{filepath.Join(bin, "ctr"), "--address", "/run/containerd/containerd.sock", "version"}
	framework.WaitFor(t, ctx, "the host's containerd to answer", 30*time.Second, func() (bool, error) {
		out, err := exec.CommandContext(ctx, h.ctr[0], h.ctr[1:]...).CombinedOutput()
		if err != nil {
			return false, fmt.Errorf("%v: %s", err, out)
		}
		return true, nil
	})

	// The node's ports, taken on the host's loopback (a host that runs its own control plane).
	for _, port := range []int{2379, framework.APIPort, 10250, 10257, 10259, framework.ServerPort} {
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			continue // taken already: untidy enough
		}
		t.Cleanup(func() { l.Close() })
	}
	h.check(t)
	return h
}

// check fails the test when the host's state the test made is gone: the node must not have
// touched it.
func (h *untidyHost) check(t *testing.T) {
	t.Helper()
	// The last entry is the one on top (the real host's may lie below the test's /run).
	m, err := mountinfo.GetMounts(func(i *mountinfo.Info) (skip, stop bool) { return i.Mountpoint != "/run/netns", false })
	if err != nil || len(m) == 0 || !strings.Contains(m[len(m)-1].Optional, "shared:") {
		t.Errorf("the host's /run/netns is not a shared mount (%d entries, %v)", len(m), err)
	}
	if mounted, err := mountinfo.Mounted("/run/netns/" + h.netns); err != nil || !mounted {
		t.Errorf("the host's namespace %s is not bound at /run/netns (%v)", h.netns, err)
	}
	if _, err := os.Stat(h.stale); err != nil {
		t.Errorf("the host's stale entry: %v", err)
	}
	if out, err := exec.Command(h.ctr[0], h.ctr[1:]...).CombinedOutput(); err != nil {
		t.Errorf("the host's containerd does not answer: %v\n%s", err, out)
	}
	if err := h.containerd.Process.Signal(syscall.Signal(0)); errors.Is(err, os.ErrProcessDone) {
		t.Errorf("the host's containerd is gone")
	}
}
