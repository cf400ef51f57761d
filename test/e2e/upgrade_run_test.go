package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/test/e2e/framework"
	"github.com/detourmesh/detour/validator"
)

// The workers of an upgrade run (runUpgrade): the meshed pods that serve throughout, the
// creation of an injected pod every second, what is seen of each, the checks after each step,
// and the table of figures.

// startSteady creates the existing meshed pods — Deployment steady (two replicas of the
// stories' pod, behind Service steady) and a meshed client that dials the Service every 200 ms
// through its proxy — and waits until they run. It returns the Service's address.
func (u *upgradeRun) startSteady(t *testing.T, ctx context.Context) string {
	e := u.e
	dep := e.Deployment("steady", upgradeNS, 2)
	dep.Spec.Template.Labels[upgradeLabel] = "steady"
	if _, err := e.Node.Client.AppsV1().Deployments(upgradeNS).Create(ctx, dep, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "steady", Namespace: upgradeNS},
		Spec: corev1.ServiceSpec{Selector: map[string]string{"app": "steady"},
			Ports: []corev1.ServicePort{{Port: 8080, TargetPort: intstr.FromInt32(8080)}}},
	}
	svc, err := e.Node.Client.CoreV1().Services(upgradeNS).Create(ctx, svc, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	addr := svc.Spec.ClusterIP + ":8080"
	client := e.Pod("client", upgradeNS)
	client.Labels[upgradeLabel] = "client"
	app := &client.Spec.Containers[0]
	app.Args = []string{"dial", "-retry", "30s", "-addr", addr, "-every", "200ms", "-timeout", "2s"}
	app.ReadinessProbe = nil
	if _, err := e.Node.Client.CoreV1().Pods(upgradeNS).Create(ctx, client, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, p := range e.WaitReady(t, ctx, upgradeNS, upgradeLabel+" in (steady,client)", 3) {
		if !annotations.IsInjected(p.Annotations) {
			t.Fatalf("existing pod %s is not injected", p.Name)
		}
		u.steady[string(p.UID)] = restarts(&p)
	}
	return addr
}

func restarts(p *corev1.Pod) int32 {
	var n int32
	for _, c := range append(slices.Clone(p.Status.InitContainerStatuses), p.Status.ContainerStatuses...) {
		n += c.RestartCount
	}
	return n
}

// upgradeStarting is how many created pods may be starting (created, not yet proven captured
// or not) before the story skips a second: the node's pace, not the story's, decides how many
// pods start at once. A 2-core machine started a pod a second within seconds on 2026-12-05 and
// fell behind on 12-06 (5 s, then 40 s, then minutes: a hundred pods Pending for the node's 110),
// so that the upgrade's helm --wait ran out of time for the load the story itself made.
const upgradeStarting = 10

// create creates an injected pod every second until ctx ends, each in a goroutine of its own
// so that a slow admission does not slow the rate, but none while upgradeStarting pods are
// still starting; every tenth pod is kept until the end (for the checks after each step), the
// others are deleted once proven captured.
func (u *upgradeRun) create(ctx context.Context) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	var inflight sync.WaitGroup
	defer inflight.Wait()
	for i := 0; ; {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		if u.starting() >= upgradeStarting {
			u.count(time.Now(), figPaced, 1)
			continue
		}
		name := fmt.Sprintf("up-%04d", i)
		i++
		p := u.e.Pod(name, upgradeNS)
		keep := i%10 == 0
		p.Labels[upgradeLabel] = map[bool]string{true: "keep", false: "created"}[keep]
		now := time.Now()
		u.mu.Lock()
		u.pods[name] = &createdPod{created: now, keep: keep}
		u.mu.Unlock()
		inflight.Add(1)
		go func() {
			defer inflight.Done()
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer cancel()
			_, err := u.quiet.CoreV1().Pods(upgradeNS).Create(cctx, p, metav1.CreateOptions{})
			if err != nil {
				u.mu.Lock()
				u.pods[name].verdict = "not created" // nothing starts
				u.mu.Unlock()
			}
			switch {
			case err == nil:
				u.count(now, figCreated, 1)
			case strings.Contains(err.Error(), "inject.detour.dev"):
				u.count(now, figRefused, 1)
				u.note("pod %s refused at %s: %v", name, now.UTC().Format("15:04:05.000"), err)
			default:
				u.count(now, figCreateErrors, 1)
				u.note("pod %s not created at %s: %v", name, now.UTC().Format("15:04:05.000"), err)
			}
		}()
	}
}

// starting counts the pods created, or being created, whose capture is not decided yet.
func (u *upgradeRun) starting() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	n := 0
	for _, cp := range u.pods {
		if cp.verdict == "" || cp.verdict == "pending" {
			n++
		}
	}
	return n
}

// watch follows the namespace's pods: a created pod's injection is recorded when first seen,
// a failed check when it shows, and a Ready pod is queued for its capture check.
func (u *upgradeRun) watch(ctx context.Context) {
	factory := informers.NewSharedInformerFactoryWithOptions(u.e.Node.Client, 0, informers.WithNamespace(upgradeNS))
	inf := factory.Core().V1().Pods().Informer()
	inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { u.observe(obj.(*corev1.Pod)) },
		UpdateFunc: func(_, obj any) { u.observe(obj.(*corev1.Pod)) },
	})
	factory.Start(ctx.Done())
	<-ctx.Done()
	factory.Shutdown()
}

func (u *upgradeRun) observe(p *corev1.Pod) {
	if p.Labels[upgradeLabel] == "steady" {
		u.steadyReadiness(p)
		return
	}
	u.mu.Lock()
	cp := u.pods[p.Name]
	if cp == nil || p.DeletionTimestamp != nil {
		u.mu.Unlock()
		return
	}
	first := !cp.seen
	cp.seen = true
	folded := framework.ChecksAtProxyStart(p)
	if first {
		cp.injected = p.Annotations[annotations.Injected]
		if cp.injected == "" {
			cp.verdict = "not injected" // no capture to prove
		}
	}
	caught := !cp.caught && framework.CheckExit(p) == int(validator.ExitNoRedirect)
	cp.caught = cp.caught || caught
	queue := cp.injected != "" && cp.verdict == "" && framework.PodReady(p) && p.Status.PodIP != ""
	if queue {
		cp.verdict = "pending"
	}
	created, injected := cp.created, cp.injected
	u.mu.Unlock()
	if first {
		switch {
		case injected == "":
			u.count(created, figUninjected, 1)
			u.note("pod %s admitted without injection", p.Name)
		case u.previous != nil && injected == u.previous.Version:
			u.count(created, figByPrevious, 1)
		default:
			u.count(created, figByCurrent, 1)
		}
		if injected != "" && folded {
			u.count(created, figFolded, 1)
		} else if injected != "" {
			u.count(created, figInitCheck, 1)
		}
	}
	if caught {
		u.count(created, figCaught, 1)
		u.note("pod %s: its check found no redirect: %s", p.Name, framework.ContainerStates(p))
	}
	if queue {
		u.queue <- *p.DeepCopy()
	}
}

// steadyReadiness logs each change of an existing meshed pod's readiness (which takes it out of
// its Service's endpoints), with the phase: the context of a failed request through it.
func (u *upgradeRun) steadyReadiness(p *corev1.Pod) {
	ready := framework.PodReady(p)
	u.mu.Lock()
	was, seen := u.steadyReady[p.Name]
	u.steadyReady[p.Name] = ready
	u.trackNoBackend()
	phase := ""
	if len(u.phases) > 0 {
		phase = u.phases[len(u.phases)-1].name
	}
	u.mu.Unlock()
	if seen && was != ready {
		u.t.Logf("upgrade: steady pod %s Ready %v at %s (%s): %s", p.Name, ready, time.Now().UTC().Format("15:04:05.000"), phase, framework.ContainerStates(p))
	}
}

// trackNoBackend opens a window when no steady pod is Ready (the Service has no backend) and
// closes it endpointLag after one is again, for the endpoints and kube-proxy to follow. Called
// with u.mu held.
func (u *upgradeRun) trackNoBackend() {
	ready := 0
	for _, r := range u.steadyReady {
		if r {
			ready++
		}
	}
	now := time.Now()
	open := len(u.noBackend) > 0 && u.noBackend[len(u.noBackend)-1].to.IsZero()
	switch {
	case ready == 0 && !open:
		u.noBackend = append(u.noBackend, window{from: now})
	case ready > 0 && open:
		u.noBackend[len(u.noBackend)-1].to = now.Add(endpointLag)
	}
}

// endpointLag is how long after a pod is Ready again its Service may still lack it.
const endpointLag = 3 * time.Second

type window struct{ from, to time.Time }

// withoutBackend reports whether at falls in a window in which no steady pod was Ready.
func (u *upgradeRun) withoutBackend(at time.Time) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	for _, w := range u.noBackend {
		if !at.Before(w.from) && (w.to.IsZero() || at.Before(w.to)) {
			return true
		}
	}
	return false
}

// checkWorker proves each queued pod captured — the app sees the node's connection come from
// its proxy — and deletes it unless it is kept.
func (u *upgradeRun) checkWorker(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case p := <-u.queue:
			verdict := "unverified: no answer from its app within 30s"
			for deadline := time.Now().Add(30 * time.Second); ctx.Err() == nil && time.Now().Before(deadline); framework.SleepCtx(ctx, time.Second) {
				reply, err := u.e.Node.Greeting(ctx, p.Status.PodIP+":8080")
				if err != nil {
					continue
				}
				verdict = "captured"
				if !u.e.Proxy.Proxied(reply) {
					verdict = "bypassed: the app saw " + strings.TrimSpace(reply)
				}
				break
			}
			if ctx.Err() != nil {
				return
			}
			u.mu.Lock()
			cp := u.pods[p.Name]
			cp.verdict = verdict
			created, keep := cp.created, cp.keep
			u.mu.Unlock()
			switch word, _, _ := strings.Cut(verdict, ":"); word {
			case "captured":
				u.count(created, figCaptured, 1)
			case "bypassed":
				u.count(created, figBypassed, 1)
				u.note("pod %s Ready without its redirect: %s", p.Name, verdict)
			default:
				u.count(created, figUnverified, 1)
				u.note("pod %s: %s", p.Name, verdict)
			}
			if !keep {
				err := u.e.Node.Client.CoreV1().Pods(upgradeNS).Delete(ctx, p.Name, metav1.DeleteOptions{})
				if err != nil && !apierrors.IsNotFound(err) && ctx.Err() == nil {
					u.note("delete pod %s: %v", p.Name, err)
				}
			}
		}
	}
}

// traffic connects from the node to each steady pod every 200 ms, through its proxy's inbound
// listener: the app must answer and see the proxy as its peer.
func (u *upgradeRun) traffic(ctx context.Context) {
	pods, err := u.e.Pods(ctx, upgradeNS, upgradeLabel+"=steady")
	if err != nil {
		u.note("list the steady pods: %v", err)
		return
	}
	for framework.SleepCtx(ctx, 200*time.Millisecond) {
		for _, p := range pods {
			at := time.Now()
			reply, err := u.e.Node.Greeting(ctx, p.Status.PodIP+":8080")
			if ctx.Err() != nil {
				return
			}
			u.count(at, figRequests, 1)
			if err != nil || !u.e.Proxy.Proxied(reply) {
				u.count(at, figFailed, 1)
				u.note("request to steady pod %s at %s: %q %v", p.Name, at.UTC().Format("15:04:05.000"), strings.TrimSpace(reply), err)
			}
		}
	}
}

// clientDials counts the meshed client's dials to the Service (its log, with the kubelet's
// timestamps): each went through its proxy to a steady pod, whose app must have seen that
// pod's proxy as its peer.
func (u *upgradeRun) clientDials(ctx context.Context, addr string) {
	data, err := u.e.Node.Client.CoreV1().Pods(upgradeNS).GetLogs("client", &corev1.PodLogOptions{Container: "app", Timestamps: true}).DoRaw(ctx)
	if err != nil {
		u.t.Errorf("the mesh client's log: %v", err)
		return
	}
	dials := 0
	for line := range strings.Lines(string(data)) {
		stamp, msg, _ := strings.Cut(strings.TrimSpace(line), " ")
		at, err := time.Parse(time.RFC3339Nano, stamp)
		if err != nil || !strings.HasPrefix(msg, "dial "+addr) {
			continue
		}
		dials++
		u.count(at, figRequests, 1)
		switch {
		case strings.HasPrefix(msg, "dial "+addr+" ok: ") && u.e.Proxy.Proxied(msg):
		case !strings.HasPrefix(msg, "dial "+addr+" ok: ") && u.withoutBackend(at):
			u.count(at, figNoBackend, 1)
			u.t.Logf("upgrade: the mesh client at %s, while no steady pod was Ready: %s", at.UTC().Format("15:04:05.000"), msg)
		default:
			u.count(at, figFailed, 1)
			u.note("the mesh client at %s: %s", at.UTC().Format("15:04:05.000"), msg)
		}
	}
	if dials == 0 {
		u.t.Errorf("the mesh client logged no dial to %s", addr)
	}
}

// waitRollouts waits for detour's webhook and node agent to finish rolling out.
func (u *upgradeRun) waitRollouts(t *testing.T, ctx context.Context) {
	for _, r := range []string{"deployment/detour-webhook", "daemonset/detour-node-agent"} {
		if out, errOut, err := u.e.Node.Kubectl(ctx, "-n", framework.DetourNamespace, "rollout", "status", r, "--timeout=4m"); err != nil {
			t.Fatalf("kubectl rollout status %s: %v\n%s%s", r, err, out, errOut)
		}
	}
}

// deletedMeanwhile reports whether pod p is gone, or being deleted, since it was listed.
func (u *upgradeRun) deletedMeanwhile(ctx context.Context, p *corev1.Pod) bool {
	now, err := u.e.Node.Client.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
	return apierrors.IsNotFound(err) || err == nil && (now.UID != p.UID || now.DeletionTimestamp != nil)
}

// checkpoint runs, after a step, `detour check -f --netns` on every live injected pod of the
// story and `detour check --cluster`, and counts the pods they report in the current phase.
func (u *upgradeRun) checkpoint(ctx context.Context) {
	now := time.Now()
	pods, err := u.e.Pods(ctx, upgradeNS, "")
	if err != nil {
		u.t.Errorf("list the story's pods: %v", err)
		return
	}
	for _, p := range pods {
		if p.DeletionTimestamp != nil || !annotations.IsInjected(p.Annotations) || !framework.PodReady(&p) {
			continue
		}
		out, err := u.e.CheckPodRules(ctx, &p, "")
		if err != nil && u.deletedMeanwhile(ctx, &p) {
			continue // the story deletes a pod once proven captured, which may be now
		}
		u.count(now, figChecked, 1)
		if err != nil {
			u.count(now, figCheckFailed, 1)
			u.note("detour check of pod %s (injected by %s): %v\n%s", p.Name, p.Annotations[annotations.Injected], err, out)
		}
		if u.installed == nil {
			continue
		}
		// The installed release's own check, as its detour-cni's CHECK would compare.
		out, err = u.e.CheckPodRules(ctx, &p, filepath.Join(u.installed.Bin, "detour"))
		if err != nil && u.deletedMeanwhile(ctx, &p) {
			continue
		}
		u.count(now, figCheckedByInstalled, 1)
		if err != nil {
			u.count(now, figInstalledCheckFailed, 1)
			u.note("%s's detour check of pod %s (injected by %s): %v\n%s", u.installed.Version, p.Name, p.Annotations[annotations.Injected], err, out)
		}
	}
	report, _ := u.e.CheckCluster(u.t, ctx)
	for _, name := range []string{"uninjected-pods", "validator"} {
		res, _ := report.Result(name)
		for _, obj := range res.Objects {
			if strings.HasPrefix(obj, upgradeNS+"/") {
				u.count(now, figClusterCheck, 1)
				u.note("detour check --cluster %s: %s (%s)", name, obj, res.Message)
			}
		}
	}
}

// settle waits until every created pod was proven captured (or not), and counts those that
// never got Ready.
func (u *upgradeRun) settle(ctx context.Context) {
	var pending []string
	framework.Poll(ctx, 3*time.Minute, func() (bool, error) {
		u.mu.Lock()
		defer u.mu.Unlock()
		pending = pending[:0]
		for name, cp := range u.pods {
			if cp.seen && cp.injected != "" && (cp.verdict == "" || cp.verdict == "pending") {
				pending = append(pending, name)
			}
		}
		return len(pending) == 0, nil
	})
	slices.Sort(pending)
	for _, name := range pending {
		u.mu.Lock()
		created := u.pods[name].created
		u.mu.Unlock()
		u.count(created, figNeverReady, 1)
		p, err := u.e.Node.Client.CoreV1().Pods(upgradeNS).Get(ctx, name, metav1.GetOptions{})
		if err == nil {
			u.note("pod %s never Ready: phase %s %s", name, p.Status.Phase, framework.ContainerStates(p))
		}
	}
}

// sandboxEvents counts FailedCreatePodSandBox events anywhere since the story began.
func (u *upgradeRun) sandboxEvents(ctx context.Context, since time.Time) {
	evs, err := u.e.Node.Client.CoreV1().Events("").List(ctx, metav1.ListOptions{FieldSelector: "reason=FailedCreatePodSandBox"})
	if err != nil {
		u.t.Errorf("list FailedCreatePodSandBox events: %v", err)
		return
	}
	for _, ev := range evs.Items {
		at := ev.LastTimestamp.Time
		if at.IsZero() {
			at = ev.EventTime.Time
		}
		if at.Before(since) {
			continue
		}
		u.count(at, figSandbox, int(max(ev.Count, 1)))
		u.note("FailedCreatePodSandBox %s/%s at %s: %s", ev.InvolvedObject.Namespace, ev.InvolvedObject.Name, at.UTC().Format("15:04:05"), ev.Message)
	}
}

// steadyUnchanged fails the story when an existing pod was replaced or restarted.
func (u *upgradeRun) steadyUnchanged(ctx context.Context) {
	pods, err := u.e.Pods(ctx, upgradeNS, upgradeLabel+" in (steady,client)")
	if err != nil {
		u.t.Errorf("list the existing pods: %v", err)
		return
	}
	for _, p := range pods {
		before, ok := u.steady[string(p.UID)]
		if !ok || restarts(&p) != before {
			u.t.Errorf("existing pod %s was replaced or restarted during the upgrade (restarts %d, before %d, known %v)", p.Name, restarts(&p), before, ok)
		}
	}
}

// report prints the figures, a column per phase, and fails on every figure that must be 0 and
// is not.
func (u *upgradeRun) report(configs *configWatcher, took time.Duration) {
	t := u.t
	u.mu.Lock()
	defer u.mu.Unlock()
	header := "| figure |"
	sep := "|---|"
	for i, p := range u.phases {
		header += fmt.Sprintf(" %d. %s (%s) |", i+1, p.name, p.took.Round(time.Second))
		sep += "---|"
	}
	if u.previous != nil {
		t.Logf("the previous release: %s (%s)", u.previous.Version, u.previous.Commit[:7])
	}
	t.Logf("the story's figures, %s in all:", took.Round(time.Second))
	t.Logf("%s total |", header)
	t.Logf("%s---|", sep)
	for _, f := range upgradeFigureOrder {
		row := u.figures[f]
		line, total := "| "+f+" |", 0
		for i := range u.phases {
			n := 0
			if i < len(row) {
				n = row[i]
			}
			total += n
			line += fmt.Sprintf(" %d |", n)
		}
		t.Logf("%s %d |", line, total)
		if slices.Contains(mustBeZero, f) && total != 0 {
			t.Errorf("%s: %d, want 0", f, total)
		}
	}
	t.Logf("| time the node held no detour configuration, or two | %s |", configs)
	if configs.String() != "never" {
		t.Errorf("the node held no detour configuration, or two, at: %s", configs)
	}
	for i := range u.phases {
		if row := u.figures[figCaptured]; i >= len(row) || row[i] == 0 {
			t.Errorf("phase %d (%s): no created pod was proven captured, so it proved nothing", i+1, u.phases[i].name)
		}
	}
	if len(u.notes) > 0 {
		t.Logf("upgrade: the details behind the figures:\n%s", strings.Join(u.notes, "\n"))
	}
}
