package e2e

import (
	"context"
	"fmt"
	"os"
	"slices"
	"testing"
	"text/tabwriter"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"
)

// BenchmarkPodStartLatency measures, on the real node, how long a pod takes from its
// creation to Ready — an init container that dials out, an app, and the test proxy — with
// detour (an opted-in namespace: the webhook injects the validator and the proxy, detour-cni
// installs the redirect) and without (a namespace that is not opted in, the same proxy added
// as a plain container). The two kinds alternate, one pod at a time, so that both see the same
// machine. It prints p50 and p99 of each (make bench-e2e; docs/benchmarks.md).
func BenchmarkPodStartLatency(b *testing.B) {
	e := setUp(b)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	e.ensureInstalled(b, ctx)
	n := 30
	if v := os.Getenv("DETOUR_E2E_BENCH_PODS"); v != "" {
		fmt.Sscan(v, &n)
	}
	e.namespace(b, ctx, "bench-detour", true)
	e.namespace(b, ctx, "bench-plain", false)
	var with, without []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		with, without = with[:0], without[:0]
		for j := 0; j < n; j++ {
			d, err := e.podStart(ctx, "bench-detour", fmt.Sprintf("p%d-%d", i, j), false)
			if err != nil {
				b.Fatal(err)
			}
			with = append(with, d)
			d, err = e.podStart(ctx, "bench-plain", fmt.Sprintf("p%d-%d", i, j), true)
			if err != nil {
				b.Fatal(err)
			}
			without = append(without, d)
		}
	}
	b.StopTimer()
	p50w, p99w := percentiles(with)
	p50o, p99o := percentiles(without)
	b.ReportMetric(float64(p50w.Milliseconds()), "p50-detour-ms")
	b.ReportMetric(float64(p50o.Milliseconds()), "p50-plain-ms")
	b.ReportMetric(float64((p50w - p50o).Milliseconds()), "p50-added-ms")
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "\npods (creation → Ready, %d each)\tp50\tp99\n", n)
	fmt.Fprintf(tw, "with detour (injected, rules by detour-cni)\t%s\t%s\n", p50w.Round(time.Millisecond), p99w.Round(time.Millisecond))
	fmt.Fprintf(tw, "without detour (same proxy, not injected)\t%s\t%s\n", p50o.Round(time.Millisecond), p99o.Round(time.Millisecond))
	fmt.Fprintf(tw, "added by detour\t%s\t%s\n", (p50w - p50o).Round(time.Millisecond), (p99w - p99o).Round(time.Millisecond))
	tw.Flush()
}

// podStart creates one pod and returns the time from the create call to the watch event
// that shows it Ready; the pod is deleted afterwards. plain adds the test proxy by hand.
func (e *env) podStart(ctx context.Context, ns, name string, plain bool) (time.Duration, error) {
	pod := e.pod(name, ns)
	if plain {
		pod.Spec.Containers = append(pod.Spec.Containers, corev1.Container{
			Name: "proxy", Image: e.art.refs.Proxy, ImagePullPolicy: corev1.PullNever,
		})
	}
	pods := e.node.Client.CoreV1().Pods(ns)
	w, err := pods.Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + name})
	if err != nil {
		return 0, err
	}
	defer w.Stop()
	start := time.Now()
	if _, err := pods.Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		return 0, err
	}
	defer pods.Delete(context.Background(), name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
	timeout := time.After(2 * time.Minute)
	for {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				return 0, fmt.Errorf("the watch of pod %s/%s ended", ns, name)
			}
			if p, isPod := ev.Object.(*corev1.Pod); isPod && ev.Type != watch.Deleted && podReady(p) {
				return time.Since(start), nil
			}
		case <-timeout:
			return 0, fmt.Errorf("pod %s/%s not Ready within 2 minutes:\n%s", ns, name, e.describe(ctx, ns))
		}
	}
}

func percentiles(d []time.Duration) (p50, p99 time.Duration) {
	if len(d) == 0 {
		return 0, 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2], s[(len(s)*99+99)/100-1]
}
