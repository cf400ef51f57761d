package e2e

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/test/e2e/framework"
	"github.com/detourmesh/detour/test/testenv"
)

// TestIntegrationNodeLeavesNothing starts a bare node (no images, no pods), checks that it
// registers and is Ready, has two more nodes join it (one leaves on its own, the other with the
// control-plane node), stops it, and checks that nothing of any of them is left on the host.
func TestIntegrationNodeLeavesNothing(t *testing.T) {
	bin := framework.RequireNode(t)
	testenv.LockHost(t) // no other package's test changes the host's links meanwhile
	hostLinks := linkNames(t)
	hostMounts := mountCount(t)

	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	start := time.Now()
	n, err := framework.Start(ctx, bin, framework.Options{Taints: []string{framework.StartupTaint + ":NoSchedule"}, PauseImage: "detour.test/pause:1"})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("node Ready %.1fs after start", time.Since(start).Seconds())
	node, err := n.Client.CoreV1().Nodes().Get(ctx, framework.NodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !framework.HasStartupTaint(node) {
		t.Errorf("node %s has taints %v, want %s", framework.NodeName, node.Spec.Taints, framework.StartupTaint)
	}
	if got := node.Status.Addresses; len(got) == 0 || got[0].Address != framework.NodeIP.String() {
		t.Errorf("node addresses %v, want %s first", got, framework.NodeIP)
	}
	var joined []*framework.Node
	for _, name := range []string{"e2e-node-b", "e2e-node-c"} {
		w, err := n.Join(ctx, name, framework.Options{Taints: []string{framework.StartupTaint + ":NoSchedule"}})
		if err != nil {
			n.Stop()
			t.Fatal(err)
		}
		joined = append(joined, w)
	}
	for i, w := range joined {
		got, err := n.Client.CoreV1().Nodes().Get(ctx, w.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if want := framework.UnderlayAddr(i + 1).String(); len(got.Status.Addresses) == 0 || got.Status.Addresses[0].Address != want {
			t.Errorf("node %s addresses %v, want %s first", w.Name, got.Status.Addresses, want)
		}
		// The API server reaches each kubelet over the underlay (logs, exec go this way). A
		// node is Ready before the API server's first connection to its kubelet, and CI's
		// machine runs other packages' tests meanwhile: give it time.
		err = framework.Poll(ctx, 2*time.Minute, func() (bool, error) {
			body, err := n.Client.CoreV1().RESTClient().Get().AbsPath("/api/v1/nodes", w.Name, "proxy", "healthz").DoRaw(ctx)
			if err != nil {
				return false, fmt.Errorf("%w: %s", err, body)
			}
			return true, nil
		})
		if err != nil {
			t.Errorf("the API server cannot reach %s's kubelet: %v\n%s", w.Name, err, underlayState(ctx, n, w))
		}
	}
	watched, stopWatch := n.Watch(ctx)
	defer stopWatch()
	if err := joined[0].Leave(); err != nil {
		t.Errorf("node %s did not leave cleanly: %v", joined[0].Name, err)
	}
	if _, err := os.Stat(joined[0].Dir); !os.IsNotExist(err) && os.Getenv("DETOUR_E2E_KEEP") == "" {
		t.Errorf("the directory of node %s is still there after it left (%v)", joined[0].Name, err)
	}
	// A node that leaves is no dead node; a joined node's component that dies ends every wait
	// on the watched context at once, naming the node.
	framework.SleepCtx(watched, 2500*time.Millisecond)
	if err := context.Cause(watched); err != nil {
		t.Errorf("the watch ended when node %s left: %v", joined[0].Name, err)
	}
	if err := syscall.Kill(joined[1].PID("kubelet"), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	err = framework.Poll(watched, time.Minute, func() (bool, error) { return false, framework.Seen("a condition that never holds") })
	if want := "node " + joined[1].Name + ": component kubelet exited"; err == nil || !strings.Contains(err.Error(), want) || time.Since(killed) > 10*time.Second {
		t.Errorf("a wait with %s's kubelet dead ended after %s with %v; want it to end at once with %q", joined[1].Name, time.Since(killed).Round(time.Millisecond), err, want)
	}
	dir, cgroup := n.Dir, n.Cgroup
	if err := n.Stop(); err != nil {
		t.Fatal(err)
	}

	if _, err := os.Stat(dir); !os.IsNotExist(err) && os.Getenv("DETOUR_E2E_KEEP") == "" {
		t.Errorf("the run's directory %s is still there (%v)", dir, err)
	}
	dirs, _ := framework.CgroupHierarchies()
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, cgroup)); !os.IsNotExist(err) {
			t.Errorf("cgroup %s is still in %s", cgroup, d)
		}
	}
	if got := linkNames(t); got != hostLinks {
		t.Errorf("the host's links changed: before %s, after %s", hostLinks, got)
	}
	if got := mountCount(t); got != hostMounts {
		t.Errorf("the host has %d mounts after the run, %d before", got, hostMounts)
	}
}

// underlayState is what the control-plane node and node w see of the underlay between them, for
// a failure message.
func underlayState(ctx context.Context, cp, w *framework.Node) string {
	var b strings.Builder
	for _, c := range []struct {
		n    *framework.Node
		argv []string
	}{
		{cp, []string{"ip", "-br", "addr"}}, {cp, []string{"ip", "route"}}, {cp, []string{"ip", "neigh"}},
		{cp, []string{"bridge", "link"}}, {cp, []string{"nft", "list", "ruleset"}},
		{w, []string{"ip", "-br", "addr"}}, {w, []string{"ip", "route"}}, {w, []string{"ss", "-ltn"}},
		{cp, []string{"curl", "-sk", "-m", "5", "https://" + w.IP.String() + ":10250/healthz"}},
	} {
		out, err := c.n.Run(ctx, c.argv...)
		fmt.Fprintf(&b, "%s$ %s\n%s%v\n", c.n.Name, strings.Join(c.argv, " "), out, err)
	}
	return b.String()
}

func linkNames(t testing.TB) string {
	ifs, err := net.Interfaces()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, i := range ifs {
		names = append(names, i.Name)
	}
	return strings.Join(names, ",")
}

// mountCount counts the host's mounts, but for the namespaces other test packages, running in
// parallel, keep under testenv's directory.
func mountCount(t testing.TB) int {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for line := range strings.Lines(string(data)) {
		if !strings.Contains(line, " /run/detour-test/") {
			n++
		}
	}
	return n
}
