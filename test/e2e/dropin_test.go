package e2e

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/internal/fsutil"
	"github.com/detourmesh/detour/nodeagent"
)

// dropInPath is detour's drop-in for the primary's network; nodeDropIn is another node's.
func (e *env) dropInPath() string { return nodeDropIn(e.node) }

func nodeDropIn(n *Node) string {
	return filepath.Join(n.CNIConfDir, n.Primary(), nodeagent.DropInName)
}

// detourConfigs lists the files that hold detour's configuration, in either form: a
// configuration file in the conf dir naming detour-cni, or a *.conf drop-in in one of its
// subdirectories naming it.
func (e *env) detourConfigs() ([]string, error) {
	var found []string
	for _, pattern := range []string{"*.conf", "*.conflist", "*.json", "*/*.conf"} {
		matches, err := filepath.Glob(filepath.Join(e.node.CNIConfDir, pattern))
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

// waitDetourConfigs waits until exactly the files want hold detour's configuration.
func (e *env) waitDetourConfigs(t testing.TB, ctx context.Context, what string, want ...string) {
	t.Helper()
	var got []string
	waitFor(t, ctx, what, time.Minute, func() (bool, error) {
		var err error
		if got, err = e.detourConfigs(); err != nil {
			return false, err
		}
		return strings.Join(got, " ") == strings.Join(want, " "), seen("detour's configuration in %v", got)
	})
}

// agentLog is the node agent's log.
func (e *env) agentLog(t testing.TB, ctx context.Context) string {
	t.Helper()
	p, err := e.agentPod(ctx, e.node.Name)
	if err != nil || p == nil {
		t.Fatalf("find the node agent's pod on %s: %v", e.node.Name, err)
	}
	return e.logs(ctx, detourNamespace, p.Name, "install-cni")
}

// heldLogs are the node agent's container logs on a node, held open so that what the agent
// writes until it exits can be read after the kubelet removed the files.
type heldLogs struct{ files []*os.File }

// holdAgentLogs opens the running container log (<restart count>.log, the highest) of every
// node agent's pod on node n.
func (e *env) holdAgentLogs(ctx context.Context, n *Node) (*heldLogs, error) {
	pods, err := e.node.Client.CoreV1().Pods(detourNamespace).List(ctx, metav1.ListOptions{
		LabelSelector: "app.kubernetes.io/component=node-agent", FieldSelector: "spec.nodeName=" + n.Name,
	})
	if err != nil {
		return nil, err
	}
	h := &heldLogs{}
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
		h.files = append(h.files, f)
	}
	return h, nil
}

// read returns what the agents logged since the last read (the first: since they started).
func (h *heldLogs) read() string {
	var b strings.Builder
	for _, f := range h.files {
		rest, _ := io.ReadAll(f) // to the file's end, which is the agent's exit once it exited
		b.Write(rest)
	}
	return b.String()
}

// atSIGTERM reads the logs on (see read) and returns the messages of the agent's decision at
// SIGTERM, each followed by a space.
func (h *heldLogs) atSIGTERM() string {
	var decision string
	for line := range strings.Lines(h.read()) {
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

func (h *heldLogs) Close() {
	for _, f := range h.files {
		f.Close()
	}
}

// dropInSurvivesRewrites: on containerd 2.4 the agent's auto mode installs detour as the
// drop-in <conf dir>/e2e/zz-detour-cni.conf and leaves the primary's conflist alone. The
// primary rewrites its conflist with the agent away, and a new injected pod still gets its
// redirect. Then the churn: injected pods created in waves while the conflist is rewritten 50
// times (atomic rename and in-place write, content changed and unchanged), once with the
// drop-in and once with the in-file entry (a helm upgrade to cniConfigMode chained-entry and
// back, each leaving exactly one detour configuration on the node).
func dropInSurvivesRewrites(t *testing.T, ctx context.Context, e *env) {
	e.waitDetourConfigs(t, ctx, "auto to put detour's drop-in in place, and nothing in the conflist", e.dropInPath())
	if log := e.agentLog(t, ctx); !strings.Contains(log, "mode=drop-in") || !strings.Contains(log, "containerd") || !strings.Contains(log, "loads drop-ins") {
		t.Errorf("the agent's log does not say it chose drop-in because containerd loads drop-ins:\n%s", tail(log, 20))
	}

	e.setAgent(t, ctx, false)
	if err := e.node.WritePrimaryConfig(); err != nil {
		t.Fatal(err)
	}
	if data := readFile(e.node.PrimaryConfigPath()); strings.Contains(data, "detour-cni") {
		t.Fatalf("the rewritten conflist holds detour-cni:\n%s", data)
	}
	e.namespace(t, ctx, "dropin", true)
	if _, err := e.node.Client.CoreV1().Pods("dropin").Create(ctx, e.pod("rewritten", "dropin"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p := e.waitReady(t, ctx, "dropin", "name=rewritten", 1)[0]
	if code := checkExit(&p); code != 0 {
		t.Errorf("pod rewritten: the validator exited %d, want 0", code)
	}
	e.assertCaptured(t, ctx, p, "rewritten")
	e.setAgent(t, ctx, true)

	dropIn := e.churn(t, ctx, "churn-dropin")
	if dropIn.failed != 0 {
		t.Errorf("with the drop-in, %d of %d pods started without rules during %d rewrites of the conflist", dropIn.failed, dropIn.pods, dropIn.rewrites)
	}

	e.installDetour(t, ctx, "nodeAgent: {cniConfigMode: chained-entry}\n")
	e.waitDetourConfigs(t, ctx, "chained-entry to move detour into the conflist and remove the drop-in", e.node.PrimaryConfigPath())
	inFile := e.churn(t, ctx, "churn-entry")

	e.installDetour(t, ctx, "")
	e.waitDetourConfigs(t, ctx, "auto to move detour back to the drop-in", e.dropInPath())
	t.Logf("churn: with the drop-in %d of %d pods started without rules, with the in-file entry %d of %d (%d and %d rewrites of the conflist)",
		dropIn.failed, dropIn.pods, inFile.failed, inFile.pods, dropIn.rewrites, inFile.rewrites)
}

type churnResult struct{ pods, failed, rewrites int }

// churn creates injected pods in waves of 4 in ns while the primary's conflist is rewritten 50
// times, 300ms apart, on each of nodes at once (the control-plane node when none is given),
// and counts the pods whose validator found no rules (exit 42). With more than one node, each
// wave's pods are spread over them.
func (e *env) churn(t testing.TB, ctx context.Context, ns string, nodes ...*Node) churnResult {
	t.Helper()
	if len(nodes) == 0 {
		nodes = []*Node{e.node}
	}
	type conflist struct{ path, base, changed string }
	var files []conflist
	for _, n := range nodes {
		// The primary's own content, without detour's entry, as the primary writes it.
		if err := n.WritePrimaryConfig(); err != nil {
			t.Fatal(err)
		}
		base := readFile(n.PrimaryConfigPath())
		files = append(files, conflist{n.PrimaryConfigPath(), base,
			strings.Replace(base, `"hairpinMode": true,`, `"hairpinMode": true, "mtu": 1500,`, 1)})
	}
	return e.podWaves(t, ctx, ns, nodes, func() int {
		for i := range 50 {
			for _, f := range files {
				content := f.base
				if i%2 == 1 {
					content = f.changed
				}
				var err error
				if i%4 < 2 {
					err = fsutil.ReplaceFile(f.path, 0o644, func(w io.Writer) error {
						_, err := io.WriteString(w, content)
						return err
					})
				} else {
					err = os.WriteFile(f.path, []byte(content), 0o644) // in place: truncate, write
				}
				if err != nil {
					t.Errorf("rewrite %d of %s: %v", i, f.path, err)
					return i
				}
			}
			time.Sleep(300 * time.Millisecond)
		}
		return 50
	})
}

// podWaves creates injected pods in ns in waves of 4, spread over nodes, for as long as
// disturb runs (and the wave that is under way then), and counts them and those whose validator
// found no rules (exit 42). disturb returns the number of disturbances it made, the result's
// rewrites.
func (e *env) podWaves(t testing.TB, ctx context.Context, ns string, nodes []*Node, disturb func() int) churnResult {
	t.Helper()
	e.namespace(t, ctx, ns, true)
	var res churnResult
	var wg sync.WaitGroup
	done := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(done)
		res.rewrites = disturb()
	}()
	pods := e.node.Client.CoreV1().Pods(ns)
	for wave := 0; ; wave++ {
		select {
		case <-done:
		default:
			var names []string
			for i := range 4 {
				name := fmt.Sprintf("w%d-%d", wave, i)
				p := e.pod(name, ns)
				if len(nodes) > 1 {
					onNode(p, nodes[i%len(nodes)].Name)
				}
				if _, err := pods.Create(ctx, p, metav1.CreateOptions{}); err != nil {
					t.Fatal(err)
				}
				names = append(names, name)
			}
			for _, name := range names {
				var p *corev1.Pod
				waitFor(t, ctx, "pod "+ns+"/"+name+"'s validator to finish", 2*time.Minute, func() (bool, error) {
					var err error
					if p, err = pods.Get(ctx, name, metav1.GetOptions{}); err != nil {
						return false, err
					}
					return checkExit(p) >= 0, seen("pod phase %s, init containers %+v", p.Status.Phase, p.Status.InitContainerStatuses)
				})
				res.pods++
				if checkExit(p) != 0 {
					res.failed++
				}
				if err := pods.Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)}); err != nil {
					t.Error(err)
				}
			}
			continue
		}
		break
	}
	wg.Wait()
	return res
}
