package upstream

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/detourmesh/detour/annotations"
)

// Pod is what the Recorder keeps of a pod the tests created.
type Pod struct {
	Namespace, Name string
	HostNetwork     bool
	// Injected: detour's webhook injected it (its annotations say so).
	Injected bool
	// IP is its pod IP, once it had one.
	IP string
}

// Service is what the Recorder keeps of a Service the tests created.
type Service struct {
	Namespace, Name, ClusterIP string
}

// Recorder keeps every pod created, while it runs, in a namespace that did not exist when it
// started — the namespaces the e2e framework generates for each test — as the API server
// shows it when it is created: the namespaces, and their pods, are deleted when each test
// ends, so the count is taken as they come.
type Recorder struct {
	mu     sync.Mutex
	before map[string]bool
	pods   map[string]Pod // by UID
	svcs   map[string]Service
	stop   chan struct{}
}

// Record starts a Recorder; Stop ends it.
func Record(ctx context.Context, client kubernetes.Interface) (*Recorder, error) {
	nss, err := client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list the namespaces there before the tests: %w", err)
	}
	r := &Recorder{before: map[string]bool{}, pods: map[string]Pod{}, svcs: map[string]Service{}, stop: make(chan struct{})}
	for _, ns := range nss.Items {
		r.before[ns.Name] = true
	}
	factory := informers.NewSharedInformerFactory(client, 0)
	inf := factory.Core().V1().Pods().Informer()
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: r.add, UpdateFunc: func(_, obj any) { r.update(obj) }}); err != nil {
		return nil, err
	}
	svcs := factory.Core().V1().Services().Informer()
	if _, err := svcs.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: r.addService}); err != nil {
		return nil, err
	}
	factory.Start(r.stop)
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced, svcs.HasSynced) {
		close(r.stop)
		return nil, fmt.Errorf("the pod and Service informers did not sync: %w", ctx.Err())
	}
	return r, nil
}

// update records the pod's IP once it has one.
func (r *Recorder) update(obj any) {
	p, ok := obj.(*corev1.Pod)
	if !ok || p.Status.PodIP == "" {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if rec, ok := r.pods[string(p.UID)]; ok && rec.IP == "" {
		rec.IP = p.Status.PodIP
		r.pods[string(p.UID)] = rec
	}
}

func (r *Recorder) addService(obj any) {
	s, ok := obj.(*corev1.Service)
	if !ok {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.before[s.Namespace] {
		return
	}
	r.svcs[string(s.UID)] = Service{Namespace: s.Namespace, Name: s.Name, ClusterIP: s.Spec.ClusterIP}
}

// Services returns the Services recorded so far.
func (r *Recorder) Services() []Service {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]Service, 0, len(r.svcs))
	for _, s := range r.svcs {
		out = append(out, s)
	}
	slices.SortFunc(out, func(a, b Service) int { return strings.Compare(a.Namespace+"/"+a.Name, b.Namespace+"/"+b.Name) })
	return out
}

func (r *Recorder) add(obj any) {
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.before[p.Namespace] {
		return
	}
	r.pods[string(p.UID)] = Pod{
		Namespace: p.Namespace, Name: p.Name, HostNetwork: p.Spec.HostNetwork,
		Injected: annotations.IsInjected(p.Annotations), IP: p.Status.PodIP,
	}
}

// Stop ends the recording.
func (r *Recorder) Stop() { close(r.stop) }

// Pods returns the pods recorded so far, by namespace and name.
func (r *Recorder) Pods() []Pod {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]Pod, 0, len(r.pods))
	for _, p := range r.pods {
		out = append(out, p)
	}
	slices.SortFunc(out, func(a, b Pod) int {
		if a.Namespace != b.Namespace {
			return strings.Compare(a.Namespace, b.Namespace)
		}
		return strings.Compare(a.Name, b.Name)
	})
	return out
}

// Injection counts pods: the injected among those on the pod network (host-network pods are
// never injected), and those on the host network.
type Injection struct {
	Injected, PodNetwork, HostNetwork int
	// Missed are the pod-network pods not injected (namespace/name).
	Missed []string
}

// Count counts pods.
func Count(pods []Pod) Injection {
	var c Injection
	for _, p := range pods {
		switch {
		case p.HostNetwork:
			c.HostNetwork++
		case p.Injected:
			c.Injected++
			c.PodNetwork++
		default:
			c.PodNetwork++
			c.Missed = append(c.Missed, p.Namespace+"/"+p.Name)
		}
	}
	return c
}

// Fraction is the injected share of the pod-network pods (1 when there are none).
func (c Injection) Fraction() float64 {
	if c.PodNetwork == 0 {
		return 1
	}
	return float64(c.Injected) / float64(c.PodNetwork)
}
