package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/nodeagent"
	"github.com/detourmesh/detour/test/e2e/framework"
)

// agentFollowsTheNode: after the first readiness, the node agent keeps the node's state true
// on the real node (issue 15): STATUS keeps the node's network ready without the plugin's
// kubeconfig and token, the ready label leaves when the CNI config does and comes back with
// it (no taint is put back), and a restarted agent restores detour's configuration while the
// API server is down.
func agentFollowsTheNode(t *testing.T, ctx context.Context, e *framework.Env) {
	t.Run("status-without-kubeconfig", func(t *testing.T) {
		e.SetAgent(t, ctx, false)
		defer e.SetAgent(t, ctx, true)
		for _, name := range []string{nodeagent.DefaultKubeconfigName, nodeagent.DefaultTokenName} {
			if err := os.Remove(filepath.Join(e.Node.CNIConfDir, name)); err != nil && !os.IsNotExist(err) {
				t.Fatal(err)
			}
		}
		// Three of containerd's STATUS rounds (about 5 s apart): the node stays Ready.
		deadline := time.Now().Add(16 * time.Second)
		for time.Now().Before(deadline) {
			if ready, msg := framework.NodeCondition(ctx, e.Node); !ready {
				t.Fatalf("the node went NotReady without the plugin's kubeconfig and token: %s", msg)
			}
			time.Sleep(time.Second)
		}
	})

	t.Run("label-follows-the-config", func(t *testing.T) {
		if err := os.Remove(e.Node.PrimaryConfigPath()); err != nil {
			t.Fatal(err)
		}
		framework.WaitFor(t, ctx, "the agent to take the ready label off", time.Minute, func() (bool, error) {
			node, err := e.Node.Client.CoreV1().Nodes().Get(ctx, framework.NodeName, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			if framework.HasStartupTaint(node) {
				return false, fmt.Errorf("the agent put the startup taint back: %v", node.Spec.Taints)
			}
			return node.Labels[annotations.CNIReadyLabel] == "", framework.Seen("node labels %v", node.Labels)
		})
		if err := e.Node.WritePrimaryConfig(); err != nil {
			t.Fatal(err)
		}
		waitLabelled(t, ctx, e)
	})

	t.Run("entry-restored-without-the-api", func(t *testing.T) {
		if err := e.Node.StopComponent("kube-apiserver"); err != nil {
			t.Fatal(err)
		}
		defer func() {
			if err := e.Node.StartComponent(ctx, "kube-apiserver"); err != nil {
				t.Fatal(err)
			}
			waitLabelled(t, ctx, e)
		}()
		if err := e.Node.WritePrimaryConfig(); err != nil { // the primary rewrote its file
			t.Fatal(err)
		}
		pid, err := agentPID(e.Node.Cgroup)
		if err != nil {
			t.Fatal(err)
		}
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil { // the kubelet restarts it
			t.Fatal(err)
		}
		framework.WaitFor(t, ctx, "the restarted agent to put detour's configuration back with the API server down", 90*time.Second, func() (bool, error) {
			found, err := e.DetourConfigs()
			if err != nil {
				return false, err
			}
			return len(found) > 0, framework.Seen("no detour configuration in %s", e.Node.CNIConfDir)
		})
	})
}

// waitLabelled waits for the node's ready label.
func waitLabelled(t testing.TB, ctx context.Context, e *framework.Env) {
	t.Helper()
	framework.WaitFor(t, ctx, "the agent to label the node ready", time.Minute, func() (bool, error) {
		node, err := e.Node.Client.CoreV1().Nodes().Get(ctx, framework.NodeName, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		return node.Labels[annotations.CNIReadyLabel] == "true", framework.Seen("node labels %v, taints %v", node.Labels, node.Spec.Taints)
	})
}

// agentPID finds the node agent's install-cni process among the node's processes (those in
// the run's cgroup: never another run's or another test's).
func agentPID(cgroup string) (int, error) {
	dirs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range dirs {
		data, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		args := strings.Split(string(data), "\x00")
		if len(args) > 1 && strings.HasSuffix(args[0], "/detour") && args[1] == "install-cni" &&
			strings.Contains(framework.ReadFile(filepath.Join(filepath.Dir(p), "cgroup")), "/"+cgroup+"/") {
			var pid int
			fmt.Sscanf(filepath.Base(filepath.Dir(p)), "%d", &pid)
			return pid, nil
		}
	}
	return 0, fmt.Errorf("no detour install-cni process found")
}
