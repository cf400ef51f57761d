package scale

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/metrics"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/hack/webhook-load/load"
	"github.com/detourmesh/detour/internal/ctxtime"
)

// Options shape one run of the harness at one size.
type Options struct {
	// Nodes is how many simulated nodes run detour's node agent; PodsPerNode how many pods the
	// workload runs on each, created at PodsPerSecond through detour's webhook.
	Nodes, PodsPerNode int
	PodsPerSecond      float64
	// Detour is the detour binary the webhook's replicas run.
	Detour string
	// Steady is how long the steady state is watched once every node is ready.
	Steady time.Duration
	// Chart is detour's chart directory; BinDir hack/test-binaries.sh's binaries; Dir where
	// the run writes (the audit log, every node's files and logs).
	Chart, BinDir, Dir string
	// Log gets a line per step.
	Log io.Writer
}

// Result is what one run measured.
type Result struct {
	Nodes int
	// Herd is the cold install: every node's agent started at once on nodes registered with
	// the startup taint, until every node is labelled ready and untainted.
	Herd time.Duration
	// HerdP50, HerdP99 and Throttled are the latency of every request the API server answered
	// during the herd (watches apart), and how many it answered 429.
	HerdP50, HerdP99 time.Duration
	Throttled        int
	// Rollout is every agent restarted at once (a rollout of the DaemonSet with maxUnavailable
	// 100%), after the steady state: its pods deleted, new ones created, until every new
	// install-cni is ready; RolloutP99 and RolloutThrottled the API server's answers meanwhile.
	Rollout          time.Duration
	RolloutP99       time.Duration
	RolloutThrottled int
	// Check is `detour check --cluster` run once the workload runs: how long it took, its peak
	// memory (maximum resident set), and its summary line.
	Check       time.Duration
	CheckMaxRSS int64
	CheckOutput string
	// Admission is the workload's creation through the webhook, after the herd.
	Admission *Admission
	// Steady is the steady-state window, after the workload's creation.
	Steady Window
	// Requests are every request of the run.
	Requests []Request
	// WatchesAt is when the open watches were counted (the steady window's end).
	WatchesAt time.Time
	// WebhookMaxRSS is the largest peak resident set of the webhook's replicas at the steady
	// window's end (the workload admitted, every Node cached).
	WebhookMaxRSS int64
	// HerdAgent and RolloutAgent are each agent's own time to ready in the herds (p50, p99,
	// max): in the cold install from its install-cni's first request to its patch of the node
	// (the audit log's); in the rollout, whose nodes are labelled already, from its containers'
	// start to its /readyz's first 200 (polled every 100 ms from its start).
	HerdAgent, RolloutAgent [3]time.Duration
	// HeapPerNode is the growth of this process's heap per node, both containers of its agent
	// with their informers' caches, after a GC at the steady window's end.
	HeapPerNode float64
	// Errors are what the agents' containers returned.
	Errors []error
}

// Run runs the harness at one size: the control plane and KWOK, opts.Nodes simulated nodes,
// detour's chart, the cold-install herd, the steady state.
func Run(ctx context.Context, opts Options) (*Result, error) {
	logf := func(format string, args ...any) { fmt.Fprintf(opts.Log, "scale: "+format+"\n", args...) }
	if err := os.MkdirAll(opts.Dir, 0o755); err != nil {
		return nil, err
	}
	restore, err := inotifyHeadroom(opts.Nodes)
	if err != nil {
		return nil, err
	}
	defer restore()
	chart, err := Render(ctx, opts.BinDir, opts.Dir, opts.Chart, values)
	if err != nil {
		return nil, err
	}
	c, err := StartCluster(ctx, opts.BinDir, opts.Dir, chart.Webhook)
	if err != nil {
		return nil, err
	}
	defer c.Stop()
	res := &Result{Nodes: opts.Nodes}
	start := time.Now()
	if err := c.CreateNodes(ctx, 0, opts.Nodes); err != nil {
		return nil, err
	}
	if err := c.waitNodes(ctx, "KWOK to make every node Ready", nodeReady, 5*time.Minute); err != nil {
		return nil, err
	}
	logf("%d nodes registered and Ready in %s", opts.Nodes, time.Since(start).Round(time.Millisecond))
	ds, err := c.Install(ctx, chart)
	if err != nil {
		return nil, err
	}
	wh, err := c.StartWebhook(ctx, opts.Detour, chart, 2)
	if err != nil {
		return nil, err
	}
	defer wh.Stop()
	base := heapObjects()
	herd := time.Now()
	agents := make([]*Agent, opts.Nodes)
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(32)
	for i := range agents {
		g.Go(func() error {
			a, err := c.StartAgent(gctx, ds, i)
			agents[i] = a
			return err
		})
	}
	defer func() {
		for _, a := range agents {
			if a != nil {
				a.Stop()
			}
		}
	}()
	if err := g.Wait(); err != nil {
		return nil, err
	}
	if err := c.waitNodes(ctx, "every node labelled ready and untainted", detourReady, 10*time.Minute); err != nil {
		return nil, err
	}
	res.Herd = time.Since(herd)
	logf("herd: every node ready and untainted %s after its agent started", res.Herd.Round(time.Millisecond))
	herdEnd := time.Now()
	if res.Admission, err = c.CreateWorkload(ctx, wh, opts.Nodes, opts.PodsPerNode, opts.PodsPerSecond); err != nil {
		return nil, err
	}
	logf("workload: %d pods created at %.0f/s through the webhook, p50 %s, p99 %s (the webhook's own: p50 %s, p99 %s), %d uninjected", res.Admission.Pods,
		res.Admission.Rate, res.Admission.P50, res.Admission.P99, res.Admission.WebhookP50, res.Admission.WebhookP99, res.Admission.Uninjected)
	settled := time.Now()
	if err := ctxtime.Sleep(ctx, opts.Steady); err != nil {
		return nil, err
	}
	res.WatchesAt = time.Now()
	res.HeapPerNode = (heapObjects() - base) / float64(opts.Nodes)
	if res.WebhookMaxRSS, err = wh.MaxRSS(); err != nil {
		return nil, err
	}
	if err := c.checkCluster(ctx, opts.Detour, res); err != nil {
		return nil, err
	}
	logf("detour check --cluster: %s, peak RSS %d MiB", res.Check.Round(time.Millisecond), res.CheckMaxRSS>>20)
	rollout := time.Now()
	if err := c.rollOut(ctx, ds, agents); err != nil {
		return nil, err
	}
	res.Rollout = time.Since(rollout)
	rolloutEnd := time.Now()
	logf("rollout: every agent restarted at once, every new one ready in %s", res.Rollout.Round(time.Millisecond))
	if err := c.KWOKExited(); err != nil {
		return nil, err
	}
	// The audit log is written as requests end: a moment for the last ones.
	time.Sleep(time.Second)
	if res.Requests, err = ReadAudit(c.AuditLog); err != nil {
		return nil, err
	}
	q, throttled := In(res.Requests, herd, herdEnd).Latencies(0.5, 0.99)
	res.HerdP50, res.HerdP99, res.Throttled = q[0], q[1], throttled
	res.HerdAgent = In(res.Requests, herd, herdEnd).AgentReady()
	res.RolloutAgent = readyTimes(agents)
	res.Steady = In(res.Requests, settled, res.WatchesAt)
	res.Errors = c.AgentErrors()
	q, res.RolloutThrottled = In(res.Requests, rollout, rolloutEnd).Latencies(0.99)
	res.RolloutP99 = q[0]
	return res, nil
}

// readyTimes are the agents' times to ready in the rollout: p50, p99, max.
func readyTimes(agents []*Agent) [3]time.Duration {
	var d []time.Duration
	for _, a := range agents {
		d = append(d, a.readyAfter())
	}
	return spread(d)
}

// checkCluster runs `detour check --cluster` as the admin and records its time and peak
// memory in res. Its verdict is not the harness's: the webhook's pods are KWOK's, so the checks
// that dial them fail; what counts is that it read every pod and node.
func (c *Cluster) checkCluster(ctx context.Context, detour string, res *Result) error {
	cmd := exec.CommandContext(ctx, detour, "check", "--cluster", "--kubeconfig", c.Kubeconfig, "--namespace", Namespace)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	start := time.Now()
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("detour check --cluster: %w", err)
	}
	peak := sampleHWM(cmd.Process.Pid)
	cmd.Wait() // its verdict is not the harness's
	res.Check = time.Since(start)
	res.CheckMaxRSS = peak()
	res.CheckOutput = out.String()
	return nil
}

// sampleHWM samples the high-water mark of pid's resident set (VmHWM in /proc/pid/status)
// every 10 ms until the process is gone, and returns what gives the last value read, in bytes.
// The child's rusage cannot say it: Go starts a command with vfork, and Linux hands the child
// the parent's peak at exec, so a child of this harness (hundreds of MiB of agents) "peaked" at
// the harness's size whatever it did. A high-water mark misses only the last 10 ms's growth.
func sampleHWM(pid int) (peak func() int64) {
	var last atomic.Int64
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			hwm, err := load.PeakRSS(pid)
			if err != nil {
				return // exited: its status has no memory any more
			}
			last.Store(hwm)
			time.Sleep(10 * time.Millisecond)
		}
	}()
	return func() int64 {
		<-done
		return last.Load()
	}
}

// rollOut restarts every agent at once, as a rollout of the DaemonSet with maxUnavailable 100%
// does: every container stopped (SIGTERM), every pod deleted, a new pod with new containers on
// every node, until every new install-cni is ready. agents get the new ones.
func (c *Cluster) rollOut(ctx context.Context, ds *appsv1.DaemonSet, agents []*Agent) error {
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(32)
	for _, a := range agents {
		g.Go(func() error {
			a.Stop()
			return c.Client.CoreV1().Pods(a.Pod.Namespace).Delete(gctx, a.Pod.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)})
		})
	}
	if err := g.Wait(); err != nil {
		return fmt.Errorf("stop the agents: %w", err)
	}
	// Each new agent is watched from its start, so its time to ready is its own, not the
	// harness's pace of creating the others.
	pollCtx, stopPolls := context.WithTimeout(ctx, 10*time.Minute)
	defer stopPolls()
	g, gctx = errgroup.WithContext(ctx)
	g.SetLimit(32)
	for i := range agents {
		g.Go(func() error {
			a, err := c.StartAgent(gctx, ds, i)
			if err == nil {
				agents[i] = a
				go a.awaitReady(pollCtx)
			}
			return err
		})
	}
	if err := g.Wait(); err != nil {
		return err
	}
	return wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, 10*time.Minute, true, func(ctx context.Context) (bool, error) {
		if err := c.agentsFailed(); err != nil {
			return false, err
		}
		for _, a := range agents {
			if a.readyAfter() == 0 {
				return false, nil
			}
		}
		return true, nil
	})
}

// values are the chart's values of the harness: the proxy's image a placeholder (no simulated
// node pulls it), the webhook failing a pod it cannot inject.
const values = `webhook:
  failurePolicy: Fail
  config:
    proxy:
      image: scale.invalid/proxy:0
`

// waitNodes waits until every node satisfies ok.
func (c *Cluster) waitNodes(ctx context.Context, what string, ok func(*corev1.Node) bool, timeout time.Duration) error {
	var seen string
	err := wait.PollUntilContextTimeout(ctx, time.Second, timeout, true, func(ctx context.Context) (bool, error) {
		if err := c.KWOKExited(); err != nil {
			return false, err
		}
		if err := c.agentsFailed(); err != nil {
			return false, err
		}
		nodes, err := c.Client.CoreV1().Nodes().List(ctx, metav1.ListOptions{LabelSelector: "type=kwok"})
		if err != nil {
			seen = err.Error()
			return false, nil
		}
		n := 0
		for i := range nodes.Items {
			if ok(&nodes.Items[i]) {
				n++
			}
		}
		seen = fmt.Sprintf("%d of %d", n, len(nodes.Items))
		return n == len(nodes.Items) && n > 0, nil
	})
	if err != nil {
		return fmt.Errorf("waiting for %s: %w (last seen: %s)", what, err, seen)
	}
	return nil
}

func nodeReady(n *corev1.Node) bool {
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// detourReady reports whether detour's agent declared n ready: labelled, startup taint gone.
func detourReady(n *corev1.Node) bool {
	if n.Labels[annotations.CNIReadyLabel] != "true" {
		return false
	}
	for _, t := range n.Spec.Taints {
		if t.Key == annotations.CNINotReadyTaint {
			return false
		}
	}
	return true
}

// heapObjects is the bytes of this process's live heap objects after a GC.
func heapObjects() float64 {
	runtime.GC()
	s := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	metrics.Read(s)
	return float64(s[0].Value.Uint64())
}

// inotifyHeadroom makes room for an inotify instance per node agent (each watches its CNI
// directories): the per-user limit, fs.inotify.max_user_instances, is 128 on many machines.
// It raises it when it must, which takes root, and returns what puts it back.
func inotifyHeadroom(nodes int) (restore func(), err error) {
	const path = "/proc/sys/fs/inotify/max_user_instances"
	data, err := os.ReadFile(path)
	if err != nil {
		return func() {}, nil // not Linux's procfs: nothing to raise
	}
	limit, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil {
		return nil, fmt.Errorf("%s: %q: %w", path, data, err)
	}
	// One per agent, and room for what else runs as the same user (a machine's services hold
	// a few dozen): with a limit of 128, more than 32 nodes take root.
	want := nodes + 96
	if limit >= want {
		return func() {}, nil
	}
	if err := os.WriteFile(path, []byte(strconv.Itoa(want)), 0o644); err != nil {
		return nil, fmt.Errorf("%d node agents need %d inotify instances and %s is %d: raise it (sysctl fs.inotify.max_user_instances=%d) or run as root: %w",
			nodes, want, path, limit, want, err)
	}
	return func() { os.WriteFile(path, data, 0o644) }, nil
}

// ModuleRoot is detour's module directory, as the go command finds it from the working
// directory.
func ModuleRoot() (string, error) {
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}").Output()
	if err != nil {
		return "", fmt.Errorf("find the module's root: %w", err)
	}
	return strings.TrimSpace(string(out)), nil
}

// ChartDir is detour's chart in the module at root.
func ChartDir(root string) string { return filepath.Join(root, "manifests", "charts", "detour") }

// BuildDetour builds the detour binary of the module at root into dir, for the webhook's
// replicas.
func BuildDetour(ctx context.Context, root, dir string) (string, error) {
	out := filepath.Join(dir, "detour")
	cmd := exec.CommandContext(ctx, "go", "build", "-o", out, "./cmd/detour")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/detour: %w\n%s", err, b)
	}
	return out, nil
}
