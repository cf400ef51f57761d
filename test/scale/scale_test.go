package scale

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/detourmesh/detour/test/testenv"
)

// TestIntegrationScaleSmoke is make scale's smoke (CI, make test): 20 simulated nodes with
// detour's node agent, the cold-install herd, 5 pods per node created through the webhook's
// two replicas, and a steady state, with the API server's audit log read for what each part
// asks per node. It checks what holds at any size — every node ready, every pod injected, every
// request of the node agent made with its node's bound token, scoped to its own node and charged
// by the API server for that node's pods only, nothing throttled, at most one request per node
// per minute beyond watches — and logs the figures; `make scale` measures them at the sizes of
// docs/scale.md.
func TestIntegrationScaleSmoke(t *testing.T) {
	for _, b := range []string{"kube-apiserver", "etcd", "kwok", "helm", "kubectl"} {
		testenv.Binary(t, b)
	}
	root, err := ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	const nodes = 20
	dir, err := os.MkdirTemp("", "detour-scale-")
	if err != nil {
		t.Fatal(err)
	}
	// Kept when the test fails: the audit log, KWOK's log, every node's files and logs.
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the run's files are in %s", dir)
			return
		}
		os.RemoveAll(dir)
	})
	detour, err := BuildDetour(ctx, root, dir)
	if err != nil {
		t.Fatal(err)
	}
	res, err := Run(ctx, Options{
		Nodes: nodes, PodsPerNode: 5, PodsPerSecond: 50, Steady: 45 * time.Second, Detour: detour,
		Chart: ChartDir(root), BinDir: testenv.BinDir(), Dir: dir, Log: testWriter{t},
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.Admission.Uninjected > 0 {
		t.Errorf("%d of the %d pods of namespaces that opt in came back from the API server uninjected", res.Admission.Uninjected, res.Admission.Pods)
	}
	for _, err := range res.Errors {
		t.Errorf("an agent's container failed: %v", err)
	}
	t.Logf("herd: %s (each agent: %s); API p50 %s, p99 %s; %d throttled", res.Herd.Round(time.Millisecond), agentTimes(res.HerdAgent), res.HerdP50, res.HerdP99, res.Throttled)
	if res.HerdAgent[0] <= 0 || res.RolloutAgent[0] <= 0 {
		t.Errorf("no agent's time to ready: herd %v (from the audit log), rollout %v (from the harness's poll)", res.HerdAgent, res.RolloutAgent)
	}
	if res.Throttled > 0 {
		t.Errorf("the API server answered %d requests 429 during the herd of %d nodes", res.Throttled, nodes)
	}
	t.Logf("rollout: %s; API p99 %s; %d throttled", res.Rollout.Round(time.Millisecond), res.RolloutP99, res.RolloutThrottled)
	if res.RolloutThrottled > 0 {
		t.Errorf("the API server answered %d requests 429 during the rollout of %d nodes' agents", res.RolloutThrottled, nodes)
	}
	t.Logf("workload: %d pods at %.0f/s through the webhook's two replicas, creation p50 %s, p99 %s; the webhook's admission p50 %s, p99 %s",
		res.Admission.Pods, res.Admission.Rate, res.Admission.P50, res.Admission.P99, res.Admission.WebhookP50, res.Admission.WebhookP99)
	if res.Admission.WebhookP50 <= 0 {
		t.Errorf("the webhook's admission histogram saw none of the %d pods", res.Admission.Pods)
	}
	parts := []string{"install-cni", "repair"}
	for _, r := range res.Requests {
		if r.Part != "install-cni" && r.Part != "repair" {
			continue
		}
		if r.Node == "" {
			t.Errorf("%s %s %s?%s: no node in its credentials (a token bound to the agent's pod carries it)", r.Part, r.Verb, r.Resource, r.Query)
			continue
		}
		if r.Code >= 500 || r.Code == 429 {
			t.Errorf("%s on %s: %s %s answered %d", r.Part, r.Node, r.Verb, r.Resource, r.Code)
		}
		if (r.Verb == "list" || r.Verb == "watch") && (r.Resource == "pods" || r.Resource == "nodes") && !scopedTo(r, r.Node) {
			t.Errorf("%s on %s: %s %s?%s is not scoped to its node", r.Part, r.Node, r.Verb, r.Resource, r.Query)
		}
		if r.Resource == "pods" && chargedForEveryPod(r) {
			t.Errorf("%s on %s: %s pods?%s: the API server charges it for every pod of the cluster (a list needs a limit of at most 10, a watch a resourceVersion and no sendInitialEvents)", r.Part, r.Node, r.Verb, r.Query)
		}
	}
	for _, part := range parts {
		perNode := res.Steady.PerNodeMinute(part, nodes, false)
		open := OpenWatches(res.Requests, part, res.WatchesAt)
		t.Logf("%s: %.2f requests per node per minute beyond watches in the steady state (%s); watches open on %d nodes: %v",
			part, perNode, res.Steady.To.Sub(res.Steady.From).Round(time.Second), len(open), open)
		if perNode > 1 {
			t.Errorf("%s makes %.2f requests per node per minute beyond its watches in the steady state, want at most 1: %+v", part, perNode, res.Steady.Counts(part))
		}
		if len(open) != nodes {
			t.Errorf("%s has watches open on %d nodes, want every one of the %d", part, len(open), nodes)
		}
	}
	t.Logf("detour check --cluster over %d pods: %s, peak RSS %d MiB; the webhook's peak RSS %d MiB", res.Admission.Pods, res.Check.Round(time.Millisecond), res.CheckMaxRSS>>20, res.WebhookMaxRSS>>20)
	// Its own memory, not this process's (a child's rusage would carry this process's peak).
	if res.CheckMaxRSS <= 0 || res.CheckMaxRSS > 256<<20 {
		t.Errorf("detour check --cluster's peak RSS over %d pods: %d MiB, want its own few dozen", res.Admission.Pods, res.CheckMaxRSS>>20)
	}
	// It read every pod: the workload's are injected, and none of their validators failed.
	for _, want := range []string{"every pod of an opted-in namespace is injected", fmt.Sprintf("(%d injected pods)", res.Admission.Pods)} {
		if !strings.Contains(res.CheckOutput, want) {
			t.Errorf("detour check --cluster does not say %q:\n%s", want, res.CheckOutput)
		}
	}
	t.Logf("heap per node (both containers, in this process): %.0f KiB", res.HeapPerNode/1024)
}

// scopedTo reports whether a list or watch r selects node's objects only.
func scopedTo(r Request, node string) bool {
	q, err := url.ParseQuery(r.Query)
	if err != nil {
		return false
	}
	sel := q.Get("fieldSelector")
	return sel == "spec.nodeName="+node || sel == "metadata.name="+node
}

// chargedForEveryPod reports whether the API server's list work estimator charges a list or
// watch of pods r as if it read every pod of the cluster (k8s.io/apiserver v0.37.2,
// list_work_estimator.go): a list with no limit or one above 10, or a watch that sends its
// initial objects (sendInitialEvents, or no resourceVersion to start from).
func chargedForEveryPod(r Request) bool {
	q, err := url.ParseQuery(r.Query)
	if err != nil {
		return true
	}
	switch r.Verb {
	case "list":
		limit, err := strconv.Atoi(q.Get("limit"))
		return err != nil || limit < 1 || limit > 10
	case "watch":
		rv := q.Get("resourceVersion")
		return q.Get("sendInitialEvents") == "true" || rv == "" || rv == "0"
	}
	return false
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}
