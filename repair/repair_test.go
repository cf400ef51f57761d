package repair

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/validator"
)

var injected = annotations.Redirect{Version: "v0.1.0", ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140}.Annotations()

func terminated(code int32) corev1.ContainerState {
	return corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: code, Reason: "Error"}}
}

func waiting() corev1.ContainerState {
	return corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff"}}
}

// failedPod is an injected pod on node-1 whose validator exited with 42, owned by owner (nil: bare).
func failedPod(name string, owner *metav1.OwnerReference) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "shop", UID: types.UID("uid-" + name), Annotations: map[string]string{}},
		Spec:       corev1.PodSpec{NodeName: "node-1"},
		Status: corev1.PodStatus{InitContainerStatuses: []corev1.ContainerStatus{
			{Name: annotations.ValidatorContainer, State: waiting(), LastTerminationState: terminated(42), RestartCount: 3},
		}},
	}
	for k, v := range injected {
		p.Annotations[k] = v
	}
	if owner != nil {
		p.OwnerReferences = []metav1.OwnerReference{*owner}
	}
	return p
}

func rsOwner(name string) *metav1.OwnerReference {
	yes := true
	return &metav1.OwnerReference{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: name, UID: "rs-uid", Controller: &yes}
}

// value reads a counter.
func value(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		panic(err)
	}
	return m.GetCounter().GetValue()
}

func TestNeedsRepair(t *testing.T) {
	now := metav1.Now()
	for _, tc := range []struct {
		name   string
		modify func(*corev1.Pod)
		want   bool
	}{
		{"crash loop after 42", func(*corev1.Pod) {}, true},
		{"terminated 42 now", func(p *corev1.Pod) {
			p.Status.InitContainerStatuses[0].State, p.Status.InitContainerStatuses[0].LastTerminationState = terminated(42), corev1.ContainerState{}
		}, true},
		// Issue 15.6: running again in a new sandbox, it may pass: not deleted before it can.
		{"running again after 42", func(p *corev1.Pod) {
			p.Status.InitContainerStatuses[0].State = corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}
		}, false},
		// Issue 15.6: terminal pods are replaced already (restartPolicy Never) or done.
		{"failed pod", func(p *corev1.Pod) {
			p.Status.Phase = corev1.PodFailed
			p.Status.InitContainerStatuses[0].State, p.Status.InitContainerStatuses[0].LastTerminationState = terminated(42), corev1.ContainerState{}
		}, false},
		{"succeeded pod", func(p *corev1.Pod) { p.Status.Phase = corev1.PodSucceeded }, false},
		{"passed since", func(p *corev1.Pod) { p.Status.InitContainerStatuses[0].State = terminated(0) }, false},
		{"other failure", func(p *corev1.Pod) { p.Status.InitContainerStatuses[0].LastTerminationState = terminated(43) }, false},
		{"not injected", func(p *corev1.Pod) { delete(p.Annotations, annotations.Injected) }, false},
		{"being deleted", func(p *corev1.Pod) { p.DeletionTimestamp = &now }, false},
		{"another init container", func(p *corev1.Pod) { p.Status.InitContainerStatuses[0].Name = "migrate" }, false},
		{"no status yet", func(p *corev1.Pod) { p.Status.InitContainerStatuses = nil }, false},
		// Issue 21: the check at the proxy's start (detour.dev/validator: image-volume) fails the
		// proxy container with the validator's code and message; the proxy's own exits do not count.
		{"the proxy's check: crash loop after 42", folded(noRedirect), true},
		{"the proxy's check: terminated 42 now", func(p *corev1.Pod) {
			folded(noRedirect)(p)
			p.Status.InitContainerStatuses[0].State, p.Status.InitContainerStatuses[0].LastTerminationState = p.Status.InitContainerStatuses[0].LastTerminationState, corev1.ContainerState{}
		}, true},
		{"the proxy's check: the proxy runs", func(p *corev1.Pod) {
			folded(noRedirect)(p)
			p.Status.InitContainerStatuses[0].State = corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}
		}, false},
		{"the proxy's own exit 42 after it started", folded("redirect in place: …\n" + validator.StartedMarker + "/usr/bin/proxy\nproxy: fatal\n"), false},
		{"the proxy's own exit 42 without detour's message", folded("proxy: fatal\n"), false},
		{"the validator container of a folded pod", func(p *corev1.Pod) {
			p.Annotations[annotations.Validator] = string(annotations.ValidatorImageVolume)
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := failedPod("p", nil)
			tc.modify(p)
			if got := NeedsRepair(p); got != tc.want {
				t.Errorf("NeedsRepair = %v, want %v", got, tc.want)
			}
		})
	}
}

// noRedirect is the log's end of a check at the proxy's start that found no redirect.
const noRedirect = "detour: no redirect in this pod's network namespace: expected connections to 203.0.113.254:80 to be redirected to port 4140 of this pod, but …\n"

// folded makes the pod's check run at its proxy's start, which exited 42 with message.
func folded(message string) func(*corev1.Pod) {
	return func(p *corev1.Pod) {
		p.Annotations[annotations.Validator] = string(annotations.ValidatorImageVolume)
		last := terminated(42)
		last.Terminated.Message = message
		p.Status.InitContainerStatuses = []corev1.ContainerStatus{{Name: annotations.ProxyContainer, State: waiting(), LastTerminationState: last, RestartCount: 2}}
	}
}

// retrying runs p's check again: its container runs, not started.
func retrying(p *corev1.Pod) *corev1.Pod {
	p.Status.InitContainerStatuses[0].State = corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}
	return p
}

// foldedPod is [failedPod] with the check at its proxy's start.
func foldedPod(name string) *corev1.Pod {
	p := failedPod(name, nil)
	folded(noRedirect)(p)
	return p
}

// healed makes p's proxy, whose check failed once, start.
func healed(p *corev1.Pod) *corev1.Pod {
	started := true
	p.Status.InitContainerStatuses[0].State = corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}
	p.Status.InitContainerStatuses[0].Started = &started
	return p
}

func TestFlagsParse(t *testing.T) {
	f := DefaultFlags()
	f.NodeName = "node-1"
	if cfg, err := f.Parse(); err != nil || cfg.Rate != 1 || cfg.Burst != 5 || !cfg.RequireCNIReady {
		t.Errorf("defaults = %+v, %v", cfg, err)
	}
	for _, tc := range []struct {
		modify func(*Flags)
		want   string
	}{
		{func(f *Flags) { f.NodeName = "" }, `--node-name ""`},
		{func(f *Flags) { f.Rate = 0 }, "--rate 0"},
		{func(f *Flags) { f.Rate = -1 }, "--rate -1"},
		{func(f *Flags) { f.Burst = 0 }, "--burst 0"},
		{func(f *Flags) { f.RecreatingOwners = []string{"ReplicaSet"} }, `--recreating-owners entry "ReplicaSet"`},
		{func(f *Flags) { f.RecreatingOwners = []string{"apps/"} }, `--recreating-owners entry "apps/"`},
		{func(f *Flags) { f.DefaultInject = "all" }, `--default-inject "all": use the webhook's defaultInject, "disabled" or "enabled"`},
		{func(f *Flags) { f.ExcludeNamespaces = []string{"Kube_System"} }, `--exclude-namespaces entry "Kube_System"`},
		{func(f *Flags) { f.OwnNamespace = "detour/system" }, `--namespace "detour/system": it must be detour's namespace`},
	} {
		f := DefaultFlags()
		f.NodeName = "node-1"
		tc.modify(&f)
		if _, err := f.Parse(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Parse error %v, want %q", err, tc.want)
		}
	}
}

// fixture is a controller over a fake API with its cache synced; tests call sync directly.
type fixture struct {
	client *fake.Clientset
	c      *Controller
	reg    *prometheus.Registry
}

func newFixture(t *testing.T, flags Flags, nodeReady bool, pods ...*corev1.Pod) *fixture {
	t.Helper()
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1", Labels: map[string]string{}}}
	if nodeReady {
		node.Labels[annotations.CNIReadyLabel] = "true"
	}
	objs := []runtime.Object{node}
	for _, p := range pods {
		objs = append(objs, p)
	}
	client := fake.NewClientset(objs...)
	flags.NodeName = "node-1"
	cfg, err := flags.Parse()
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	c, err := New(client, cfg, WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))), WithMetrics(NewMetrics(reg)))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	c.factory.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), c.synced) {
		t.Fatal("cache did not sync")
	}
	return &fixture{client: client, c: c, reg: reg}
}

func (f *fixture) sync(t *testing.T, name string) (time.Duration, error) {
	t.Helper()
	return f.c.sync(context.Background(), "shop/"+name)
}

func (f *fixture) events(t *testing.T) []corev1.Event {
	t.Helper()
	list, err := f.client.CoreV1().Events("shop").List(context.Background(), metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return list.Items
}

func (f *fixture) actions(verb string) []k8stesting.Action {
	var out []k8stesting.Action
	for _, a := range f.client.Actions() {
		if a.GetVerb() == verb && a.GetResource().Resource == "pods" {
			out = append(out, a)
		}
	}
	return out
}

func TestSyncDeletesControllerOwnedPod(t *testing.T) {
	f := newFixture(t, DefaultFlags(), true, failedPod("web-1", rsOwner("web-7d9f")))
	if _, err := f.sync(t, "web-1"); err != nil {
		t.Fatal(err)
	}
	deletes := f.actions("delete")
	if len(deletes) != 1 {
		t.Fatalf("%d deletes, want 1", len(deletes))
	}
	pre := deletes[0].(k8stesting.DeleteActionImpl).DeleteOptions.Preconditions
	if pre == nil || pre.UID == nil || *pre.UID != "uid-web-1" {
		t.Errorf("delete preconditions %+v, want the pod's UID", pre)
	}
	evs := f.events(t)
	if len(evs) != 1 || evs[0].Reason != EventReason || evs[0].InvolvedObject.UID != "uid-web-1" || evs[0].Action != "Delete" ||
		!strings.Contains(evs[0].Message, "its ReplicaSet web-7d9f recreates it") {
		t.Errorf("events %+v", evs)
	}
	if value(f.c.metrics.PodsSeen) != 1 || value(f.c.metrics.PodsDeleted) != 1 {
		t.Errorf("seen %v deleted %v", value(f.c.metrics.PodsSeen), value(f.c.metrics.PodsDeleted))
	}
	// Seen again (the informer still shows it, or an update arrives): no second action or Event.
	if _, err := f.sync(t, "web-1"); err != nil {
		t.Fatal(err)
	}
	if len(f.actions("delete")) != 1 || len(f.events(t)) != 1 || value(f.c.metrics.PodsSeen) != 1 {
		t.Errorf("acted twice on one pod")
	}
}

func TestSyncAnnotatesBarePod(t *testing.T) {
	f := newFixture(t, DefaultFlags(), true, failedPod("debug", nil))
	if _, err := f.sync(t, "debug"); err != nil {
		t.Fatal(err)
	}
	if n := len(f.actions("delete")); n != 0 {
		t.Fatalf("deleted a bare pod (%d deletes)", n)
	}
	pod, _ := f.client.CoreV1().Pods("shop").Get(context.Background(), "debug", metav1.GetOptions{})
	if v := pod.Annotations[RecreateAnnotation]; !strings.Contains(v, "delete it and create it again") {
		t.Errorf("annotation %q", v)
	}
	evs := f.events(t)
	if len(evs) != 1 || evs[0].Action != "Annotate" || evs[0].Type != corev1.EventTypeWarning {
		t.Errorf("events %+v", evs)
	}
	if got := value(f.c.metrics.PodsSkipped.WithLabelValues(SkipNoController)); got != 1 {
		t.Errorf("skipped{no-controller} = %v", got)
	}
}

// A controller restarted after annotating a pod does not act or record an Event again.
func TestSyncAlreadyAnnotated(t *testing.T) {
	p := failedPod("debug", nil)
	p.Annotations[RecreateAnnotation] = "earlier"
	f := newFixture(t, DefaultFlags(), true, p)
	if _, err := f.sync(t, "debug"); err != nil {
		t.Fatal(err)
	}
	if len(f.actions("patch")) != 0 || len(f.events(t)) != 0 {
		t.Errorf("acted on an annotated pod: %v", f.client.Actions())
	}
	if got := value(f.c.metrics.PodsSkipped.WithLabelValues(SkipAlreadyAnnotated)); got != 1 {
		t.Errorf("skipped{already-annotated} = %v", got)
	}
}

func TestSyncWaitsForNodeReady(t *testing.T) {
	f := newFixture(t, DefaultFlags(), false, failedPod("web-1", rsOwner("web-7d9f")))
	retry, err := f.sync(t, "web-1")
	if err != nil || retry <= 0 {
		t.Fatalf("sync = %v, %v; want a retry later", retry, err)
	}
	if len(f.actions("delete")) != 0 || len(f.events(t)) != 0 {
		t.Error("acted before the node was ready")
	}
	if got := value(f.c.metrics.PodsDeferred.WithLabelValues(DeferNodeNotReady)); got != 1 {
		t.Errorf("deferred{node-not-ready} = %v", got)
	}

	// Without the requirement it acts at once.
	flags := DefaultFlags()
	flags.RequireCNIReady = false
	f = newFixture(t, flags, false, failedPod("web-1", rsOwner("web-7d9f")))
	if _, err := f.sync(t, "web-1"); err != nil || len(f.actions("delete")) != 1 {
		t.Errorf("sync = %v, deletes %d", err, len(f.actions("delete")))
	}
}

func TestSyncRateLimited(t *testing.T) {
	flags := DefaultFlags()
	flags.Rate, flags.Burst = 0.001, 2 // two now, then one every 1000s
	f := newFixture(t, flags, true, failedPod("a", rsOwner("rs")), failedPod("b", rsOwner("rs")), failedPod("c", rsOwner("rs")))
	var delays []time.Duration
	for _, name := range []string{"a", "b", "c"} {
		d, err := f.sync(t, name)
		if err != nil {
			t.Fatal(err)
		}
		delays = append(delays, d)
	}
	if n := len(f.actions("delete")); n != 2 {
		t.Errorf("%d deletes, want the burst of 2", n)
	}
	if delays[0] != 0 || delays[1] != 0 || delays[2] <= 0 {
		t.Errorf("delays %v, want the third put off", delays)
	}
	if got := value(f.c.metrics.PodsDeferred.WithLabelValues(DeferRateLimited)); got != 1 {
		t.Errorf("deferred{rate-limited} = %v", got)
	}
	if got := value(f.c.metrics.PodsSeen); got != 3 {
		t.Errorf("seen %v, want 3", got)
	}
}

func TestSyncErrors(t *testing.T) {
	f := newFixture(t, DefaultFlags(), true, failedPod("web-1", rsOwner("web-7d9f")), failedPod("web-2", rsOwner("web-7d9f")))
	failures := 1
	f.client.PrependReactor("delete", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if failures > 0 {
			failures--
			return true, nil, apierrors.NewInternalError(errors.New("etcd is sad"))
		}
		if a.(k8stesting.DeleteAction).GetName() == "web-2" {
			return true, nil, apierrors.NewConflict(schema.GroupResource{Resource: "pods"}, "web-2", errors.New("Precondition failed: UID in precondition"))
		}
		return false, nil, nil
	})
	if _, err := f.sync(t, "web-1"); err == nil || !strings.Contains(err.Error(), "delete pod shop/web-1") {
		t.Fatalf("sync = %v, want the delete error", err)
	}
	if got := value(f.c.metrics.Errors.WithLabelValues(ActionDelete)); got != 1 {
		t.Errorf("errors{delete} = %v", got)
	}
	// The retry succeeds; the pod is counted seen once.
	if _, err := f.sync(t, "web-1"); err != nil {
		t.Fatal(err)
	}
	if value(f.c.metrics.PodsDeleted) != 1 || value(f.c.metrics.PodsSeen) != 1 || len(f.events(t)) != 1 {
		t.Errorf("after retry: deleted %v seen %v events %d", value(f.c.metrics.PodsDeleted), value(f.c.metrics.PodsSeen), len(f.events(t)))
	}
	// Replaced under the same name (UID precondition fails): skipped, no Event.
	if _, err := f.sync(t, "web-2"); err != nil {
		t.Fatal(err)
	}
	if got := value(f.c.metrics.PodsSkipped.WithLabelValues(SkipGone)); got != 1 || len(f.events(t)) != 1 {
		t.Errorf("skipped{gone} = %v, events %d", got, len(f.events(t)))
	}
}

func TestHandler(t *testing.T) {
	f := newFixture(t, DefaultFlags(), true, failedPod("web-1", rsOwner("web-7d9f")))
	f.sync(t, "web-1")
	rec := httptest.NewRecorder()
	f.c.Handler(f.reg).ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	for _, want := range []string{"detour_repair_pods_seen_total 1", "detour_repair_pods_deleted_total 1", `detour_repair_pods_skipped_total{reason="no-controller"} 0`, `detour_repair_errors_total{action="delete"} 0`,
		`detour_repair_errors_total{action="save-backoff"} 0`} {
		if !strings.Contains(rec.Body.String(), want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	rec = httptest.NewRecorder()
	f.c.Handler(f.reg).ServeHTTP(rec, httptest.NewRequest("GET", "/readyz", nil))
	if rec.Code != 200 {
		t.Errorf("/readyz = %d", rec.Code)
	}
}

// Run feeds the queue from the informer: a pod that fails after the controller started is
// repaired without a direct call.
func TestRun(t *testing.T) {
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1", Labels: map[string]string{annotations.CNIReadyLabel: "true"}}})
	ctx := runController(t, newNodeController(t, client))
	pod := failedPod("web-1", rsOwner("web-7d9f"))
	if _, err := client.CoreV1().Pods("shop").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, err := client.CoreV1().Pods("shop").Get(ctx, "web-1", metav1.GetOptions{}); apierrors.IsNotFound(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the failed pod was not deleted")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// newNodeController returns a controller of node-1 on client with the default flags, logging
// nowhere.
func newNodeController(t *testing.T, client *fake.Clientset, modify ...func(*Flags)) *Controller {
	t.Helper()
	flags := DefaultFlags()
	flags.NodeName = "node-1"
	for _, m := range modify {
		m(&flags)
	}
	cfg, _ := flags.Parse()
	c, err := New(client, cfg, WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// runController runs c until the test ends, and returns the context it runs in.
func runController(t *testing.T, c *Controller) context.Context {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run = %v", err)
		}
	})
	return ctx
}

// Pods that failed together are repaired at once; a replacement that fails again waits for
// its owner's backoff, which doubles, and is per owner.
func TestSyncOwnerBackoff(t *testing.T) {
	other := rsOwner("api")
	other.UID = "rs-api"
	f := newFixture(t, DefaultFlags(), true, failedPod("a", rsOwner("web")), failedPod("b", rsOwner("web")), failedPod("x", other))
	t0 := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	now := t0
	f.c.now = func() time.Time { return now }
	// replace creates a failing pod of the web ReplicaSet after the fact, as its controller would.
	replace := func(name string) {
		t.Helper()
		p := failedPod(name, rsOwner("web"))
		if _, err := f.client.CoreV1().Pods("shop").Create(context.Background(), p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			if _, err := f.c.pods.Pods("shop").Get(name); err == nil {
				return
			} else if time.Now().After(deadline) {
				t.Fatalf("the cache did not see pod %s", name)
			}
		}
	}
	sync := func(name string, wantDeleted bool, wantWait time.Duration) {
		t.Helper()
		before := len(f.actions("delete"))
		wait, err := f.sync(t, name)
		if err != nil {
			t.Fatal(err)
		}
		if deleted := len(f.actions("delete")) > before; deleted != wantDeleted || wait != wantWait {
			t.Errorf("at %s, sync %s: deleted %v, wait %s; want %v, %s", now.Sub(t0), name, deleted, wait, wantDeleted, wantWait)
		}
	}
	sync("a", true, 0)
	replace("c")       // a's replacement
	sync("b", true, 0) // failed together with a: not a replacement
	now = t0.Add(2 * time.Second)
	sync("c", false, 28*time.Second)
	sync("x", true, 0) // another owner has no backoff
	now = t0.Add(31 * time.Second)
	sync("c", true, 0)
	replace("d")
	now = t0.Add(33 * time.Second)
	sync("d", false, 58*time.Second) // doubled
	if got := value(f.c.metrics.PodsDeferred.WithLabelValues(DeferOwnerBackoff)); got != 2 {
		t.Errorf("deferred{owner-backoff} = %v, want 2", got)
	}
	// Half an hour without a deletion: the owner starts again, and the pods it has then are
	// not replacements.
	now = t0.Add(time.Hour)
	sync("d", true, 0)
	replace("e")
	now = t0.Add(time.Hour + time.Second)
	sync("e", false, 29*time.Second) // from the base again
}

func owner(apiVersion, kind, name string) *metav1.OwnerReference {
	yes := true
	return &metav1.OwnerReference{APIVersion: apiVersion, Kind: kind, Name: name, UID: types.UID("uid-" + kind + "-" + name), Controller: &yes}
}

// Issue 15.6: only owners known to recreate a deleted pod get it deleted; the pods of owners
// that never recreate one (Argo Workflows, Tekton, Spark, KubeVirt) are annotated with what to
// do instead. The list is configurable. (A Job's pods: TestSyncJobPods.)
func TestSyncDeletesOnlyForRecreatingOwners(t *testing.T) {
	pods := map[string]*metav1.OwnerReference{
		"rs":       owner("apps/v1", "ReplicaSet", "web"),
		"sts":      owner("apps/v1", "StatefulSet", "db"),
		"ds":       owner("apps/v1", "DaemonSet", "agent"),
		"argo":     owner("argoproj.io/v1alpha1", "Workflow", "etl"),
		"tekton":   owner("tekton.dev/v1", "TaskRun", "build"),
		"kubevirt": owner("kubevirt.io/v1", "VirtualMachineInstance", "vm"),
		"fake-rs":  owner("example.com/v1", "ReplicaSet", "x"), // same kind, another group
	}
	for _, tc := range []struct {
		name    string
		owners  []string
		deleted []string
		skip    map[string]string // pod: metric reason
		message map[string]string // pod: part of the annotation
	}{
		{"defaults", DefaultRecreatingOwners, []string{"rs", "sts", "ds"},
			map[string]string{"argo": SkipOwnerNotRecreating, "tekton": SkipOwnerNotRecreating, "kubevirt": SkipOwnerNotRecreating, "fake-rs": SkipOwnerNotRecreating},
			map[string]string{"argo": "Its owner argoproj.io/Workflow etl is not known to recreate deleted pods"}},
		{"configured", []string{"apps/ReplicaSet", "argoproj.io/Workflow"}, []string{"rs", "argo"},
			map[string]string{"sts": SkipOwnerNotRecreating}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var objs []*corev1.Pod
			for name, o := range pods {
				objs = append(objs, failedPod(name, o))
			}
			flags := DefaultFlags()
			flags.RecreatingOwners, flags.Burst = tc.owners, 100
			f := newFixture(t, flags, true, objs...)
			for name := range pods {
				if _, err := f.sync(t, name); err != nil {
					t.Fatal(err)
				}
			}
			var deleted []string
			for _, a := range f.actions("delete") {
				deleted = append(deleted, a.(k8stesting.DeleteActionImpl).Name)
			}
			slices.Sort(deleted)
			want := slices.Sorted(slices.Values(tc.deleted))
			if !slices.Equal(deleted, want) {
				t.Errorf("deleted %v, want %v", deleted, want)
			}
			for name, reason := range tc.skip {
				pod, _ := f.client.CoreV1().Pods("shop").Get(context.Background(), name, metav1.GetOptions{})
				if pod == nil || pod.Annotations[RecreateAnnotation] == "" {
					t.Errorf("%s: not annotated", name)
					continue
				}
				if m := tc.message[name]; m != "" && !strings.Contains(pod.Annotations[RecreateAnnotation], m) {
					t.Errorf("%s: annotation %q lacks %q", name, pod.Annotations[RecreateAnnotation], m)
				}
				if value(f.c.metrics.PodsSkipped.WithLabelValues(reason)) == 0 {
					t.Errorf("%s: skipped{%s} not counted", name, reason)
				}
			}
		})
	}
}

// Issue 15.6: the owner backoff survives the controller's restart (it is saved on the node).
func TestOwnerBackoffSurvivesRestart(t *testing.T) {
	f := newFixture(t, DefaultFlags(), true, failedPod("a", rsOwner("web")), failedPod("b", rsOwner("web")))
	t0 := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	now := t0
	f.c.now = func() time.Time { return now }
	if _, err := f.sync(t, "a"); err != nil || len(f.actions("delete")) != 1 {
		t.Fatalf("first deletion: %v, %v", err, f.actions("delete"))
	}
	// The replacement fails too; the controller restarts before it comes to it.
	if _, err := f.client.CoreV1().Pods("shop").Create(context.Background(), failedPod("c", rsOwner("web")), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	flags := DefaultFlags()
	flags.NodeName = "node-1"
	cfg, err := flags.Parse()
	if err != nil {
		t.Fatal(err)
	}
	c, err := New(f.client, cfg, WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))), WithMetrics(NewMetrics(prometheus.NewRegistry())))
	if err != nil {
		t.Fatal(err)
	}
	c.now = func() time.Time { return now }
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	c.factory.Start(ctx.Done())
	cache.WaitForCacheSync(ctx.Done(), c.synced)
	c.loadBackoff(ctx)

	now = t0.Add(2 * time.Second)
	before := len(f.actions("delete"))
	wait, err := c.sync(ctx, "shop/c")
	if err != nil || wait != 28*time.Second || len(f.actions("delete")) != before {
		t.Errorf("restarted controller on the replacement: wait %s, %v, deleted %v; want the saved backoff (28s)", wait, err, len(f.actions("delete")) > before)
	}
	// b failed together with a (known when a was deleted): no backoff after the restart either.
	if wait, err := c.sync(ctx, "shop/b"); err != nil || wait != 0 || len(f.actions("delete")) != before+1 {
		t.Errorf("sibling b: wait %s, %v", wait, err)
	}
	node, _ := f.client.CoreV1().Nodes().Get(ctx, "node-1", metav1.GetOptions{})
	if !strings.Contains(node.Annotations[BackoffAnnotation], `"rs-uid"`) {
		t.Errorf("node annotation %q", node.Annotations[BackoffAnnotation])
	}
}

// Issue 15.4: after a reboot the ready label is stale until the node agent has put detour's
// entry back; the repair controller tells by the boot ID the label was set for.
func TestSyncWaitsForThisBootsReadiness(t *testing.T) {
	f := newFixture(t, DefaultFlags(), true, failedPod("web-1", rsOwner("web-7d9f")))
	node, _ := f.client.CoreV1().Nodes().Get(context.Background(), "node-1", metav1.GetOptions{})
	node.Annotations = map[string]string{annotations.CNIReadyBootAnnotation: "boot-1"}
	node.Status.NodeInfo.BootID = "boot-2" // rebooted; the agent has not marked this boot yet
	if _, err := f.client.CoreV1().Nodes().Update(context.Background(), node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	f.c.now = func() time.Time { return now }
	if retry, err := f.sync(t, "web-1"); err != nil || retry <= 0 || len(f.actions("delete")) != 0 {
		t.Fatalf("sync on a stale label = %v, %v, %d deletes; want a retry later", retry, err, len(f.actions("delete")))
	}
	node.Annotations[annotations.CNIReadyBootAnnotation] = "boot-2"
	if _, err := f.client.CoreV1().Nodes().Update(context.Background(), node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	now = now.Add(nodeCheckInterval)
	if _, err := f.sync(t, "web-1"); err != nil || len(f.actions("delete")) != 1 {
		t.Fatalf("sync once this boot is marked = %v, %d deletes", err, len(f.actions("delete")))
	}
}

// detour_repair_pods counts the node's pods by state, from the caches: injected, caught
// (injected, no redirect; issue 32.5: also while the check runs again, so that a pod in
// Init:CrashLoopBackOff stays caught through its retries), and uninjected though opted in (by
// the pod or its namespace, read as the webhook reads them, or, with the webhook's defaultInject
// enabled, by neither saying otherwise).
func TestPodStates(t *testing.T) {
	for _, tc := range []struct {
		defaultInject string
		uninjected    float64
	}{
		{"disabled", 4}, // missed, own-opt-in, spaced, in-padded
		{"enabled", 5},  // and plain, whose namespace says nothing
	} {
		t.Run("defaultInject "+tc.defaultInject, func(t *testing.T) {
			testPodStates(t, tc.defaultInject, tc.uninjected)
		})
	}
}

func testPodStates(t *testing.T, defaultInject string, uninjected float64) {
	pod := func(name, ns string, annots map[string]string, mutate ...func(*corev1.Pod)) *corev1.Pod {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, UID: types.UID("uid-" + name), Annotations: annots},
			Spec: corev1.PodSpec{NodeName: "node-1"}, Status: corev1.PodStatus{Phase: corev1.PodRunning}}
		for _, m := range mutate {
			m(p)
		}
		return p
	}
	enabled := map[string]string{annotations.Inject: "enabled"}
	disabled := map[string]string{annotations.Inject: "disabled"}
	objs := []runtime.Object{
		&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}}, // not ready: nothing is repaired
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Annotations: enabled}},
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "plain"}},
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "off", Annotations: disabled}},
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "kube-public"}},
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "detour-system"}},
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "padded", Annotations: map[string]string{annotations.Inject: " enabled"}}},
		pod("meshed", "shop", injected),
		failedPod("caught", nil),
		// The check runs again after it found no redirect: still caught.
		retrying(failedPod("retrying", nil)),
		retrying(foldedPod("proxy-retrying")),
		// The proxy started after its check failed once: it passed, not caught.
		healed(foldedPod("healed")),
		pod("spaced", "plain", map[string]string{annotations.Inject: "enabled\n"}),
		pod("in-padded", "padded", nil),
		pod("missed", "shop", nil),
		pod("opted-out", "shop", disabled),
		pod("own-opt-in", "plain", enabled),
		pod("plain", "plain", nil),
		pod("off", "off", nil),
		pod("host", "shop", nil, func(p *corev1.Pod) { p.Spec.HostNetwork = true }),
		pod("done", "shop", nil, func(p *corev1.Pod) { p.Status.Phase = corev1.PodSucceeded }),
		// Pods the webhook never injects, whatever they ask for.
		pod("mirror", "shop", map[string]string{corev1.MirrorPodAnnotationKey: "x"}),
		pod("system", "kube-system", enabled),
		pod("public", "kube-public", nil), // excluded (the webhook's default excludeNamespaces)
		pod("own", "detour-system", nil),  // detour's own namespace (--namespace)
		pod("ours", "shop", nil, func(p *corev1.Pod) { p.Labels = map[string]string{"app.kubernetes.io/part-of": "detour"} }),
	}
	c := newNodeController(t, fake.NewClientset(objs...), func(f *Flags) { f.DefaultInject, f.OwnNamespace = defaultInject, "detour-system" })
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c.Collector())
	if families, err := reg.Gather(); err != nil || len(families) != 0 {
		t.Fatalf("before the caches synced: %v, %v; want nothing", families, err)
	}
	runController(t, c)
	want := map[string]float64{StateInjected: 5, StateCaught: 3, StateUninjected: uninjected}
	deadline := time.Now().Add(20 * time.Second)
	for {
		got := map[string]float64{}
		families, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range families {
			for _, m := range f.GetMetric() {
				got[m.GetLabel()[0].GetValue()] = m.GetGauge().GetValue()
			}
		}
		if len(got) > 0 {
			for state, n := range want {
				if got[state] != n {
					t.Errorf("detour_repair_pods{state=%q} = %v, want %v", state, got[state], n)
				}
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the caches did not sync")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// add creates pod in the fake API, as its controller would, and waits until the controller's
// cache holds it.
func (f *fixture) add(t *testing.T, pod *corev1.Pod) {
	t.Helper()
	if _, err := f.client.CoreV1().Pods(pod.Namespace).Create(context.Background(), pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := f.c.pods.Pods(pod.Namespace).Get(pod.Name); err == nil {
			return
		} else if time.Now().After(deadline) {
			t.Fatalf("the cache did not see pod %s", pod.Name)
		}
	}
}

// jobPod is a pod of Job job whose check found no redirect, with restartPolicy policy; its
// check runs at the proxy's start when foldedCheck is set, else in the validator init container.
func jobPod(name, job string, policy corev1.RestartPolicy, foldedCheck bool) *corev1.Pod {
	p := failedPod(name, owner("batch/v1", "Job", job))
	p.Spec.RestartPolicy = policy
	if foldedCheck {
		folded(noRedirect)(p)
	}
	return p
}

// Issue 32.2: a Job's pod whose check runs again in its sandbox, where it cannot pass, is
// deleted so that its Job replaces it: at the proxy's start the kubelet restarts the check for
// ever (a restartPolicy Never pod never fails, and its Job, or a CronJob's next run under
// concurrencyPolicy Forbid, waits for good); under OnFailure every restart counts against the
// Job's backoffLimit. A Never pod whose validator init container failed is failed by the
// kubelet and replaced by its Job: repair leaves it alone.
func TestSyncJobPods(t *testing.T) {
	for _, tc := range []struct {
		name    string
		policy  corev1.RestartPolicy
		folded  bool
		deleted bool
	}{
		{"the proxy's check, restartPolicy Never", corev1.RestartPolicyNever, true, true},
		{"the proxy's check, restartPolicy OnFailure", corev1.RestartPolicyOnFailure, true, true},
		{"the validator, restartPolicy OnFailure", corev1.RestartPolicyOnFailure, false, true},
		{"the validator, restartPolicy Never", corev1.RestartPolicyNever, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, DefaultFlags(), true, jobPod("report-x1", "report", tc.policy, tc.folded))
			if _, err := f.sync(t, "report-x1"); err != nil {
				t.Fatal(err)
			}
			if n := len(f.actions("patch")); n != 0 {
				t.Errorf("annotated a Job's pod (%d patches)", n)
			}
			deletes, evs := f.actions("delete"), f.events(t)
			if !tc.deleted {
				if len(deletes) != 0 || len(evs) != 0 {
					t.Errorf("%d deletes, events %+v; want none: the kubelet fails the pod and its Job replaces it", len(deletes), evs)
				}
				if got := value(f.c.metrics.PodsSkipped.WithLabelValues(SkipJob)); got != 1 {
					t.Errorf("skipped{job} = %v, want 1", got)
				}
				return
			}
			if len(deletes) != 1 {
				t.Fatalf("%d deletes, want 1", len(deletes))
			}
			if pre := deletes[0].(k8stesting.DeleteActionImpl).DeleteOptions.Preconditions; pre == nil || pre.UID == nil || *pre.UID != "uid-report-x1" {
				t.Errorf("delete preconditions %+v, want the pod's UID", pre)
			}
			if len(evs) != 1 || evs[0].Action != "Delete" || evs[0].Reason != EventReason ||
				!strings.Contains(evs[0].Message, "Deleted the pod so that its Job report replaces it") || !strings.Contains(evs[0].Message, "backoffLimit") {
				t.Errorf("events %+v", evs)
			}
			if value(f.c.metrics.PodsDeleted) != 1 {
				t.Errorf("deleted %v, want 1", value(f.c.metrics.PodsDeleted))
			}
		})
	}
}

// A Job's pods are deleted under the safeguards of every deletion: not before the node is
// ready, and a replacement that fails the same way waits for its Job's backoff.
func TestSyncJobPodSafeguards(t *testing.T) {
	f := newFixture(t, DefaultFlags(), false, jobPod("report-a", "report", corev1.RestartPolicyNever, true))
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	f.c.now = func() time.Time { return now }
	if retry, err := f.sync(t, "report-a"); err != nil || retry <= 0 || len(f.actions("delete")) != 0 {
		t.Fatalf("sync before the node is ready = %v, %v, %d deletes; want a retry later", retry, err, len(f.actions("delete")))
	}
	node, err := f.client.CoreV1().Nodes().Get(context.Background(), "node-1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	node.Labels[annotations.CNIReadyLabel] = "true"
	if _, err := f.client.CoreV1().Nodes().Update(context.Background(), node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	now = now.Add(nodeCheckInterval)
	if _, err := f.sync(t, "report-a"); err != nil || len(f.actions("delete")) != 1 {
		t.Fatalf("sync once the node is ready = %v, %d deletes; want 1", err, len(f.actions("delete")))
	}
	// The Job's replacement fails too: the node is not fixed after all.
	f.add(t, jobPod("report-b", "report", corev1.RestartPolicyNever, true))
	now = now.Add(2 * time.Second)
	if wait, err := f.sync(t, "report-b"); err != nil || wait != ownerBackoffBase-2*time.Second || len(f.actions("delete")) != 1 {
		t.Errorf("sync of the failing replacement = %s, %v, %d deletes; want the owner's backoff (%s)", wait, err, len(f.actions("delete")), ownerBackoffBase-2*time.Second)
	}
	if got := value(f.c.metrics.PodsDeferred.WithLabelValues(DeferOwnerBackoff)); got != 1 {
		t.Errorf("deferred{owner-backoff} = %v, want 1", got)
	}
}
