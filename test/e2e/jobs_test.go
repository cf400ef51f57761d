package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/repair"
	"github.com/detourmesh/detour/test/e2e/framework"
	"github.com/detourmesh/detour/validator"
)

// seed000Jobs (issue 32.2): a CronJob (concurrencyPolicy Forbid) and two Jobs, all
// restartPolicy Never, created while detour's configuration is missing on the node. Their pods
// start without the redirect and fail their check, in both validator modes: at the proxy's
// start (a native sidecar, which the kubelet restarts in the same sandbox for ever: the pod
// never fails, and its Job, or the CronJob's next run, would wait for good) and in the
// validator init container (the kubelet fails the pod, and its Job replaces it). Once the
// configuration is back, repair deletes the first kind, the Jobs replace their pods, and both
// Jobs complete within their backoffLimit, through the proxy; the CronJob's run completes and
// its next run starts on schedule and completes too.
func seed000Jobs(t *testing.T, ctx context.Context, e *framework.Env) {
	const (
		ns       = "late-jobs"
		proxyJob = "proxy-check"     // the check at the proxy's start
		initJob  = "validator-check" // the check in the detour-validator init container
		cron     = "nightly"
		jobLabel = "batch.kubernetes.io/job-name"
		backoff  = 6
	)
	e.Namespace(t, ctx, ns, true)
	defer e.DropNamespaces(t, ctx, ns)
	jobs := e.Node.Client.BatchV1().Jobs(ns)

	// The node loses detour's configuration, as in seed000Repair; the agent, and with it
	// repair, is away until the story brings it back.
	e.SetAgent(t, ctx, false)
	restored := false
	defer func() {
		if !restored { // the next stories need the node whole
			e.SetAgent(t, context.WithoutCancel(ctx), true)
		}
	}()
	if err := os.RemoveAll(filepath.Dir(e.DropInPath())); err != nil {
		t.Fatal(err)
	}
	if err := e.Node.WritePrimaryConfig(); err != nil {
		t.Fatal(err)
	}

	template := func(name string, podAnnotations map[string]string) batchv1.JobSpec {
		pod := e.Pod(name, ns)
		pod.Spec.RestartPolicy = corev1.RestartPolicyNever
		pod.Spec.Containers[0].Args = []string{"dial", "-must", "-addr", e.Server}
		return batchv1.JobSpec{
			BackoffLimit: ptr.To[int32](backoff),
			Template:     corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: pod.Labels, Annotations: podAnnotations}, Spec: pod.Spec},
		}
	}
	native := map[string]string{annotations.SidecarMode: "native"}
	validatorContainer := map[string]string{annotations.SidecarMode: "native", annotations.ValidatorMode: string(annotations.ValidatorInitContainer)}

	// The CronJob first: its first run comes at the next minute.
	if _, err := e.Node.Client.BatchV1().CronJobs(ns).Create(ctx, &batchv1.CronJob{
		ObjectMeta: metav1.ObjectMeta{Name: cron, Namespace: ns},
		Spec: batchv1.CronJobSpec{
			Schedule:                   "* * * * *",
			ConcurrencyPolicy:          batchv1.ForbidConcurrent,
			SuccessfulJobsHistoryLimit: ptr.To[int32](10),
			FailedJobsHistoryLimit:     ptr.To[int32](10),
			JobTemplate:                batchv1.JobTemplateSpec{Spec: template(cron, native)},
		},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var firstRun string // the CronJob's Job whose pod failed its check
	framework.WaitFor(t, ctx, "the CronJob's first run to fail its check at the proxy's start", 3*time.Minute, func() (bool, error) {
		pods, err := e.Pods(ctx, ns, "")
		if err != nil {
			return false, err
		}
		for _, p := range pods {
			if run := p.Labels[jobLabel]; strings.HasPrefix(run, cron+"-") && framework.ChecksAtProxyStart(&p) && framework.CheckExit(&p) == int(validator.ExitNoRedirect) {
				firstRun = run
				return true, nil
			}
		}
		return false, framework.Seen("pods:\n%s", e.Describe(ctx, ns))
	})
	// Then the Jobs, late, so that the one whose pods fail by themselves uses little of its
	// backoffLimit while the node is broken.
	for name, podAnnotations := range map[string]map[string]string{proxyJob: native, initJob: validatorContainer} {
		if _, err := jobs.Create(ctx, &batchv1.Job{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns}, Spec: template(name, podAnnotations)}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	framework.WaitFor(t, ctx, "both Jobs' pods to fail their check (no redirect)", 2*time.Minute, func() (bool, error) {
		pods, err := e.Pods(ctx, ns, "")
		if err != nil {
			return false, err
		}
		var inProxy, inValidator bool
		for _, p := range pods {
			switch p.Labels[jobLabel] {
			case proxyJob:
				inProxy = inProxy || framework.ChecksAtProxyStart(&p) && framework.CheckExit(&p) == int(validator.ExitNoRedirect)
			case initJob:
				inValidator = inValidator || !framework.ChecksAtProxyStart(&p) && p.Status.Phase == corev1.PodFailed && framework.InitExit(&p, annotations.ValidatorContainer) == int(validator.ExitNoRedirect)
			}
		}
		return inProxy && inValidator, framework.Seen("at the proxy's start: %v, in the validator (pod Failed): %v; pods:\n%s", inProxy, inValidator, e.Describe(ctx, ns))
	})
	// What the issue is about: where the check runs at the proxy's start, nothing ends the pod.
	pods, err := e.Pods(ctx, ns, jobLabel+" in ("+proxyJob+","+firstRun+")")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pods {
		if p.Status.Phase != corev1.PodPending {
			t.Errorf("pod %s, whose proxy's check failed, is %s; want Pending (the kubelet restarts the proxy, a native sidecar, in its sandbox)", p.Name, p.Status.Phase)
		}
	}

	// detour's configuration comes back; repair acts once the node is ready again.
	e.SetAgent(t, ctx, true)
	restored = true
	for _, name := range []string{proxyJob, initJob} {
		framework.WaitFor(t, ctx, "Job "+name+" to complete", 5*time.Minute, func() (bool, error) {
			j, err := jobs.Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			if jobFailed(j) {
				return false, fmt.Errorf("job %s failed: %+v\n%s", name, j.Status, e.Describe(ctx, ns))
			}
			return j.Status.Succeeded == 1, framework.Seen("job status %+v; pods:\n%s", j.Status, e.Describe(ctx, ns))
		})
		j, err := jobs.Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		// The pod that started without the redirect counts as one failure (deleted by repair,
		// or failed by the kubelet), and its replacements on the broken node did too.
		if j.Status.Failed < 1 || j.Status.Failed > backoff {
			t.Errorf("Job %s: %d failed pods, want from 1 to its backoffLimit %d", name, j.Status.Failed, backoff)
		}
		// The pod that completed reached the server through its proxy.
		done, err := e.Pods(ctx, ns, jobLabel+"="+name)
		if err != nil {
			t.Fatal(err)
		}
		i := slices.IndexFunc(done, func(p corev1.Pod) bool { return p.Status.Phase == corev1.PodSucceeded })
		if i < 0 {
			t.Errorf("Job %s has no Succeeded pod", name)
		} else if log := e.Logs(ctx, ns, done[i].Name, annotations.ProxyContainer); !e.Proxy.OutboundLogged(log, e.Server) {
			t.Errorf("Job %s's pod %s completed, but its proxy carried no connection to %s:\n%s", name, done[i].Name, e.Server, log)
		}
	}
	// repair deleted the pod whose check ran at the proxy's start, saying why; it left the
	// pods the kubelet failed to their Job.
	evs, err := e.Node.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "reason=" + repair.EventReason})
	if err != nil {
		t.Fatal(err)
	}
	deletedFor := map[string]bool{}
	for _, ev := range evs.Items {
		for _, job := range []string{proxyJob, initJob, firstRun} {
			if strings.HasPrefix(ev.InvolvedObject.Name, job+"-") && ev.Action == "Delete" && strings.Contains(ev.Message, "its Job "+job+" replaces it") {
				deletedFor[job] = true
			}
		}
		if strings.HasPrefix(ev.InvolvedObject.Name, initJob+"-") {
			t.Errorf("repair acted on %s, a pod the kubelet failed: %s %s", ev.InvolvedObject.Name, ev.Action, ev.Message)
		}
	}
	if !deletedFor[proxyJob] || !deletedFor[firstRun] {
		t.Errorf("repair's Delete Events for the Jobs whose check ran at the proxy's start: %v; want %s and %s", deletedFor, proxyJob, firstRun)
	}

	// The CronJob's run completes, and its next one is not held up by concurrencyPolicy Forbid.
	framework.WaitFor(t, ctx, "the CronJob's first run to complete and a later run to complete", 4*time.Minute, func() (bool, error) {
		list, err := jobs.List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		var succeeded []string
		for _, j := range list.Items {
			if owner := metav1.GetControllerOf(&j); owner != nil && owner.Kind == "CronJob" && owner.Name == cron && j.Status.Succeeded == 1 {
				succeeded = append(succeeded, j.Name)
			}
		}
		return slices.Contains(succeeded, firstRun) && len(succeeded) >= 2, framework.Seen("the CronJob's completed runs %v (the first: %s); pods:\n%s", succeeded, firstRun, e.Describe(ctx, ns))
	})
}

// jobFailed reports whether j carries the condition Failed.
func jobFailed(j *batchv1.Job) bool {
	return slices.ContainsFunc(j.Status.Conditions, func(c batchv1.JobCondition) bool {
		return c.Type == batchv1.JobFailed && c.Status == corev1.ConditionTrue
	})
}
