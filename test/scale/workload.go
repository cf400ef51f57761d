package scale

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"
	"golang.org/x/time/rate"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/annotations"
)

// Admission is what the creation of the workload's pods measured.
type Admission struct {
	Pods int
	// P50 and P99 are the latency of a pod's creation as its client saw it: the API server's
	// work with detour's webhook called on the way.
	P50, P99 time.Duration
	// Rate is the pods created per second.
	Rate float64
	// WebhookP50 and WebhookP99 are the webhook's own time per admission (its
	// detour_webhook_admission_duration_seconds over the workload, both replicas).
	WebhookP50, WebhookP99 time.Duration
	// Uninjected are the pods that came back without detour's proxy.
	Uninjected int
}

// CreateWorkload creates perNode pods on every one of nodes nodes, at most perSecond per
// second, in namespaces that opt in to injection (one per 10 nodes), each pod bound to its node
// as the scheduler would bind it; KWOK runs them.
func (c *Cluster) CreateWorkload(ctx context.Context, wh *Webhook, nodes, perNode int, perSecond float64) (*Admission, error) {
	before, err := wh.admissions()
	if err != nil {
		return nil, err
	}
	namespaces := (nodes + 9) / 10
	for i := range namespaces {
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("workload-%d", i),
			Annotations: map[string]string{annotations.Inject: string(annotations.InjectEnabled)}}}
		if _, err := c.Client.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{}); err != nil {
			return nil, err
		}
	}
	limit := rate.NewLimiter(rate.Limit(perSecond), 1)
	var mu sync.Mutex
	var latencies []time.Duration
	uninjected := 0
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(32)
	start := time.Now()
	for i := range nodes * perNode {
		if err := limit.Wait(ctx); err != nil {
			return nil, err
		}
		node := i % nodes
		g.Go(func() error {
			pod := &corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("app-%d", i), Namespace: fmt.Sprintf("workload-%d", node/10),
					Labels: map[string]string{"app": "scale"}},
				Spec: corev1.PodSpec{
					NodeName:   NodeName(node),
					Containers: []corev1.Container{{Name: "app", Image: "scale.invalid/app:0", Ports: []corev1.ContainerPort{{ContainerPort: 8080}}}},
				},
			}
			t := time.Now()
			created, err := c.Client.CoreV1().Pods(pod.Namespace).Create(gctx, pod, metav1.CreateOptions{})
			if err != nil {
				return fmt.Errorf("create pod %s/%s: %w", pod.Namespace, pod.Name, err)
			}
			d := time.Since(t)
			mu.Lock()
			defer mu.Unlock()
			latencies = append(latencies, d)
			if !annotations.IsInjected(created.Annotations) {
				uninjected++
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	rate := float64(len(latencies)) / time.Since(start).Seconds()
	after, err := wh.admissions()
	if err != nil {
		return nil, err
	}
	slices.Sort(latencies)
	n := len(latencies)
	a := &Admission{Pods: n, P50: latencies[n/2], P99: latencies[min(n-1, n*99/100)], Rate: rate, Uninjected: uninjected}
	h := after.since(before)
	if a.WebhookP50, err = h.quantile(0.5); err != nil {
		return nil, err
	}
	if a.WebhookP99, err = h.quantile(0.99); err != nil {
		return nil, err
	}
	return a, nil
}
