package e2e

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/internal/fsutil"
	"github.com/detourmesh/detour/nodeagent"
	"github.com/detourmesh/detour/test/e2e/framework"
)

// dropInSurvivesRewrites: on containerd 2.4 the agent's auto mode installs detour as the
// drop-in <conf dir>/e2e/zz-detour-cni.conf and leaves the primary's conflist alone. The
// primary rewrites its conflist with the agent away, and a new injected pod still gets its
// redirect. Then the churn: injected pods created in waves while the conflist is rewritten 50
// times (atomic rename and in-place write, content changed and unchanged), once with the
// drop-in and once with the in-file entry (a helm upgrade to cniConfigMode chained-entry and
// back, each leaving exactly one detour configuration on the node).
func dropInSurvivesRewrites(t *testing.T, ctx context.Context, e *framework.Env) {
	dropInSurvivesARewrite(t, ctx, e)

	dropIn := churn(t, ctx, e, "churn-dropin")
	if dropIn.failed != 0 {
		t.Errorf("with the drop-in, %d of %d pods started without rules during %d rewrites of the conflist", dropIn.failed, dropIn.pods, dropIn.rewrites)
	}

	e.InstallDetour(t, ctx, "nodeAgent: {cniConfigMode: chained-entry}\n")
	e.WaitDetourConfigs(t, ctx, "chained-entry to move detour into the conflist and remove the drop-in", e.Node.PrimaryConfigPath())
	inFile := churn(t, ctx, e, "churn-entry")
	// 50 rewrites 300 ms apart, each taking the entry out: the agent takes it for a primary that
	// fights its entry (ten within 30 s) and refuses, with an Event on the node, until it
	// restarts (the helm upgrade below) or its hold-off ends.
	refusal := ""
	refusals, err := entryWarRefusals(ctx, e, time.Time{})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range refusals {
		if strings.Contains(r.Message, filepath.Base(e.Node.PrimaryConfigPath())) {
			refusal = r.Message
		}
	}
	if refusal == "" {
		t.Errorf("the agent did not refuse a conflist rewritten without its entry every 300 ms (no DetourCNIRefused event saying so)")
	}

	e.InstallDetour(t, ctx, "")
	e.WaitDetourConfigs(t, ctx, "auto to move detour back to the drop-in", e.DropInPath())
	t.Logf("churn: with the drop-in %d of %d pods started without rules, with the in-file entry %d of %d (%d and %d rewrites of the conflist); the agent refused: %s",
		dropIn.failed, dropIn.pods, inFile.failed, inFile.pods, dropIn.rewrites, inFile.rewrites, refusal)
}

// dropInSurvivesARewrite: the agent's auto mode puts detour's drop-in in place and nothing in
// the primary's conflist; the primary rewrites its conflist with the agent away, and a new
// injected pod (dropin/rewritten) still gets its redirect. The agent is back when it returns.
func dropInSurvivesARewrite(t *testing.T, ctx context.Context, e *framework.Env) {
	e.WaitDetourConfigs(t, ctx, "auto to put detour's drop-in in place, and nothing in the conflist", e.DropInPath())
	if log := e.AgentLog(t, ctx); !strings.Contains(log, "mode=drop-in") || !strings.Contains(log, "containerd") || !strings.Contains(log, "loads drop-ins") {
		t.Errorf("the agent's log does not say it chose drop-in because containerd loads drop-ins:\n%s", framework.Tail(log, 20))
	}

	e.SetAgent(t, ctx, false)
	if err := e.Node.WritePrimaryConfig(); err != nil {
		t.Fatal(err)
	}
	if data := framework.ReadFile(e.Node.PrimaryConfigPath()); strings.Contains(data, "detour-cni") {
		t.Fatalf("the rewritten conflist holds detour-cni:\n%s", data)
	}
	e.Namespace(t, ctx, "dropin", true)
	if _, err := e.Node.Client.CoreV1().Pods("dropin").Create(ctx, e.Pod("rewritten", "dropin"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p := e.WaitReady(t, ctx, "dropin", "name=rewritten", 1)[0]
	if code := framework.CheckExit(&p); code != 0 {
		t.Errorf("pod rewritten: the validator exited %d, want 0", code)
	}
	e.AssertCaptured(t, ctx, p, "rewritten")
	e.SetAgent(t, ctx, true)
}

// entryWarRefusal is a node agent's refusal of a primary that kept taking its in-file entry out
// (nodeagent/entrywar.go): the node, the Event's message, and when.
type entryWarRefusal struct {
	Node, Message string
	At            time.Time
}

// entryWarRefusals are the node agents' refusals of a primary fighting their entry recorded
// after since, from their DetourCNIRefused Events.
func entryWarRefusals(ctx context.Context, e *framework.Env, since time.Time) ([]entryWarRefusal, error) {
	events, err := e.Node.Client.CoreV1().Events("default").List(ctx, metav1.ListOptions{FieldSelector: "reason=" + nodeagent.EventReason})
	if err != nil {
		return nil, err
	}
	var out []entryWarRefusal
	for _, ev := range events.Items {
		at := ev.LastTimestamp.Time
		if ev.EventTime.Time.After(at) {
			at = ev.EventTime.Time
		}
		if at.After(since) && strings.Contains(ev.Message, "took detour's entry out of ") {
			out = append(out, entryWarRefusal{ev.InvolvedObject.Name, ev.Message, at})
		}
	}
	return out, nil
}

type churnResult struct{ pods, failed, rewrites int }

// churn creates injected pods in waves of 4 in ns while the primary's conflist is rewritten 50
// times, 300ms apart, on each of nodes at once (the control-plane node when none is given),
// and counts the pods whose validator found no rules (exit 42). With more than one node, each
// wave's pods are spread over them.
func churn(t testing.TB, ctx context.Context, e *framework.Env, ns string, nodes ...*framework.Node) churnResult {
	t.Helper()
	if len(nodes) == 0 {
		nodes = []*framework.Node{e.Node}
	}
	type conflist struct{ path, base, changed string }
	var files []conflist
	for _, n := range nodes {
		// The primary's own content, without detour's entry, as the primary writes it.
		if err := n.WritePrimaryConfig(); err != nil {
			t.Fatal(err)
		}
		base := framework.ReadFile(n.PrimaryConfigPath())
		files = append(files, conflist{n.PrimaryConfigPath(), base,
			strings.Replace(base, `"hairpinMode": true,`, `"hairpinMode": true, "mtu": 1500,`, 1)})
	}
	return podWaves(t, ctx, e, ns, nodes, func() int {
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

// podWaves creates injected pods in ns in waves of 4, pinned in turn to each of nodes, for as long as
// disturb runs (and the wave that is under way then), and counts them and those whose validator
// found no rules (exit 42). disturb returns the number of disturbances it made, the result's
// rewrites.
func podWaves(t testing.TB, ctx context.Context, e *framework.Env, ns string, nodes []*framework.Node, disturb func() int) churnResult {
	t.Helper()
	e.Namespace(t, ctx, ns, true)
	var res churnResult
	var wg sync.WaitGroup
	done := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(done)
		res.rewrites = disturb()
	}()
	pods := e.Node.Client.CoreV1().Pods(ns)
	for wave := 0; ; wave++ {
		select {
		case <-done:
		default:
			var names []string
			for i := range 4 {
				name := fmt.Sprintf("w%d-%d", wave, i)
				p := e.Pod(name, ns)
				framework.OnNode(p, nodes[i%len(nodes)].Name)
				if _, err := pods.Create(ctx, p, metav1.CreateOptions{}); err != nil {
					t.Fatal(err)
				}
				names = append(names, name)
			}
			for _, name := range names {
				var p *corev1.Pod
				framework.WaitFor(t, ctx, "pod "+ns+"/"+name+"'s validator to finish", 2*time.Minute, func() (bool, error) {
					var err error
					if p, err = pods.Get(ctx, name, metav1.GetOptions{}); err != nil {
						return false, err
					}
					return framework.CheckExit(p) >= 0, framework.Seen("pod phase %s, init containers %+v", p.Status.Phase, p.Status.InitContainerStatuses)
				})
				res.pods++
				if framework.CheckExit(p) != 0 {
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
