package repair

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"

	"github.com/detourmesh/detour/annotations"
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

func owner(apiVersion, kind, name string) *metav1.OwnerReference {
	yes := true
	return &metav1.OwnerReference{APIVersion: apiVersion, Kind: kind, Name: name, UID: types.UID("uid-" + kind + "-" + name), Controller: &yes}
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

// value reads a counter.
func value(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		panic(err)
	}
	return m.GetCounter().GetValue()
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

// newNodeController returns a controller of node-1 on client with the default flags, logging
// nowhere.
func newNodeController(t *testing.T, client kubernetes.Interface, modify ...func(*Flags)) *Controller {
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
