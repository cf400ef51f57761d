package e2e

import (
	"context"
	"fmt"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/test/e2e/framework"
	"github.com/detourmesh/detour/validator"
)

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
