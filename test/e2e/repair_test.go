package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/internal/clustercheck"
	"github.com/detourmesh/detour/repair"
	"github.com/detourmesh/detour/test/e2e/framework"
	"github.com/detourmesh/detour/validator"
)

// seed000Repair: with the agent gone and detour's configuration (drop-in or in-file entry)
// removed behind its back, a new pod starts without rules and its validator fails; once the agent is back, repair deletes the
// pod, its ReplicaSet recreates it and it runs. A bare pod is annotated, never deleted.
func seed000Repair(t *testing.T, ctx context.Context, e *framework.Env) {
	e.SetAgent(t, ctx, false)
	// Both forms go: the drop-in first, then the conflist's rewrite makes containerd reload.
	if err := os.RemoveAll(filepath.Dir(e.DropInPath())); err != nil {
		t.Fatal(err)
	}
	if err := e.Node.WritePrimaryConfig(); err != nil {
		t.Fatal(err)
	}
	e.Namespace(t, ctx, "late", true)
	if _, err := e.Node.Client.AppsV1().Deployments("late").Create(ctx, e.Deployment("late", "late", 1), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Node.Client.CoreV1().Pods("late").Create(ctx, e.Pod("bare", "late"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var failed map[string]string // pod name → UID
	framework.WaitFor(t, ctx, "both pods' validators to fail (no rules)", 2*time.Minute, func() (bool, error) {
		pods, err := e.Pods(ctx, "late", "")
		if err != nil {
			return false, err
		}
		failed = map[string]string{}
		for _, p := range pods {
			if framework.CheckExit(&p) == 42 {
				failed[p.Name] = string(p.UID)
			}
		}
		return len(failed) == 2, framework.Seen("validators failed with 42: %v; pods:\n%s", failed, e.Describe(ctx, "late"))
	})
	// Caught where validator.mode auto puts the check on this release (at the proxy's start on
	// 1.35 and later: the sidecar exited with the validator's code and message), and the app
	// never ran (fail closed).
	pods, err := e.Pods(ctx, "late", "")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pods {
		if want := autoChecksAtProxyStart(e); framework.ChecksAtProxyStart(&p) != want {
			t.Errorf("pod %s: the check ran in %s, want %s", p.Name, validator.CheckContainer(&p), checkPlace(want))
		}
		for _, c := range p.Status.ContainerStatuses {
			if c.State.Running != nil || c.State.Terminated != nil || c.LastTerminationState.Terminated != nil {
				t.Errorf("pod %s: container %s ran although its proxy's check found no redirect: %s", p.Name, c.Name, framework.ContainerStates(&p))
			}
		}
	}

	// `detour check --cluster` sees the broken node: no agent, two failed validators.
	report, exitNonZero := e.CheckCluster(t, ctx)
	if !exitNonZero {
		t.Errorf("detour check --cluster exited 0 on a node without its agent")
	}
	if res, _ := report.Result("node-agent"); res.Status == clustercheck.OK {
		t.Errorf("check node-agent is ok on a node without its agent: %s", res.Message)
	}
	framework.WantCheck(t, report, "validator", clustercheck.Error, "exit 42")

	e.SetAgent(t, ctx, true)
	replaced := e.WaitReady(t, ctx, "late", "app=late", 1)[0]
	if _, stale := failed[replaced.Name]; stale {
		t.Errorf("the Deployment's pod %s was not recreated", replaced.Name)
	}
	if code := framework.CheckExit(&replaced); code != 0 {
		t.Errorf("the recreated pod's validator exited %d", code)
	}
	framework.WaitFor(t, ctx, "repair to annotate the bare pod", time.Minute, func() (bool, error) {
		p, err := e.Node.Client.CoreV1().Pods("late").Get(ctx, "bare", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if string(p.UID) != failed["bare"] {
			return false, fmt.Errorf("the bare pod was replaced")
		}
		_, ok := p.Annotations[repair.RecreateAnnotation]
		return ok, framework.Seen("the bare pod's annotations %v", p.Annotations)
	})
}
