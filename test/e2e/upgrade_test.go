package e2e

import (
	"context"
	"encoding/json"
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
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/test/e2e/framework"
	"github.com/detourmesh/detour/validator"
)

// The upgrade stories of issue 34: detour's previous release (hack/previous-release), built
// from the repository's own history with its image and chart, is installed and upgraded in
// place to the working tree while meshed pods serve traffic and injected pods are created every
// second, and rolled back. Every injected pod that goes Ready is proven captured by a
// connection through its proxy; nothing may fail: no pod Ready without its redirect, no
// sandbox that failed to start, no admission refused or left uninjected, no failed request
// through the existing pods, and no pod that `detour check` (the live rules against the
// annotations, what detour-cni's CHECK compares) or `detour check --cluster` reports after a
// step.

// upgradeSmoke is TestE2E's share of the upgrade story, and so CI's: the previous release,
// then `helm upgrade` to the working tree with the chart's defaults (two webhook replicas,
// failurePolicy Ignore). `make e2e-upgrade` (TestE2EUpgrade) adds failurePolicy Fail and the
// rollback. It leaves the working tree's release installed.
func upgradeSmoke(t *testing.T, ctx context.Context, e *framework.Env) {
	uninstallDetour(t, ctx, e)
	runUpgrade(t, ctx, e, upgradePlan{first: installPreviousRelease(), dwell: 10 * time.Second,
		steps: []upgradeStep{upgradeToWorkingTree("Ignore")}})
}

// upgradePlan is an upgrade story: the step that installs detour, then the steps that change
// it or the node, each followed by dwell of pods and then the checks.
type upgradePlan struct {
	first upgradeStep
	dwell time.Duration
	steps []upgradeStep
}

// upgradeStep is one change (a helm command, a kubelet replaced) and the name of the phase it
// starts; run returns once the change is complete.
type upgradeStep struct {
	name string
	run  func(t *testing.T, ctx context.Context, u *upgradeRun)
}

// installPreviousRelease installs the previous release (hack/previous-release) from its own
// chart and image, with the chart's defaults for the webhook, and puts its node agent on the
// node.
func installPreviousRelease() upgradeStep {
	return upgradeStep{
		name: "the previous release installed",
		run: func(t *testing.T, ctx context.Context, u *upgradeRun) {
			prev, err := framework.PreviousRelease(ctx, u.e.Root)
			if err != nil {
				t.Fatal(err)
			}
			u.previous, u.installed = prev, prev
			u.e.InstallRelease(t, ctx, prev, "webhook: {replicas: 2, failurePolicy: Ignore}\n")
			u.e.SetAgent(t, ctx, true)
			u.previousRevision = helmRevision(t, ctx, u.e)
		},
	}
}

// upgradeToWorkingTree is `helm upgrade` to the working tree's chart and image with the chart's
// defaults for the webhook (two replicas) and its failurePolicy policy. With failurePolicy
// Fail, a pod the API server cannot get admitted is refused: the webhook's replicas are then
// rolled too (`kubectl rollout restart`, as the next upgrade of its image would), each draining
// at SIGTERM.
func upgradeToWorkingTree(policy string) upgradeStep {
	name := "helm upgrade to the working tree, failurePolicy " + policy
	if policy == "Fail" {
		name += ", and the webhook rolled"
	}
	return upgradeStep{
		name: name,
		run: func(t *testing.T, ctx context.Context, u *upgradeRun) {
			u.e.InstallDetour(t, ctx, fmt.Sprintf("webhook: {replicas: 2, failurePolicy: %s}\n", policy))
			u.installed = nil
			u.waitRollouts(t, ctx)
			if policy != "Fail" {
				return
			}
			if out, errOut, err := u.e.Node.Kubectl(ctx, "-n", framework.DetourNamespace, "rollout", "restart", "deployment/detour-webhook"); err != nil {
				t.Fatalf("kubectl rollout restart: %v\n%s%s", err, out, errOut)
			}
			u.waitRollouts(t, ctx)
		},
	}
}

// rollbackToPrevious is `helm rollback` to the revision that installed the previous release.
func rollbackToPrevious() upgradeStep {
	return upgradeStep{
		name: "helm rollback to the previous release",
		run: func(t *testing.T, ctx context.Context, u *upgradeRun) {
			if out, err := u.e.Node.Helm(ctx, "rollback", "detour", fmt.Sprint(u.previousRevision), "--namespace", framework.DetourNamespace, "--wait", "--timeout", "4m"); err != nil {
				t.Fatalf("helm rollback: %v\n%s", err, out)
			}
			u.installed = u.previous
			u.waitRollouts(t, ctx)
		},
	}
}

const (
	upgradeNS    = "upgrade"
	upgradeLabel = "e2e.detour.dev/upgrade" // created, keep, steady, client
)

// upgradeRun is one run of the upgrade story and what it saw.
type upgradeRun struct {
	t        *testing.T
	e        *framework.Env
	previous *framework.Release
	// previousRevision is the helm revision that installed the previous release.
	previousRevision int

	mu      sync.Mutex
	phases  []upgradePhase
	figures map[string][]int // figure → count per phase
	// pods are the created pods, by name.
	pods map[string]*createdPod
	// notes are the details behind figures that must be 0.
	notes []string
	// steady are the existing meshed pods' UIDs and restart counts when the story began.
	steady map[string]int32
	queue  chan corev1.Pod
	// quiet creates the pods: the admin's client without the webhook's warnings in the log.
	quiet kubernetes.Interface
	// installed is the release whose detour check the checkpoint runs besides the working
	// tree's (the previous release while it is installed), or nil.
	installed *framework.Release
}

type upgradePhase struct {
	name  string
	start time.Time
	// took is how long its helm command and the rollouts took.
	took time.Duration
}

// createdPod is what the story knows of a pod it created.
type createdPod struct {
	created  time.Time
	seen     bool
	injected string // the version in detour.dev/injected; "" when not injected
	verdict  string // captured, bypassed: ..., unverified: ...
	caught   bool
	keep     bool
}

// The figures, in the table's order; those in mustBeZero fail the story when not 0.
const (
	figCreated      = "pods created in the opted-in namespace (one a second)"
	figByPrevious   = "of them injected by the previous release's webhook"
	figByCurrent    = "of them injected by the working tree's webhook"
	figFolded       = "of them with the check at the proxy's start (image volume)"
	figInitCheck    = "of them with the check in the detour-validator init container"
	figCaptured     = "proven captured (a connection through the pod's proxy)"
	figBypassed     = "Ready without their redirect"
	figUnverified   = "Ready but not proven either way"
	figCaught       = "whose check found no redirect (exit 42)"
	figNeverReady   = "never Ready (Pending or crash-looping at the end)"
	figSandbox      = "FailedCreatePodSandBox events"
	figRefused      = "admissions refused"
	figCreateErrors = "other creation errors"
	figUninjected   = "pods admitted without injection"
	figRequests     = "requests through the existing pods' proxies (node → pod, mesh client → Service)"
	figFailed       = "of them failed"
	figChecked      = "pods whose rules detour check compared after the step (every live injected pod)"
	figCheckFailed  = "of them reported by detour check -f --netns (CNI CHECK)"
	figClusterCheck = "pods reported by detour check --cluster after the step"
	// Where the previous release is installed, its own check too.
	figCheckedByInstalled   = "pods the installed previous release's detour check compared"
	figInstalledCheckFailed = "of them reported by it"
)

var upgradeFigureOrder = []string{
	figCreated, figByPrevious, figByCurrent, figFolded, figInitCheck, figCaptured, figBypassed, figUnverified, figCaught, figNeverReady,
	figSandbox, figRefused, figCreateErrors, figUninjected, figRequests, figFailed, figChecked, figCheckFailed, figCheckedByInstalled, figInstalledCheckFailed, figClusterCheck,
}

var mustBeZero = []string{
	figBypassed, figUnverified, figCaught, figNeverReady, figSandbox, figRefused, figCreateErrors, figUninjected, figFailed,
	figCheckFailed, figClusterCheck,
}

// runUpgrade runs plan's first step (detour installed), starts the meshed pods that carry
// traffic throughout and the creation of an injected pod every second, runs plan's other steps
// (each followed by plan.dwell of pods, then the checks), and prints and asserts the figures.
// It returns the run, for the story's own assertions on the figures of its phases.
func runUpgrade(t *testing.T, ctx context.Context, e *framework.Env, plan upgradePlan) *upgradeRun {
	u := &upgradeRun{t: t, e: e, figures: map[string][]int{}, pods: map[string]*createdPod{},
		steady: map[string]int32{}, queue: make(chan corev1.Pod, 1000)}
	cfg := rest.CopyConfig(e.Node.Config)
	cfg.WarningHandler = rest.NoWarnings{}
	var err error
	if u.quiet, err = kubernetes.NewForConfig(cfg); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	u.step(t, ctx, plan.first)
	e.Namespace(t, ctx, upgradeNS, true)
	defer e.DropNamespaces(t, ctx, upgradeNS)
	serviceIP := u.startSteady(t, ctx)

	runCtx, stop := context.WithCancel(ctx)
	var workers sync.WaitGroup
	defer func() { stop(); workers.Wait() }()
	configs := &configWatcher{e: e}
	for _, f := range []func(){
		func() { u.watch(runCtx) }, func() { u.checkWorker(runCtx) }, func() { u.checkWorker(runCtx) },
		func() { u.traffic(runCtx) }, func() { configs.run(runCtx) },
	} {
		workers.Add(1)
		go func() { defer workers.Done(); f() }()
	}
	createCtx, stopCreating := context.WithCancel(runCtx)
	var creator sync.WaitGroup
	creator.Add(1)
	go func() { defer creator.Done(); u.create(createCtx) }()

	framework.SleepCtx(ctx, plan.dwell)
	u.checkpoint(ctx)
	for _, step := range plan.steps {
		u.step(t, ctx, step)
		framework.SleepCtx(ctx, plan.dwell)
		u.checkpoint(ctx)
	}
	stopCreating()
	creator.Wait()
	u.settle(ctx)
	u.clientDials(ctx, serviceIP)
	u.sandboxEvents(ctx, start)
	u.steadyUnchanged(ctx)
	stop()
	workers.Wait()
	u.report(configs, time.Since(start))
	return u
}

// step starts step's phase and runs it.
func (u *upgradeRun) step(t *testing.T, ctx context.Context, step upgradeStep) {
	start := time.Now()
	u.phase(step.name)
	step.run(t, ctx, u)
	u.mu.Lock()
	u.phases[len(u.phases)-1].took = time.Since(start)
	u.mu.Unlock()
}

// figure is the count of figure in phase i (0: the first step's).
func (u *upgradeRun) figure(name string, i int) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	if row := u.figures[name]; i < len(row) {
		return row[i]
	}
	return 0
}

// uninstallDetour takes detour's release away if a story before installed it (`helm
// uninstall`), and waits for detour's namespace to be gone.
func uninstallDetour(t *testing.T, ctx context.Context, e *framework.Env) {
	if _, err := e.Node.Helm(ctx, "status", "detour", "--namespace", framework.DetourNamespace); err == nil {
		if out, err := e.Node.Helm(ctx, "uninstall", "detour", "--namespace", framework.DetourNamespace, "--wait", "--timeout", "2m"); err != nil {
			t.Fatalf("helm uninstall: %v\n%s", err, out)
		}
		if err := e.Node.Client.CoreV1().Namespaces().Delete(ctx, framework.DetourNamespace, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Fatal(err)
		}
	}
	framework.WaitFor(t, ctx, "namespace "+framework.DetourNamespace+" to be gone", 3*time.Minute, func() (bool, error) {
		_, err := e.Node.Client.CoreV1().Namespaces().Get(ctx, framework.DetourNamespace, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		return false, framework.Seen("namespace %s: %v", framework.DetourNamespace, err)
	})
}

// helmRevision is the revision of detour's release now.
func helmRevision(t *testing.T, ctx context.Context, e *framework.Env) int {
	out, err := e.Node.Helm(ctx, "status", "detour", "--namespace", framework.DetourNamespace, "-o", "json")
	if err != nil {
		t.Fatalf("helm status: %v\n%s", err, out)
	}
	var st struct {
		Version int `json:"version"`
	}
	if err := json.Unmarshal([]byte(out), &st); err != nil || st.Version == 0 {
		t.Fatalf("helm status -o json: %v\n%s", err, out)
	}
	return st.Version
}

// phase starts a new phase now.
func (u *upgradeRun) phase(name string) {
	u.mu.Lock()
	defer u.mu.Unlock()
	u.phases = append(u.phases, upgradePhase{name: name, start: time.Now()})
}

// count adds n to figure at the phase of time at.
func (u *upgradeRun) count(at time.Time, figure string, n int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	i := 0
	for j, p := range u.phases {
		if !p.start.After(at) {
			i = j
		}
	}
	row := u.figures[figure]
	for len(row) <= i {
		row = append(row, 0)
	}
	row[i] += n
	u.figures[figure] = row
}

func (u *upgradeRun) note(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	u.mu.Lock()
	u.notes = append(u.notes, msg)
	u.mu.Unlock()
	u.t.Logf("upgrade: %s", msg)
}

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

// create creates an injected pod every second until ctx ends, each in a goroutine of its own
// so that a slow admission does not slow the rate; every tenth pod is kept until the end (for
// the checks after each step), the others are deleted once proven captured.
func (u *upgradeRun) create(ctx context.Context) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	var inflight sync.WaitGroup
	defer inflight.Wait()
	for i := 0; ; i++ {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		name := fmt.Sprintf("up-%04d", i)
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

// checkWorker proves each queued pod captured — the app sees the node's connection come from
// its proxy (127.0.0.1) — and deletes it unless it is kept.
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
				if !strings.Contains(reply, "peer=127.0.0.1:") && !strings.Contains(reply, "peer=[::1]:") {
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
// listener: the app must answer and see the proxy (127.0.0.1) as its peer.
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
			if err != nil || !strings.Contains(reply, "peer=127.0.0.1:") {
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
		if !strings.HasPrefix(msg, "dial "+addr+" ok: ") || !strings.Contains(msg, "peer=127.0.0.1:") {
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
		u.count(now, figChecked, 1)
		if out, err := u.e.CheckPodRules(ctx, &p, ""); err != nil {
			u.count(now, figCheckFailed, 1)
			u.note("detour check of pod %s (injected by %s): %v\n%s", p.Name, p.Annotations[annotations.Injected], err, out)
		}
		if u.installed == nil {
			continue
		}
		// The installed release's own check, as its detour-cni's CHECK would compare.
		u.count(now, figCheckedByInstalled, 1)
		if out, err := u.e.CheckPodRules(ctx, &p, filepath.Join(u.installed.Bin, "detour")); err != nil {
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
