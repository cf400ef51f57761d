package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/detourmesh/detour/test/e2e/framework"
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
	// steadyReady is each existing meshed pod's readiness as last seen, by name.
	steadyReady map[string]bool
	// noBackend are the windows in which no steady pod was Ready.
	noBackend []window
	queue     chan corev1.Pod
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
	figPaced        = "seconds without a pod created: 10 were still starting (the node's pace)"
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
	// A Service without a Ready backend fails its clients, meshed or not: a kubelet before 1.35
	// resets its pods' readiness when it restarts (pkg/kubelet/prober/worker.go).
	figNoBackend    = "mesh client → Service dials that failed while no steady pod was Ready"
	figChecked      = "pods whose rules detour check compared after the step (every live injected pod)"
	figCheckFailed  = "of them reported by detour check -f --netns (CNI CHECK)"
	figClusterCheck = "pods reported by detour check --cluster after the step"
	// Where the previous release is installed, its own check too.
	figCheckedByInstalled   = "pods the installed previous release's detour check compared"
	figInstalledCheckFailed = "of them reported by it"
)

var upgradeFigureOrder = []string{
	figCreated, figPaced, figByPrevious, figByCurrent, figFolded, figInitCheck, figCaptured, figBypassed, figUnverified, figCaught, figNeverReady,
	figSandbox, figRefused, figCreateErrors, figUninjected, figRequests, figFailed, figNoBackend, figChecked, figCheckFailed, figCheckedByInstalled, figInstalledCheckFailed, figClusterCheck,
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
		steady: map[string]int32{}, steadyReady: map[string]bool{}, queue: make(chan corev1.Pod, 1000)}
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
