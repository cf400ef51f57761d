package e2e

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/repair"
	"github.com/detourmesh/detour/test/e2e/framework"
	"github.com/detourmesh/detour/validator"
)

// soakConfig is the soak's length and schedule.
type soakConfig struct {
	duration time.Duration
	seed     uint64
	long     bool
	// waveSize is the number of pods a Deployment scales up by in one wave.
	waveSize int32
	// configMode is the node agent's cniConfigMode: auto (the drop-in on this node) or
	// chained-entry (SOAK_CNI_CONFIG_MODE), to measure the in-file entry under the same faults.
	configMode string
}

func soakConfigFromEnv(t *testing.T) soakConfig {
	cfg := soakConfig{duration: 2 * time.Minute, seed: uint64(time.Now().UnixNano()), waveSize: 20}
	if v := os.Getenv("SOAK_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < time.Minute {
			t.Fatalf("SOAK_DURATION=%q: want a duration of at least 1m, such as 10m", v)
		}
		cfg.duration = d
	}
	if v := os.Getenv("SOAK_SEED"); v != "" {
		seed, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("SOAK_SEED=%q: want an unsigned integer", v)
		}
		cfg.seed = seed
	}
	switch cfg.configMode = os.Getenv("SOAK_CNI_CONFIG_MODE"); cfg.configMode {
	case "", "auto":
		cfg.configMode = "auto"
	case "chained-entry":
	default:
		t.Fatalf("SOAK_CNI_CONFIG_MODE=%q: want auto or chained-entry", cfg.configMode)
	}
	cfg.long = cfg.duration >= 10*time.Minute
	t.Logf("soak: %s, seed %d, cniConfigMode %s (SOAK_SEED=%d SOAK_DURATION=%s replays this fault schedule)", cfg.duration, cfg.seed, cfg.configMode, cfg.seed, cfg.duration)
	return cfg
}

// A soak pod's kind, in its label soakLabel.
const (
	soakLabel = "e2e.detour.dev/soak"
	kindWave  = "wave"
	kindJob   = "job"
	kindBare  = "bare"
)

// soakPhase is one half of the soak: the webhook's failurePolicy and the namespace its
// workload runs in.
type soakPhase struct {
	name   string
	policy admissionregistrationv1.FailurePolicyType
	ns     string
	faults []faultKind
}

type soak struct {
	t     *testing.T
	e     *framework.Env
	cfg   soakConfig
	rng   *rand.Rand
	start time.Time
	// agentDeletes counts the node agent's deletions (odd ones are forced).
	agentDeletes int

	mu sync.Mutex
	// faults is every fault injected, in order.
	faults []faultRecord
	// seen is every soak pod, by UID.
	seen map[types.UID]*soakPod
	// checks holds the verdict of every capture check: pod UID + "/" + the validator's
	// container ID (a new sandbox runs the validator again and is checked again).
	checks map[string]string
	// bypassed are pods whose app answered without the proxy while their validator passed.
	bypassed []string
	// caught are pods whose validator found no redirect (exit 42).
	caught map[types.UID]caughtPod
	// otherFailures are pods whose validator failed with another code of its own.
	otherFailures map[types.UID]string
	// interrupted are pods whose validator run was killed or lost (exit ≥ 128).
	interrupted map[types.UID]string
	// stranded are Job pods a reboot left without a sandbox (see strandedByReboot).
	stranded map[types.UID]string
	// configGaps are the times the node held no detour configuration, or more than one.
	configGaps *configWatcher
	// uninjected are pods of the opted-in soak namespaces admitted without injection.
	uninjected map[types.UID]string
	// createErrors counts the soak's own creations that the API server refused for the
	// webhook (bare pods and Jobs); the controllers' are counted from their Events.
	createErrors map[string]int
	waveTimeouts int
	bare         map[string]types.UID // namespace/name → UID
	resources    *resourceSampler

	podInformer cache.SharedIndexInformer
	queue       chan checkItem
}

type soakPod struct {
	ns, name, kind string
	created        time.Time
	injected       bool
	// folded: its validator check runs at the proxy's start (detour.dev/validator: image-volume).
	folded bool
}

// caughtPod is a pod whose validator exited 42: when the soak saw it, and the validator's
// message.
type caughtPod struct {
	name    string
	at      time.Time
	message string
}

type checkItem struct {
	pod corev1.Pod
	key string
	job bool
}

func newSoak(t *testing.T, e *framework.Env, cfg soakConfig) *soak {
	return &soak{
		t: t, e: e, cfg: cfg, rng: rand.New(rand.NewPCG(cfg.seed, 14)),
		seen: map[types.UID]*soakPod{}, checks: map[string]string{}, caught: map[types.UID]caughtPod{},
		otherFailures: map[types.UID]string{}, interrupted: map[types.UID]string{}, stranded: map[types.UID]string{}, uninjected: map[types.UID]string{}, createErrors: map[string]int{},
		bare: map[string]types.UID{}, queue: make(chan checkItem, 1024),
	}
}

// phases returns the two phases with their faults: the long form runs every fault in each
// phase (so each at least twice, kube-apiserver's restart once under each failurePolicy);
// the short form splits them between the phases, each once.
func (s *soak) phases() []soakPhase {
	fail := soakPhase{name: "fail", policy: admissionregistrationv1.Fail, ns: "soak-fail"}
	ignore := soakPhase{name: "ignore", policy: admissionregistrationv1.Ignore, ns: "soak-ignore"}
	if s.cfg.long {
		rounds := max(1, int(s.cfg.duration/(10*time.Minute)))
		for range rounds {
			fail.faults = append(fail.faults, allFaults...)
			ignore.faults = append(ignore.faults, allFaults...)
		}
	} else {
		fail.faults = []faultKind{faultReboot, faultWebhookDelete, faultCertRotate, faultConflist}
		ignore.faults = []faultKind{faultAPIServer, faultAgentDelete, faultContainerd, faultKubelet}
	}
	for _, p := range []*soakPhase{&fail, &ignore} {
		s.rng.Shuffle(len(p.faults), func(i, j int) { p.faults[i], p.faults[j] = p.faults[j], p.faults[i] })
	}
	return []soakPhase{fail, ignore}
}

func (s *soak) logf(format string, args ...any) {
	s.t.Helper()
	s.t.Logf("soak %s (+%s): %s", time.Now().UTC().Format("15:04:05.000"), time.Since(s.start).Round(time.Second), fmt.Sprintf(format, args...))
}

// run runs both phases, with the capture checker and the resource sampler alongside. It
// stops at the first fault that failed and returns its error.
func (s *soak) run(ctx context.Context) error {
	s.start = time.Now()
	for _, ns := range []string{"soak-fail", "soak-ignore"} {
		s.e.Namespace(s.t, ctx, ns, true)
	}
	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	s.watchPods(watchCtx)
	var workers sync.WaitGroup
	for range 3 {
		workers.Add(1)
		go func() { defer workers.Done(); s.checkWorker(watchCtx) }()
	}
	s.configGaps = &configWatcher{e: s.e}
	workers.Add(1)
	go func() { defer workers.Done(); s.configGaps.run(watchCtx) }()
	s.resources = newResourceSampler(s.e.Node.Cgroup)
	workers.Add(1)
	go func() { defer workers.Done(); s.resources.run(watchCtx, 5*time.Second) }()

	defer func() { stopWatch(); workers.Wait() }()
	phases := s.phases()
	for _, p := range phases {
		if err := s.runPhase(ctx, p, s.cfg.duration/time.Duration(len(phases))); err != nil {
			return err
		}
		if ctx.Err() != nil {
			return fmt.Errorf("the soak ended in phase %s: %w", p.name, context.Cause(ctx))
		}
	}
	s.settle(ctx, "soak-fail", "soak-ignore")
	return nil
}

// runPhase sets the webhook's failurePolicy, then runs the workload and the phase's faults
// for d; the faults come at seeded random moments, one slot each. A fault that fails ends the
// phase at once with its error.
func (s *soak) runPhase(ctx context.Context, p soakPhase, d time.Duration) error {
	s.setFailurePolicy(ctx, p.policy)
	s.logf("phase %s: failurePolicy %s, namespace %s, faults %v", p.name, p.policy, p.ns, p.faults)
	phaseStart := time.Now()
	// The workload runs for d, and on until the phase's last fault is over: a fault is never
	// dropped because the ones before it took long (the node may be slow to recover).
	wctx, stopWorkload := context.WithCancel(ctx)
	defer stopWorkload()
	var wg sync.WaitGroup
	for i, dep := range []string{"wave-a", "wave-b"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// The second Deployment starts half a wave later, so that one scales up while
			// the other scales down.
			if i == 1 && !framework.SleepCtx(wctx, 15*time.Second) {
				return
			}
			s.waves(wctx, p, dep)
		}()
	}
	wg.Add(2)
	go func() { defer wg.Done(); s.jobs(wctx, p) }()
	go func() { defer wg.Done(); s.barePods(wctx, p, d) }()

	slot := d / time.Duration(len(p.faults)+1)
	for i, kind := range p.faults {
		at := phaseStart.Add(slot*time.Duration(i) + time.Duration(float64(slot)*(0.5+s.rng.Float64())))
		if !framework.SleepCtx(ctx, time.Until(at)) {
			break
		}
		if err := s.inject(ctx, kind); err != nil {
			stopWorkload()
			wg.Wait()
			return err
		}
	}
	framework.SleepCtx(ctx, time.Until(phaseStart.Add(d)))
	stopWorkload()
	wg.Wait()
	s.logf("phase %s: workload stopped; waiting for its pods to settle", p.name)
	s.settle(ctx, p.ns)
	s.logf("phase %s: settled", p.name)
	for _, dep := range []string{"wave-a", "wave-b"} {
		s.scale(ctx, p.ns, dep, 0)
	}
	return nil
}

// setFailurePolicy sets the failurePolicy of every webhook of the configuration detour, as
// `--set webhook.failurePolicy=...` would.
func (s *soak) setFailurePolicy(ctx context.Context, policy admissionregistrationv1.FailurePolicyType) {
	mwcs := s.e.Node.Client.AdmissionregistrationV1().MutatingWebhookConfigurations()
	err := framework.Poll(ctx, 2*time.Minute, func() (bool, error) {
		mwc, err := mwcs.Get(ctx, "detour", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		for i := range mwc.Webhooks {
			mwc.Webhooks[i].FailurePolicy = ptr.To(policy)
		}
		_, err = mwcs.Update(ctx, mwc, metav1.UpdateOptions{})
		return err == nil, err
	})
	if err != nil {
		s.t.Fatalf("set the webhook's failurePolicy to %s: %v", policy, err)
	}
}

// soakPodSpec is the soak's pod: one app that serves on 8080 as UID 1000 (the injected
// validator and proxy come from the webhook).
func (s *soak) soakPodSpec() corev1.PodSpec {
	return corev1.PodSpec{
		AutomountServiceAccountToken:  ptr.To(false),
		TerminationGracePeriodSeconds: ptr.To[int64](1),
		Containers: []corev1.Container{{
			Name: "app", Image: s.e.Artifacts.Refs.Workload, ImagePullPolicy: corev1.PullNever,
			Args:            []string{"serve", "-listen", ":8080"},
			SecurityContext: &corev1.SecurityContext{RunAsUser: ptr.To[int64](1000)},
			ReadinessProbe: &corev1.Probe{
				ProbeHandler:  corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(8080)}},
				PeriodSeconds: 1,
			},
		}},
	}
}

// waves scales Deployment dep of the phase up by a wave and down again until ctx ends: up to
// waveSize pods, wait until every one is Ready and checked, down to 0, wait until they are gone.
func (s *soak) waves(ctx context.Context, p soakPhase, dep string) {
	labels := map[string]string{"app": dep, soakLabel: kindWave}
	d := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: dep, Namespace: p.ns},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To[int32](0),
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": dep}},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels}, Spec: s.soakPodSpec()},
		},
	}
	if !s.retry(ctx, "create Deployment "+p.ns+"/"+dep, func() error {
		_, err := s.e.Node.Client.AppsV1().Deployments(p.ns).Create(ctx, d, metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) {
			return nil
		}
		return err
	}) {
		return
	}
	for wave := 1; ctx.Err() == nil; wave++ {
		s.scale(ctx, p.ns, dep, s.cfg.waveSize)
		ready := s.waitWave(ctx, p.ns, dep, int(s.cfg.waveSize), 6*time.Minute)
		if ctx.Err() != nil {
			return
		}
		if !ready {
			s.mu.Lock()
			s.waveTimeouts++
			s.mu.Unlock()
			s.logf("wave %d of %s/%s: not every pod Ready and checked within 6m; scaling down anyway", wave, p.ns, dep)
		}
		s.scale(ctx, p.ns, dep, 0)
		s.waitWave(ctx, p.ns, dep, 0, 4*time.Minute)
	}
}

// scale sets the replicas of Deployment dep, retrying while the API server is away.
func (s *soak) scale(ctx context.Context, ns, dep string, replicas int32) {
	s.retry(ctx, fmt.Sprintf("scale %s/%s to %d", ns, dep, replicas), func() error {
		patch := fmt.Sprintf(`{"spec":{"replicas":%d}}`, replicas)
		_, err := s.e.Node.Client.AppsV1().Deployments(ns).Patch(ctx, dep, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
		return err
	})
}

// retry runs f until it succeeds or ctx ends (the API server may be restarting).
func (s *soak) retry(ctx context.Context, what string, f func() error) bool {
	for ctx.Err() == nil {
		if err := f(); err == nil {
			return true
		}
		framework.SleepCtx(ctx, time.Second)
	}
	return false
}

// waitWave waits until Deployment dep has n pods, every one Ready and checked (n > 0), or
// none at all (n = 0).
func (s *soak) waitWave(ctx context.Context, ns, dep string, n int, timeout time.Duration) bool {
	wctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for {
		pods := s.lister(ns, "app="+dep)
		if n == 0 && len(pods) == 0 {
			return true
		}
		done := 0
		for _, p := range pods {
			if p.DeletionTimestamp == nil && framework.PodReady(p) && s.checked(p) {
				done++
			}
		}
		if n > 0 && done >= n {
			return true
		}
		if !framework.SleepCtx(wctx, time.Second) {
			return false
		}
	}
}

// jobs creates a Job of two pods (the proxy a native sidecar, the app one dial to the test
// server) every 20 seconds until ctx ends.
func (s *soak) jobs(ctx context.Context, p soakPhase) {
	for i := 0; framework.SleepCtx(ctx, 20*time.Second); i++ {
		spec := s.soakPodSpec()
		spec.RestartPolicy = corev1.RestartPolicyNever
		spec.Containers[0].Args = []string{"dial", "-must", "-retry", "30s", "-addr", s.e.Server}
		spec.Containers[0].ReadinessProbe = nil
		job := &batchv1.Job{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("job-%d", i), Namespace: p.ns},
			Spec: batchv1.JobSpec{
				Parallelism: ptr.To[int32](2), Completions: ptr.To[int32](2), BackoffLimit: ptr.To[int32](4),
				Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{soakLabel: kindJob}}, Spec: spec},
			},
		}
		s.create(ctx, "Job "+p.ns+"/"+job.Name, func() error {
			_, err := s.e.Node.Client.BatchV1().Jobs(p.ns).Create(ctx, job, metav1.CreateOptions{})
			return err
		})
	}
}

// barePods creates two bare pods at the phase's start and one in its middle; they live until
// the end of the soak (repair must never delete them).
func (s *soak) barePods(ctx context.Context, p soakPhase, d time.Duration) {
	for i := range 3 {
		if i == 2 && !framework.SleepCtx(ctx, d/2) {
			return
		}
		name := fmt.Sprintf("bare-%d", i)
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: p.ns, Labels: map[string]string{soakLabel: kindBare}},
			Spec:       s.soakPodSpec(),
		}
		s.create(ctx, "bare pod "+p.ns+"/"+name, func() error {
			created, err := s.e.Node.Client.CoreV1().Pods(p.ns).Create(ctx, pod, metav1.CreateOptions{})
			if err == nil {
				s.mu.Lock()
				s.bare[p.ns+"/"+name] = created.UID
				s.mu.Unlock()
			}
			return err
		})
	}
}

// create runs a creation until it succeeds, counting the refusals that came from the webhook
// (failurePolicy Fail while it cannot be called).
func (s *soak) create(ctx context.Context, what string, f func() error) {
	for ctx.Err() == nil {
		err := f()
		if err == nil || apierrors.IsAlreadyExists(err) {
			return
		}
		if strings.Contains(err.Error(), "inject.detour.dev") {
			s.mu.Lock()
			s.createErrors[what]++
			n := s.createErrors[what]
			s.mu.Unlock()
			if n == 1 || n%30 == 0 {
				s.logf("%s: the API server refused it (%d times so far): %v", what, n, err)
			}
		}
		framework.SleepCtx(ctx, time.Second)
	}
}

// settle waits until every soak pod of the namespaces is Ready and checked, completed and
// checked, or gone — or has failed its validator (repair's business).
func (s *soak) settle(ctx context.Context, namespaces ...string) {
	var pending []string
	err := framework.Poll(ctx, 10*time.Minute, func() (bool, error) {
		pending = pending[:0]
		for _, ns := range namespaces {
			for _, p := range s.lister(ns, soakLabel) {
				switch {
				case p.DeletionTimestamp != nil:
				case !annotations.IsInjected(p.Annotations) && (framework.PodReady(p) || p.Status.Phase != corev1.PodPending):
					// Admitted uninjected (failurePolicy Ignore): nothing to check; counted.
				case p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed:
					if p.Status.Phase == corev1.PodSucceeded && !s.checked(p) {
						pending = append(pending, p.Namespace+"/"+p.Name+" (completed, not checked)")
					}
				case framework.PodReady(p) && s.checked(p):
				default:
					if code, _, bad := validatorFailure(p); bad && code == validator.ExitNoRedirect && p.Labels[soakLabel] == kindBare {
						continue // annotated by repair, waits for its owner
					}
					if s.strandedByReboot(p) {
						s.mu.Lock()
						s.stranded[p.UID] = p.Namespace + "/" + p.Name
						s.mu.Unlock()
						continue
					}
					pending = append(pending, p.Namespace+"/"+p.Name)
				}
			}
		}
		return len(pending) == 0, nil
	})
	if err != nil {
		s.logf("pods that did not settle within 10m: %v", pending)
		for _, ns := range namespaces {
			s.t.Logf("%s", s.e.Describe(ctx, ns))
		}
		s.t.Errorf("soak pods did not settle: %v", pending)
	}
}

// strandedByReboot reports whether p is a pod with restartPolicy Never that a reboot left
// without a sandbox: scheduled before the reboot, it is still Pending with no
// PodReadyToStartContainers condition or a false one, long after the reboot. Kubelet 1.37 gives
// such a pod no new sandbox, whether the reboot took the sandbox it had, came while the
// kubelet was creating it, or ended its containers (exit 255) before its status reached the
// API; its Job never hears of it. That is the kubelet's behaviour, not detour's: the soak
// counts such pods and does not wait for them.
func (s *soak) strandedByReboot(p *corev1.Pod) bool {
	if p.Spec.RestartPolicy != corev1.RestartPolicyNever || p.Status.Phase != corev1.PodPending {
		return false
	}
	var scheduled *corev1.PodCondition
	for i, c := range p.Status.Conditions {
		switch {
		case c.Type == corev1.PodScheduled && c.Status == corev1.ConditionTrue:
			scheduled = &p.Status.Conditions[i]
		case c.Type == corev1.PodReadyToStartContainers && c.Status == corev1.ConditionTrue:
			return false
		}
	}
	if scheduled == nil {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, f := range s.faults {
		// Long enough after the reboot that the kubelet has synced every pod it will.
		if f.kind == faultReboot && scheduled.LastTransitionTime.Time.Before(f.start) && time.Since(f.start) > strandedAfter {
			return true
		}
	}
	return false
}

// strandedAfter is how long after a reboot a pod without any sandbox counts as stranded.
const strandedAfter = 3 * time.Minute

// watchPods follows every soak pod with an informer (it relists after an API server restart)
// and hands the ones to check to the workers.
func (s *soak) watchPods(ctx context.Context) {
	factory := informers.NewSharedInformerFactoryWithOptions(s.e.Node.Client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = soakLabel }))
	inf := factory.Core().V1().Pods().Informer()
	inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { s.observe(obj) },
		UpdateFunc: func(_, obj any) { s.observe(obj) },
	})
	s.podInformer = inf
	factory.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		s.t.Fatal("the soak's pod informer did not sync")
	}
}

// lister returns the soak pods of ns with a label selector of the form "key" or "key=value".
func (s *soak) lister(ns, selector string) []*corev1.Pod {
	key, value, hasValue := strings.Cut(selector, "=")
	var out []*corev1.Pod
	for _, obj := range s.podInformer.GetStore().List() {
		p := obj.(*corev1.Pod)
		if p.Namespace != ns {
			continue
		}
		if v, ok := p.Labels[key]; !ok || (hasValue && v != value) {
			continue
		}
		out = append(out, p)
	}
	return out
}

// validatorFailure returns the exit code and message of the check's last failed run, in the
// validator container or at the proxy's start (validator.CheckFailed).
func validatorFailure(p *corev1.Pod) (int32, string, bool) {
	name := validator.CheckContainer(p)
	for _, st := range p.Status.InitContainerStatuses {
		if st.Name != name {
			continue
		}
		for _, term := range []*corev1.ContainerStateTerminated{st.State.Terminated, st.LastTerminationState.Terminated} {
			if validator.CheckFailed(name, term) {
				return term.ExitCode, strings.TrimSpace(term.Message), true
			}
		}
	}
	return 0, "", false
}

// validatorPassed returns the container ID of the check's run that passed, in the pod's current
// sandbox: the validator container that exited 0, or the proxy that started after its check.
func validatorPassed(p *corev1.Pod) (string, bool) {
	for _, st := range p.Status.InitContainerStatuses {
		switch {
		case st.Name == annotations.ValidatorContainer && !framework.ChecksAtProxyStart(p) && st.State.Terminated != nil && st.State.Terminated.ExitCode == 0:
			return st.State.Terminated.ContainerID, st.State.Terminated.ContainerID != ""
		case st.Name == annotations.ProxyContainer && framework.ChecksAtProxyStart(p) && st.State.Running != nil && st.Started != nil && *st.Started:
			return st.ContainerID, st.ContainerID != ""
		}
	}
	return "", false
}

// checkKey names one capture check of p: its current validator run, or its completion.
func checkKey(p *corev1.Pod) (string, bool) {
	if p.Status.Phase == corev1.PodSucceeded {
		return string(p.UID) + "/completed", true
	}
	id, ok := validatorPassed(p)
	return string(p.UID) + "/" + id, ok
}

func (s *soak) checked(p *corev1.Pod) bool {
	key, ok := checkKey(p)
	if !ok {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	v := s.checks[key]
	return v != "" && v != "pending"
}

// observe records what a pod's new state shows and queues its capture check.
func (s *soak) observe(obj any) {
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	sp := s.seen[p.UID]
	if sp == nil {
		sp = &soakPod{ns: p.Namespace, name: p.Name, kind: p.Labels[soakLabel], created: p.CreationTimestamp.Time, injected: annotations.IsInjected(p.Annotations), folded: framework.ChecksAtProxyStart(p)}
		s.seen[p.UID] = sp
		if !sp.injected {
			s.uninjected[p.UID] = p.Namespace + "/" + p.Name
		}
	}
	if code, msg, bad := validatorFailure(p); bad {
		switch {
		case code == validator.ExitNoRedirect:
			if _, known := s.caught[p.UID]; !known {
				s.caught[p.UID] = caughtPod{name: p.Namespace + "/" + p.Name, at: time.Now(), message: msg}
				s.logf("pod %s/%s: its validator found no redirect: %s", p.Namespace, p.Name, msg)
			}
		case code >= 128:
			// Killed (137, 143) or never started (128), or its container lost in a reboot
			// (255): the validator did not get to its verdict; a new run follows.
			if _, known := s.interrupted[p.UID]; !known {
				s.interrupted[p.UID] = fmt.Sprintf("%s/%s exit %d", p.Namespace, p.Name, code)
			}
		default:
			if _, known := s.otherFailures[p.UID]; !known {
				s.otherFailures[p.UID] = fmt.Sprintf("%s/%s exit %d: %s", p.Namespace, p.Name, code, msg)
			}
		}
	}
	if !sp.injected || p.DeletionTimestamp != nil {
		return
	}
	job := p.Labels[soakLabel] == kindJob
	if job && p.Status.Phase != corev1.PodSucceeded || !job && !framework.PodReady(p) {
		return
	}
	key, ok := checkKey(p)
	if !ok || s.checks[key] != "" {
		return
	}
	s.checks[key] = "pending"
	select {
	case s.queue <- checkItem{pod: *p.DeepCopy(), key: key, job: job}:
	default:
		delete(s.checks, key) // the queue is full: the next update queues it again
	}
}

// checkWorker proves each queued pod captured: a Ready pod's app must see the inbound
// connection come from the proxy (127.0.0.1 or ::1), a completed Job pod's proxy must have
// carried its app's dial.
func (s *soak) checkWorker(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case item := <-s.queue:
			verdict := s.checkCapture(ctx, item)
			s.mu.Lock()
			s.checks[item.key] = verdict
			if strings.HasPrefix(verdict, "bypassed") {
				s.bypassed = append(s.bypassed, item.pod.Namespace+"/"+item.pod.Name+": "+verdict)
			}
			s.mu.Unlock()
			if strings.HasPrefix(verdict, "bypassed") {
				s.logf("pod %s/%s ran without the redirect while its validator passed: %s", item.pod.Namespace, item.pod.Name, verdict)
			}
		}
	}
}

func (s *soak) checkCapture(ctx context.Context, item checkItem) string {
	p := item.pod
	if item.job {
		// The proxy's log as the kubelet wrote it on the node: asking the API server for it
		// goes through the kubelet and containerd, and while either restarts the answer can
		// be empty (eight false alarms in one run, each pod's log on disk showing its
		// connection).
		files, _ := filepath.Glob(filepath.Join(s.e.Node.Dir, "pod-logs",
			p.Namespace+"_"+p.Name+"_"+string(p.UID), annotations.ProxyContainer, "*.log"))
		var log strings.Builder
		for _, f := range files {
			log.WriteString(framework.ReadFile(f))
		}
		switch {
		case strings.Contains(log.String(), "-> "+s.e.Server):
			return "captured"
		case !strings.Contains(log.String(), "proxy outbound listening"):
			return fmt.Sprintf("unverified: no log of the proxy's start on the node (%d files)", len(files))
		}
		return "bypassed: the proxy carried no connection to " + s.e.Server
	}
	deadline := time.Now().Add(30 * time.Second)
	for ctx.Err() == nil && time.Now().Before(deadline) {
		reply, err := s.inbound(ctx, p.Status.PodIP)
		switch {
		case err == nil && (strings.Contains(reply, "peer=127.0.0.1:") || strings.Contains(reply, "peer=[::1]:")):
			return "captured"
		case err == nil:
			return "bypassed: the app saw " + strings.TrimSpace(reply)
		}
		// The pod may be gone, or a new sandbox may be on its way (a check per sandbox).
		cur, exists, _ := s.podInformer.GetStore().Get(&p)
		if !exists {
			return "unverified: deleted before its app answered"
		}
		if key, _ := checkKey(cur.(*corev1.Pod)); key != item.key || !framework.PodReady(cur.(*corev1.Pod)) {
			return "unverified: its sandbox changed before its app answered"
		}
		framework.SleepCtx(ctx, time.Second)
	}
	return "unverified: no answer from its app within 30s"
}

// inbound connects from the node to the app's port and returns its greeting.
func (s *soak) inbound(ctx context.Context, ip string) (string, error) {
	return s.e.Node.Greeting(ctx, ip+":8080")
}

// finish runs `detour check --cluster` while the pods admitted uninjected still exist, deletes
// the soak's namespaces, looks for what deleted pods left on the node, and prints the table.
func (s *soak) finish(ctx context.Context) {
	t := s.t
	s.logf("detour check --cluster")
	report, _ := s.e.CheckCluster(t, ctx)
	s.mu.Lock()
	uninjected := maps.Clone(s.uninjected)
	s.mu.Unlock()
	var unreported []string
	live := 0
	res, _ := report.Result("uninjected-pods")
	for _, name := range uninjected {
		if _, exists, _ := s.podInformer.GetStore().GetByKey(name); !exists {
			continue
		}
		live++
		if !slices.Contains(res.Objects, name) {
			unreported = append(unreported, name)
		}
	}
	slices.Sort(unreported)
	if len(unreported) > 0 {
		t.Errorf("detour check --cluster did not report %d pods admitted uninjected: %v (check uninjected-pods: %s %q)", len(unreported), unreported, res.Status, res.Message)
	}

	bareDeleted := s.bareDeletedByRepair(ctx)
	failedAdmissions := s.failedAdmissions(ctx)
	repairRate := s.repairRate(ctx)

	s.logf("deleting the soak's namespaces")
	for _, ns := range []string{"soak-fail", "soak-ignore"} {
		if err := s.e.Node.Client.CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Error(err)
		}
	}
	framework.WaitFor(t, ctx, "the soak's namespaces to be deleted", 8*time.Minute, func() (bool, error) {
		for _, ns := range []string{"soak-fail", "soak-ignore"} {
			if _, err := s.e.Node.Client.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
				if err != nil {
					return false, err
				}
				return false, framework.Seen("namespace %s still there", ns)
			}
		}
		return true, nil
	})
	s.logf("looking for what deleted pods left on the node")
	leaks := waitNoLeaks(t, ctx, s.e)
	configs, _ := s.e.DetourConfigs()

	s.mu.Lock()
	defer s.mu.Unlock()
	kinds, foldedPods := map[string]int{}, 0
	for _, sp := range s.seen {
		kinds[sp.kind]++
		if sp.folded {
			foldedPods++
		}
	}
	verdicts := map[string]int{}
	var unverified []string
	for key, v := range s.checks {
		word, _, _ := strings.Cut(v, ":")
		verdicts[word]++
		if word == "unverified" {
			unverified = append(unverified, key+" "+v)
		}
	}
	// A caught pod either got no redirect from detour-cni (its ADDs in the plugin's log say
	// so, or there is none), or got one and its validator still saw none.
	adds := map[string][]framework.PluginEntry{}
	for _, l := range s.e.PluginLog(t, "ADD", "") {
		adds[l.Pod] = append(adds[l.Pod], l)
	}
	caughtBy, caughtRedirected := map[faultKind]int{}, map[faultKind]int{}
	var caughtLines []string
	for _, c := range s.caught {
		kind := s.faultAt(c.at)
		caughtBy[kind]++
		var decisions []string
		redirected := false
		for _, l := range adds[c.name] {
			decisions = append(decisions, strings.TrimSpace(l.Time.UTC().Format("15:04:05.000")+" "+l.Decision+" "+l.Error))
			redirected = redirected || l.Decision == "redirected"
		}
		if redirected {
			caughtRedirected[kind]++
		}
		caughtLines = append(caughtLines, fmt.Sprintf("%s at %s after %s: detour-cni ADDs %v; validator: %s",
			c.name, c.at.UTC().Format("15:04:05.000"), kind, decisions, c.message))
	}
	slices.Sort(caughtLines)

	// The drop-in is detour's alone: no fault may take it off the node even for a moment. An
	// entry in the primary's conflist is gone while the primary rewrites it.
	gapsWant := ""
	if s.cfg.configMode == "auto" {
		gapsWant = "must be never (drop-in)"
	}
	rows := [][3]string{
		{"soak", fmt.Sprintf("%s, seed %d, cniConfigMode %s, %d faults", time.Since(s.start).Round(time.Second), s.cfg.seed, s.cfg.configMode, len(s.faults)), ""},
		{"pods created", fmt.Sprintf("%d (%d in waves, %d of Jobs, %d bare)", len(s.seen), kinds[kindWave], kinds[kindJob], kinds[kindBare]), "≥ 300 in the long form"},
		{"of them with the validator's check at the proxy's start (validator.mode auto)", fmt.Sprint(foldedPods), ""},
		{"capture checks (a real connection per Ready sandbox; the proxy's log per completed Job pod)", fmt.Sprintf("%d captured, %d unverified", verdicts["captured"], verdicts["unverified"]), ""},
		{"pods whose app ran without the redirect while their validator passed", fmt.Sprint(len(s.bypassed)), "must be 0"},
	}
	for _, k := range append(slices.Clone(allFaults), faultNone) {
		rows = append(rows, [3]string{"pods caught by the validator (exit 42) after: " + string(k),
			fmt.Sprintf("%d (%d of them had an ADD that redirected)", caughtBy[k], caughtRedirected[k]), "goal 0"})
	}
	rows = append(rows,
		[3]string{"validator failures with another code of its own (1, 2, 43, 44)", fmt.Sprint(len(s.otherFailures)), ""},
		[3]string{"validator runs killed or lost to a fault (exit ≥ 128; a new run follows)", fmt.Sprint(len(s.interrupted)), ""},
		[3]string{"time the node held no detour configuration, or two", s.configGaps.String(), gapsWant},
		[3]string{"Job pods a reboot left without a sandbox (kubelet: restartPolicy Never, Pending for good)", fmt.Sprint(len(s.stranded)), ""},
		[3]string{"admissions refused (failurePolicy Fail: controllers' FailedCreate + the soak's own)", fmt.Sprint(failedAdmissions), ""},
		[3]string{"pods admitted uninjected (failurePolicy Ignore)", fmt.Sprint(len(uninjected)), ""},
		[3]string{"of those still there, not reported by detour check --cluster", fmt.Sprintf("%d of %d", len(unreported), live), "must be 0"},
		[3]string{"bare pods deleted by repair", fmt.Sprint(bareDeleted), "must be 0"},
		[3]string{"repair deletions; most in any window beyond rate·t + burst", repairRate.String(), "must be 0 beyond"},
		[3]string{"waves that did not get Ready and checked within 6m", fmt.Sprint(s.waveTimeouts), ""},
		[3]string{"detour configurations on the node", fmt.Sprintf("%d %v", len(configs), configs), "exactly 1"},
	)
	for _, l := range leaks.rows() {
		rows = append(rows, [3]string{l[0], l[1], "must be 0"})
	}
	for _, r := range s.resources.rows() {
		rows = append(rows, [3]string{r[0], r[1], "goal ≤ 10%"})
	}
	s.logFaults()
	t.Logf("soak table:")
	for _, r := range rows {
		t.Logf("  | %s | %s | %s |", r[0], r[1], r[2])
	}
	if len(unverified) > 0 {
		slices.Sort(unverified)
		t.Logf("soak: unverified checks: %v", unverified)
	}
	for _, l := range caughtLines {
		t.Logf("soak: caught: %s", l)
	}
	if len(s.otherFailures) > 0 {
		t.Logf("soak: validator failures with another code: %v", s.otherFailures)
	}

	if len(s.bypassed) > 0 {
		t.Errorf("%d pods ran their app without the redirect while their validator passed: %v", len(s.bypassed), s.bypassed)
	}
	if bareDeleted > 0 {
		t.Errorf("repair deleted %d bare pods", bareDeleted)
	}
	if repairRate.excess > 0 {
		t.Errorf("repair exceeded its rate limit: %s", repairRate)
	}
	if gapsWant != "" && s.configGaps.String() != "never" {
		t.Errorf("the node held no detour configuration, or two, at: %s", s.configGaps)
	}
	if len(configs) != 1 {
		t.Errorf("the node holds %d detour configurations, want exactly 1: %v", len(configs), configs)
	}
	if leaks.total() > 0 {
		t.Errorf("deleted pods left things on the node: %+v", leaks)
	}
	if verdicts["captured"] == 0 {
		t.Errorf("no pod was proven captured: the soak proved nothing")
	}
}

// faultAt names the last fault that began before at, when it ended less than a minute
// before at; else faultNone.
func (s *soak) faultAt(at time.Time) faultKind {
	for i := len(s.faults) - 1; i >= 0; i-- {
		f := s.faults[i]
		if f.start.After(at) {
			continue
		}
		if at.Sub(f.end) <= time.Minute {
			return f.kind
		}
		break
	}
	return faultNone
}

// bareDeletedByRepair counts the bare pods that are gone or replaced, and the repair Events
// that deleted one.
func (s *soak) bareDeletedByRepair(ctx context.Context) int {
	s.mu.Lock()
	bare := maps.Clone(s.bare)
	s.mu.Unlock()
	deleted := 0
	for name, uid := range bare {
		ns, pod, _ := strings.Cut(name, "/")
		p, err := s.e.Node.Client.CoreV1().Pods(ns).Get(ctx, pod, metav1.GetOptions{})
		if apierrors.IsNotFound(err) || err == nil && p.UID != uid {
			s.logf("bare pod %s is gone or was replaced", name)
			deleted++
		}
	}
	return deleted
}

// failedAdmissions sums the controllers' FailedCreate Events that name detour's webhook and
// the soak's own refused creations.
func (s *soak) failedAdmissions(ctx context.Context) int {
	total := 0
	for _, ns := range []string{"soak-fail", "soak-ignore"} {
		evs, err := s.e.Node.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "reason=FailedCreate"})
		if err != nil {
			s.t.Errorf("list the FailedCreate Events of %s: %v", ns, err)
			continue
		}
		for _, ev := range evs.Items {
			if strings.Contains(ev.Message, "inject.detour.dev") {
				total += int(max(ev.Count, 1))
			}
		}
	}
	s.mu.Lock()
	for _, n := range s.createErrors {
		total += n
	}
	s.mu.Unlock()
	return total
}

// rateReport is repair's deletions against its limit (rate 5/s, burst 5 in the e2e values).
type rateReport struct{ deletions, excess int }

func (r rateReport) String() string { return fmt.Sprintf("%d; %d", r.deletions, r.excess) }

func (s *soak) repairRate(ctx context.Context) rateReport {
	const limit, burst = 5.0, 5
	var times []time.Time
	for _, ns := range []string{"soak-fail", "soak-ignore"} {
		evs, err := s.e.Node.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "reason=" + repair.EventReason})
		if err != nil {
			s.t.Errorf("list repair's Events of %s: %v", ns, err)
			continue
		}
		for _, ev := range evs.Items {
			if ev.Action == "Annotate" {
				continue
			}
			at := ev.EventTime.Time
			if at.IsZero() {
				at = ev.LastTimestamp.Time
			}
			for range max(ev.Count, 1) {
				times = append(times, at)
			}
		}
	}
	slices.SortFunc(times, func(a, b time.Time) int { return a.Compare(b) })
	r := rateReport{deletions: len(times)}
	for i := range times {
		for j := i; j < len(times); j++ {
			// Event times have a second's resolution at worst: allow one more second.
			allowed := burst + int(limit*(times[j].Sub(times[i]).Seconds()+1))
			r.excess = max(r.excess, j-i+1-allowed)
		}
	}
	return r
}
