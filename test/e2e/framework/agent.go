package framework

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/nodeagent"
)

// AgentPod returns the node agent's pod on node, or nil.
func (e *Env) AgentPod(ctx context.Context, node string) (*corev1.Pod, error) {
	pods, err := e.Node.Client.CoreV1().Pods(DetourNamespace).List(ctx, metav1.ListOptions{
		LabelSelector: "app.kubernetes.io/component=node-agent", FieldSelector: "spec.nodeName=" + node,
	})
	if err != nil || len(pods.Items) == 0 {
		return nil, err
	}
	return &pods.Items[0], nil
}

// AgentState describes the node agent's pod p ([Env.AgentPod]; nil: absent) for a wait's
// message.
func AgentState(p *corev1.Pod) string {
	if p == nil {
		return "absent"
	}
	return fmt.Sprintf("%s %s ready=%v", p.Name, p.Status.Phase, PodReady(p))
}

// DropInPath is detour's drop-in for the primary's network on the control-plane node.
func (e *Env) DropInPath() string { return NodeDropIn(e.Node) }

// NodeDropIn is detour's drop-in for the primary's network on node n.
func NodeDropIn(n *Node) string {
	return filepath.Join(n.CNIConfDir, n.Primary(), nodeagent.DropInName)
}

// DetourConfigs lists the files that hold detour's configuration, in either form: a
// configuration file in the conf dir naming detour-cni, or a *.conf drop-in in one of its
// subdirectories naming it.
func (e *Env) DetourConfigs() ([]string, error) {
	var found []string
	for _, pattern := range []string{"*.conf", "*.conflist", "*.json", "*/*.conf"} {
		matches, err := filepath.Glob(filepath.Join(e.Node.CNIConfDir, pattern))
		if err != nil {
			return nil, err
		}
		for _, m := range matches {
			data, err := os.ReadFile(m)
			if err != nil {
				return nil, err
			}
			if strings.Contains(string(data), "detour-cni") {
				found = append(found, m)
			}
		}
	}
	return found, nil
}

// WaitDetourConfigs waits until exactly the files want hold detour's configuration.
func (e *Env) WaitDetourConfigs(t testing.TB, ctx context.Context, what string, want ...string) {
	t.Helper()
	var got []string
	WaitFor(t, ctx, what, time.Minute, func() (bool, error) {
		var err error
		if got, err = e.DetourConfigs(); err != nil {
			return false, err
		}
		return strings.Join(got, " ") == strings.Join(want, " "), Seen("detour's configuration in %v", got)
	})
}

// AgentLog is the node agent's log.
func (e *Env) AgentLog(t testing.TB, ctx context.Context) string {
	t.Helper()
	p, err := e.AgentPod(ctx, e.Node.Name)
	if err != nil || p == nil {
		t.Fatalf("find the node agent's pod on %s: %v", e.Node.Name, err)
	}
	return e.Logs(ctx, DetourNamespace, p.Name, "install-cni")
}

// HeldLogs are the node agent's container logs on a node, held open so that what the agent
// writes until it exits can be read after the kubelet removed the files.
type HeldLogs struct {
	// Files are the open logs, one per node agent's pod.
	Files []*os.File
}

// HoldAgentLogs opens the running container log (<restart count>.log, the highest) of every
// node agent's pod on node n.
func (e *Env) HoldAgentLogs(ctx context.Context, n *Node) (*HeldLogs, error) {
	pods, err := e.Node.Client.CoreV1().Pods(DetourNamespace).List(ctx, metav1.ListOptions{
		LabelSelector: "app.kubernetes.io/component=node-agent", FieldSelector: "spec.nodeName=" + n.Name,
	})
	if err != nil {
		return nil, err
	}
	h := &HeldLogs{}
	for _, p := range pods.Items {
		dir := filepath.Join(n.Dir, "pod-logs", p.Namespace+"_"+p.Name+"_"+string(p.UID), "install-cni")
		entries, err := os.ReadDir(dir)
		if err != nil {
			h.Close()
			return nil, fmt.Errorf("the node agent's log on the node: %w", err)
		}
		newest, restarts := "", -1
		for _, e := range entries {
			if n, err := strconv.Atoi(strings.TrimSuffix(e.Name(), ".log")); err == nil && n > restarts {
				newest, restarts = e.Name(), n
			}
		}
		if restarts < 0 {
			h.Close()
			return nil, fmt.Errorf("the node agent's log on the node: no <n>.log in %s", dir)
		}
		f, err := os.Open(filepath.Join(dir, newest))
		if err != nil {
			h.Close()
			return nil, fmt.Errorf("the node agent's log on the node: %w", err)
		}
		h.Files = append(h.Files, f)
	}
	return h, nil
}

// Read returns what the agents logged since the last read (the first: since they started).
func (h *HeldLogs) Read() string {
	var b strings.Builder
	for _, f := range h.Files {
		rest, _ := io.ReadAll(f) // to the file's end, which is the agent's exit once it exited
		b.Write(rest)
	}
	return b.String()
}

// AtSIGTERM reads the logs on (see read) and returns the messages of the agent's decision at
// SIGTERM, each followed by a space.
func (h *HeldLogs) AtSIGTERM() string {
	var decision string
	for line := range strings.Lines(h.Read()) {
		if strings.Contains(line, "stopping") || strings.Contains(line, "SIGTERM") || strings.Contains(line, "uninstall") ||
			(strings.Contains(line, "token") && strings.Contains(line, "refuses")) {
			if _, msg, ok := strings.Cut(line, " msg="); ok { // past the CRI log prefix, the time and level
				line = msg
			}
			decision += strings.TrimSpace(line) + " "
		}
	}
	return decision
}

// Close closes the logs.
func (h *HeldLogs) Close() {
	for _, f := range h.Files {
		f.Close()
	}
}
