package e2e

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"text/tabwriter"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/utils/ptr"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/test/e2e/framework"
)

// BenchmarkPodStartLatency measures, on the real node, how long a pod takes from its creation
// to Ready — an init container that dials out, an app, and the test proxy with its startup probe
// (period 1 s) — in six forms, one pod of each in turn so that all see the same machine, each
// created after a random pause of up to a second:
//
//  1. no detour, the proxy a native sidecar (the mesh without detour: the baseline);
//  2. detour with the validator init container (what CNI-mode meshes pay today);
//  3. detour with the check at the proxy's start (validator.mode image-volume), the startup
//     probe the start gate (detour.dev/proxy-start-gate: probe);
//  4. no detour, the proxy a regular container (for reference);
//  5. detour with the check at the proxy's start and detour's postStart hook the start gate
//     (detour.dev/proxy-start-gate: hook);
//  6. no detour, the proxy a native sidecar without a startup probe: nothing holds the next
//     container once the proxy's process runs (not fail-closed; the kubelet's floor).
//
// It prints p50 and p99 of each and the differences to the baseline (make bench-e2e;
// docs/benchmarks.md).
func BenchmarkPodStartLatency(b *testing.B) {
	e := framework.SetUp(b)
	ctx, cancel := framework.Context(b, e.Node, 40*time.Minute)
	defer cancel()
	e.EnsureInstalled(b, ctx)
	n := 30
	if v := os.Getenv("DETOUR_E2E_BENCH_PODS"); v != "" {
		fmt.Sscan(v, &n)
	}
	rows := []struct {
		name, ns string
		plain    func(*corev1.Pod) // adds the proxy by hand; nil: detour injects it
		took     []time.Duration
		times    []*podTimes
	}{
		{name: "1. no detour, the proxy a native sidecar (baseline)", ns: "bench-plain", plain: func(p *corev1.Pod) { nativeProxy(e, p) }},
		{name: "2. detour, the validator init container", ns: "bench-init"},
		{name: "3. detour, the check at the proxy's start, probe gate", ns: "bench-fold"},
		{name: "4. no detour, the proxy a regular container", ns: "bench-plain", plain: func(p *corev1.Pod) { regularProxy(e, p) }},
		{name: "5. detour, the check at the proxy's start, hook gate", ns: "bench-hook"},
		{name: "6. no detour, native sidecar without a startup probe (floor)", ns: "bench-plain", plain: func(p *corev1.Pod) { ungatedProxy(e, p) }},
	}
	e.Namespace(b, ctx, "bench-plain", false)
	for ns, ann := range map[string]string{
		"bench-init": annotations.ValidatorMode + `":"init-container`,
		"bench-fold": annotations.ProxyStartGate + `":"probe`,
		"bench-hook": annotations.ProxyStartGate + `":"hook`,
	} {
		e.Namespace(b, ctx, ns, true)
		if _, err := e.Node.Client.CoreV1().Namespaces().Patch(ctx, ns, "application/merge-patch+json",
			[]byte(`{"metadata":{"annotations":{"`+ann+`"}}}`), metav1.PatchOptions{}); err != nil {
			b.Fatal(err)
		}
	}
	load0 := loadAverage()
	times := map[string]*podTimes{}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j := 0; j < n; j++ {
			for k := range rows {
				name := fmt.Sprintf("p%d-%d-%d", i, j, k)
				t, err := podStart(ctx, e, rows[k].ns, name, rows[k].plain)
				if err != nil {
					b.Fatal(err)
				}
				rows[k].took = append(rows[k].took, t.ready.Sub(t.created))
				times[rows[k].ns+"/"+name], rows[k].times = t, append(rows[k].times, t)
			}
		}
	}
	b.StopTimer()
	base, _ := percentiles(rows[0].took)
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "\npods (creation → Ready, %d each, alternating)\tp50\tp99\tp50 − row 1\n", n)
	for _, r := range rows {
		p50, p99 := percentiles(r.took)
		fmt.Fprintf(tw, "%s\t%s\t%s\t%+dms\n", r.name, p50.Round(time.Millisecond), p99.Round(time.Millisecond), (p50 - base).Milliseconds())
		b.ReportMetric(float64(p50.Milliseconds()), "p50-row"+r.name[:1]+"-ms")
	}
	tw.Flush()
	fmt.Printf("load average (1, 5, 15 min) at the start: %s; at the end: %s\n", load0, loadAverage())
	if err := readPodTimes(filepath.Join(e.Node.Dir, "logs"), times); err != nil {
		b.Logf("no breakdown: %v", err)
		return
	}
	names := make([]string, len(rows))
	perRow := make([][]*podTimes, len(rows))
	for k, r := range rows {
		names[k], perRow[k] = r.name, r.times
	}
	printBreakdown(os.Stdout, names, perRow)
}

// nativeProxy and regularProxy add the test proxy by hand, as the webhook would add it (same
// image, command, user and startup probe) but without detour: a native sidecar, or a regular
// container.
func nativeProxy(e *framework.Env, p *corev1.Pod) {
	c := plainProxy(e)
	c.RestartPolicy = ptr.To(corev1.ContainerRestartPolicyAlways)
	p.Spec.InitContainers = append([]corev1.Container{c}, p.Spec.InitContainers...)
}

func regularProxy(e *framework.Env, p *corev1.Pod) {
	p.Spec.Containers = append(p.Spec.Containers, plainProxy(e))
}

// ungatedProxy is nativeProxy without the startup probe: the kubelet starts the next container
// as soon as the proxy's process runs.
func ungatedProxy(e *framework.Env, p *corev1.Pod) {
	nativeProxy(e, p)
	p.Spec.InitContainers[0].StartupProbe = nil
}

func plainProxy(e *framework.Env) corev1.Container {
	return corev1.Container{
		Name: "proxy", Image: e.Artifacts.Refs.Proxy, ImagePullPolicy: corev1.PullNever, Command: []string{"testproxy"},
		SecurityContext: &corev1.SecurityContext{RunAsUser: ptr.To[int64](2102)},
		StartupProbe: &corev1.Probe{
			ProbeHandler:  corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(4191)}},
			PeriodSeconds: 1, FailureThreshold: 30,
		},
	}
}

// podStart creates one pod (plain adds the proxy by hand, else the webhook injects it) and
// returns the moments of the create call and of the watch event that shows it Ready; the pod
// is deleted afterwards.
func podStart(ctx context.Context, e *framework.Env, ns, name string, plain func(*corev1.Pod)) (*podTimes, error) {
	pod := e.Pod(name, ns)
	// The app's readiness probe reaches the app in every row with no annotation: since
	// detour.dev/redirect-inbound: listening (issue 33) the redirect sends the kubelet's TCP
	// probe to the proxy only once the app listens, so the rows with detour no longer need the
	// app's port skipped to be comparable (before, the proxy answered the probe at once).
	if plain != nil {
		plain(pod)
	}
	// A random pause of up to a second first: the kubelet's steps fall on its once-a-second
	// relist, and without it the order of the rows would fix the phase each row meets it at
	// (medians moved by up to a second between runs with different rows).
	time.Sleep(rand.N(time.Second))
	pods := e.Node.Client.CoreV1().Pods(ns)
	w, err := pods.Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + name})
	if err != nil {
		return nil, err
	}
	defer w.Stop()
	start := time.Now()
	if _, err := pods.Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		return nil, err
	}
	defer pods.Delete(context.Background(), name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
	timeout := time.After(2 * time.Minute)
	for {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				return nil, fmt.Errorf("the watch of pod %s/%s ended", ns, name)
			}
			if p, isPod := ev.Object.(*corev1.Pod); isPod && ev.Type != watch.Deleted && framework.PodReady(p) {
				return &podTimes{created: start, ready: time.Now()}, nil
			}
		case <-timeout:
			return nil, fmt.Errorf("pod %s/%s not Ready within 2 minutes:\n%s", ns, name, e.Describe(ctx, ns))
		}
	}
}

// loadAverage is the machine's load average over 1, 5 and 15 minutes, as uptime shows it.
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown (" + err.Error() + ")"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}

func percentiles(d []time.Duration) (p50, p99 time.Duration) {
	if len(d) == 0 {
		return 0, 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2], s[(len(s)*99+99)/100-1]
}

// BenchmarkNodeJoin measures, on the cluster, how long a node that joins takes to run a pod
// that waits for it: from the moment it begins to join (its namespaces, containerd and kubelet
// start) to the pod Ready, over DETOUR_E2E_BENCH_JOINS joins (default 5) of each form,
// alternating — with detour (the node registers with the startup taint and the agent's label,
// and the pod is injected) and without (no taint, no agent, the same pod uninjected). Every
// image comes from the cluster's registry, which the new node has never pulled from (make
// bench-e2e; docs/benchmarks.md).
func BenchmarkNodeJoin(b *testing.B) {
	e := framework.SetUp(b)
	ctx, cancel := framework.Context(b, e.Node, 40*time.Minute)
	defer cancel()
	e.EnsureInstalled(b, ctx)
	e.UseRegistry(b, ctx)
	defer e.UseImported(b, ctx)
	e.Cordon(b, ctx, e.Node.Name)
	defer e.Uncordon(b, ctx, e.Node.Name)
	n := 5
	if v := os.Getenv("DETOUR_E2E_BENCH_JOINS"); v != "" {
		fmt.Sscan(v, &n)
	}
	rows := []struct {
		name, ns string
		detour   bool
		took     []time.Duration
	}{
		{name: "with detour (startup taint, agent, injected pod)", ns: "join-detour", detour: true},
		{name: "without detour (plain pod)", ns: "join-plain"},
	}
	e.Namespace(b, ctx, "join-detour", true)
	e.Namespace(b, ctx, "join-plain", false)
	b.ResetTimer()
	for i := 0; i < b.N*n; i++ {
		for k := range rows {
			r := &rows[k]
			name := fmt.Sprintf("join-%d-%d", k, i)
			if _, err := e.Node.Client.CoreV1().Pods(r.ns).Create(ctx, framework.OnNode(e.Pod("p", r.ns), name), metav1.CreateOptions{}); err != nil {
				b.Fatal(err)
			}
			var opts framework.Options
			if r.detour {
				opts.Taints, opts.Labels = []string{framework.StartupTaint + ":NoSchedule"}, []string{framework.AgentLabel + "=yes"}
			}
			start := time.Now()
			node := e.JoinNode(b, ctx, name, opts)
			e.WaitReady(b, ctx, r.ns, "name=p", 1)
			r.took = append(r.took, time.Since(start))
			e.Node.Client.CoreV1().Pods(r.ns).Delete(ctx, "p", metav1.DeleteOptions{})
			framework.WaitFor(b, ctx, "pod p to go", 2*time.Minute, func() (bool, error) {
				_, err := e.Node.Client.CoreV1().Pods(r.ns).Get(ctx, "p", metav1.GetOptions{})
				if apierrors.IsNotFound(err) {
					return true, nil
				}
				return false, err
			})
			e.Remove(b, node)
		}
	}
	b.StopTimer()
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "\nnode joins (join begins → the pod waiting for the node Ready, %d each, alternating)\tp50\tp99\n", len(rows[0].took))
	for _, r := range rows {
		p50, p99 := percentiles(r.took)
		fmt.Fprintf(tw, "%s\t%s\t%s\n", r.name, p50.Round(time.Millisecond), p99.Round(time.Millisecond))
	}
	tw.Flush()
}

// BenchmarkCrossNode measures traffic between two nodes, for the record: a client pod on the
// control-plane node runs `workload load` against a `workload serve -sink` pod on a node that
// joined, both injected (through two test proxies) and both uninjected — connect to the
// server's first line over DETOUR_E2E_BENCH_CONNS connections one after another (default 500;
// p50 and p99), then 256 MiB through one connection. The proxies are the e2e's test proxy
// (io.Copy both ways), not a mesh's (make bench-e2e; docs/benchmarks.md).
func BenchmarkCrossNode(b *testing.B) {
	e := framework.SetUp(b)
	ctx, cancel := framework.Context(b, e.Node, 30*time.Minute)
	defer cancel()
	e.EnsureInstalled(b, ctx)
	e.UseRegistry(b, ctx)
	defer e.UseImported(b, ctx)
	other := e.Join(b, ctx, "bench-b")
	defer e.Remove(b, other)
	conns := 500
	if v := os.Getenv("DETOUR_E2E_BENCH_CONNS"); v != "" {
		fmt.Sscan(v, &conns)
	}
	rows := []struct {
		name, ns string
		inject   bool
		result   []string
	}{
		{name: "both injected (two test proxies)", ns: "xnode-mesh", inject: true},
		{name: "both uninjected", ns: "xnode-plain"},
	}
	line := regexp.MustCompile(`load \S+ conns=\d+ p50=(\S+) p99=(\S+) bytes=\d+ seconds=\S+ MiB/s=(\S+)`)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for k := range rows {
			r := &rows[k]
			e.Namespace(b, ctx, r.ns, r.inject)
			server := framework.OnNode(e.Pod("sink", r.ns), other.Name)
			server.Spec.Containers[0].Args = []string{"serve", "-listen", ":8080", "-sink"}
			if _, err := e.Node.Client.CoreV1().Pods(r.ns).Create(ctx, server, metav1.CreateOptions{}); err != nil {
				b.Fatal(err)
			}
			target := e.WaitReady(b, ctx, r.ns, "name=sink", 1)[0].Status.PodIP + ":8080"
			client := framework.OnNode(e.Pod("load", r.ns), e.Node.Name)
			client.Spec.RestartPolicy = corev1.RestartPolicyNever
			client.Spec.Containers[0].ReadinessProbe = nil
			client.Spec.Containers[0].Args = []string{"dial", "-must", "-retry", "30s", "-addr", target,
				"then", "load", "-addr", target, "-conns", fmt.Sprint(conns), "-bytes", fmt.Sprint(256 << 20), "then", "sleep"}
			if _, err := e.Node.Client.CoreV1().Pods(r.ns).Create(ctx, client, metav1.CreateOptions{}); err != nil {
				b.Fatal(err)
			}
			framework.WaitFor(b, ctx, "the load of "+r.name, 10*time.Minute, func() (bool, error) {
				logs := e.Logs(ctx, r.ns, "load", "app")
				if m := line.FindStringSubmatch(logs); m != nil {
					r.result = m[1:]
					return true, nil
				}
				p, err := e.Node.Client.CoreV1().Pods(r.ns).Get(ctx, "load", metav1.GetOptions{})
				if err == nil && p.Status.Phase == corev1.PodFailed {
					return false, fmt.Errorf("the load failed: %s", logs)
				}
				return false, framework.Seen("log: %s", framework.Tail(logs, 3))
			})
			e.DropNamespaces(b, ctx, r.ns)
		}
	}
	b.StopTimer()
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "\ncross-node, pod to pod (%d connections, then 256 MiB)\tconnect → line p50\tp99\tMiB/s\n", conns)
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", r.name, r.result[0], r.result[1], r.result[2])
	}
	tw.Flush()
}
