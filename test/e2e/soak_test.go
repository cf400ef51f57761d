package e2e

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"

	"github.com/detourmesh/detour/test/e2e/framework"
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
