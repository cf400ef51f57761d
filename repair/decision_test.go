package repair

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stesting "k8s.io/client-go/testing"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/validator"
)

func TestNeedsRepair(t *testing.T) {
	now := metav1.Now()
	for _, tc := range []struct {
		name   string
		modify func(*corev1.Pod)
		want   bool
	}{
		{"crash loop after 42", func(*corev1.Pod) {}, true},
		{"terminated 42 now", func(p *corev1.Pod) {
			p.Status.InitContainerStatuses[0].State, p.Status.InitContainerStatuses[0].LastTerminationState = terminated(42), corev1.ContainerState{}
		}, true},
		// Issue 15.6: running again in a new sandbox, it may pass: not deleted before it can.
		{"running again after 42", func(p *corev1.Pod) {
			p.Status.InitContainerStatuses[0].State = corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}
		}, false},
		// Issue 15.6: terminal pods are replaced already (restartPolicy Never) or done.
		{"failed pod", func(p *corev1.Pod) {
			p.Status.Phase = corev1.PodFailed
			p.Status.InitContainerStatuses[0].State, p.Status.InitContainerStatuses[0].LastTerminationState = terminated(42), corev1.ContainerState{}
		}, false},
		{"succeeded pod", func(p *corev1.Pod) { p.Status.Phase = corev1.PodSucceeded }, false},
		{"passed since", func(p *corev1.Pod) { p.Status.InitContainerStatuses[0].State = terminated(0) }, false},
		{"other failure", func(p *corev1.Pod) { p.Status.InitContainerStatuses[0].LastTerminationState = terminated(43) }, false},
		{"not injected", func(p *corev1.Pod) { delete(p.Annotations, annotations.Injected) }, false},
		{"being deleted", func(p *corev1.Pod) { p.DeletionTimestamp = &now }, false},
		{"another init container", func(p *corev1.Pod) { p.Status.InitContainerStatuses[0].Name = "migrate" }, false},
		{"no status yet", func(p *corev1.Pod) { p.Status.InitContainerStatuses = nil }, false},
		// Issue 21: the check at the proxy's start (detour.dev/validator: image-volume) fails the
		// proxy container with the validator's code and message; the proxy's own exits do not count.
		{"the proxy's check: crash loop after 42", folded(noRedirect), true},
		{"the proxy's check: terminated 42 now", func(p *corev1.Pod) {
			folded(noRedirect)(p)
			p.Status.InitContainerStatuses[0].State, p.Status.InitContainerStatuses[0].LastTerminationState = p.Status.InitContainerStatuses[0].LastTerminationState, corev1.ContainerState{}
		}, true},
		{"the proxy's check: the proxy runs", func(p *corev1.Pod) {
			folded(noRedirect)(p)
			p.Status.InitContainerStatuses[0].State = corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}
		}, false},
		{"the proxy's own exit 42 after it started", folded("redirect in place: …\n" + validator.StartedMarker + "/usr/bin/proxy\nproxy: fatal\n"), false},
		{"the proxy's own exit 42 without detour's message", folded("proxy: fatal\n"), false},
		{"the validator container of a folded pod", func(p *corev1.Pod) {
			p.Annotations[annotations.Validator] = string(annotations.ValidatorImageVolume)
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := failedPod("p", nil)
			tc.modify(p)
			if got := NeedsRepair(p); got != tc.want {
				t.Errorf("NeedsRepair = %v, want %v", got, tc.want)
			}
		})
	}
}

// A controller restarted after annotating a pod does not act or record an Event again.
func TestSyncAlreadyAnnotated(t *testing.T) {
	p := failedPod("debug", nil)
	p.Annotations[RecreateAnnotation] = "earlier"
	f := newFixture(t, DefaultFlags(), true, p)
	if _, err := f.sync(t, "debug"); err != nil {
		t.Fatal(err)
	}
	if len(f.actions("patch")) != 0 || len(f.events(t)) != 0 {
		t.Errorf("acted on an annotated pod: %v", f.client.Actions())
	}
	if got := value(f.c.metrics.PodsSkipped.WithLabelValues(SkipAlreadyAnnotated)); got != 1 {
		t.Errorf("skipped{already-annotated} = %v", got)
	}
}

// Issue 15.6: only owners known to recreate a deleted pod get it deleted; the pods of owners
// that never recreate one (Argo Workflows, Tekton, Spark, KubeVirt) are annotated with what to
// do instead. The list is configurable. (A Job's pods: TestSyncJobPods.)
func TestSyncDeletesOnlyForRecreatingOwners(t *testing.T) {
	pods := map[string]*metav1.OwnerReference{
		"rs":       owner("apps/v1", "ReplicaSet", "web"),
		"sts":      owner("apps/v1", "StatefulSet", "db"),
		"ds":       owner("apps/v1", "DaemonSet", "agent"),
		"argo":     owner("argoproj.io/v1alpha1", "Workflow", "etl"),
		"tekton":   owner("tekton.dev/v1", "TaskRun", "build"),
		"kubevirt": owner("kubevirt.io/v1", "VirtualMachineInstance", "vm"),
		"fake-rs":  owner("example.com/v1", "ReplicaSet", "x"), // same kind, another group
	}
	for _, tc := range []struct {
		name    string
		owners  []string
		deleted []string
		skip    map[string]string // pod: metric reason
		message map[string]string // pod: part of the annotation
	}{
		{"defaults", DefaultRecreatingOwners, []string{"rs", "sts", "ds"},
			map[string]string{"argo": SkipOwnerNotRecreating, "tekton": SkipOwnerNotRecreating, "kubevirt": SkipOwnerNotRecreating, "fake-rs": SkipOwnerNotRecreating},
			map[string]string{"argo": "Its owner argoproj.io/Workflow etl is not known to recreate deleted pods"}},
		{"configured", []string{"apps/ReplicaSet", "argoproj.io/Workflow"}, []string{"rs", "argo"},
			map[string]string{"sts": SkipOwnerNotRecreating}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var objs []*corev1.Pod
			for name, o := range pods {
				objs = append(objs, failedPod(name, o))
			}
			flags := DefaultFlags()
			flags.RecreatingOwners, flags.Burst = tc.owners, 100
			f := newFixture(t, flags, true, objs...)
			for name := range pods {
				if _, err := f.sync(t, name); err != nil {
					t.Fatal(err)
				}
			}
			var deleted []string
			for _, a := range f.actions("delete") {
				deleted = append(deleted, a.(k8stesting.DeleteActionImpl).Name)
			}
			slices.Sort(deleted)
			want := slices.Sorted(slices.Values(tc.deleted))
			if !slices.Equal(deleted, want) {
				t.Errorf("deleted %v, want %v", deleted, want)
			}
			for name, reason := range tc.skip {
				pod, _ := f.client.CoreV1().Pods("shop").Get(context.Background(), name, metav1.GetOptions{})
				if pod == nil || pod.Annotations[RecreateAnnotation] == "" {
					t.Errorf("%s: not annotated", name)
					continue
				}
				if m := tc.message[name]; m != "" && !strings.Contains(pod.Annotations[RecreateAnnotation], m) {
					t.Errorf("%s: annotation %q lacks %q", name, pod.Annotations[RecreateAnnotation], m)
				}
				if value(f.c.metrics.PodsSkipped.WithLabelValues(reason)) == 0 {
					t.Errorf("%s: skipped{%s} not counted", name, reason)
				}
			}
		})
	}
}

// Issue 32.2: a Job's pod whose check runs again in its sandbox, where it cannot pass, is
// deleted so that its Job replaces it: at the proxy's start the kubelet restarts the check for
// ever (a restartPolicy Never pod never fails, and its Job, or a CronJob's next run under
// concurrencyPolicy Forbid, waits for good); under OnFailure every restart counts against the
// Job's backoffLimit. A Never pod whose validator init container failed is failed by the
// kubelet and replaced by its Job: repair leaves it alone.
func TestSyncJobPods(t *testing.T) {
	for _, tc := range []struct {
		name    string
		policy  corev1.RestartPolicy
		folded  bool
		deleted bool
	}{
		{"the proxy's check, restartPolicy Never", corev1.RestartPolicyNever, true, true},
		{"the proxy's check, restartPolicy OnFailure", corev1.RestartPolicyOnFailure, true, true},
		{"the validator, restartPolicy OnFailure", corev1.RestartPolicyOnFailure, false, true},
		{"the validator, restartPolicy Never", corev1.RestartPolicyNever, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, DefaultFlags(), true, jobPod("report-x1", "report", tc.policy, tc.folded))
			if _, err := f.sync(t, "report-x1"); err != nil {
				t.Fatal(err)
			}
			if n := len(f.actions("patch")); n != 0 {
				t.Errorf("annotated a Job's pod (%d patches)", n)
			}
			deletes, evs := f.actions("delete"), f.events(t)
			if !tc.deleted {
				if len(deletes) != 0 || len(evs) != 0 {
					t.Errorf("%d deletes, events %+v; want none: the kubelet fails the pod and its Job replaces it", len(deletes), evs)
				}
				if got := value(f.c.metrics.PodsSkipped.WithLabelValues(SkipJob)); got != 1 {
					t.Errorf("skipped{job} = %v, want 1", got)
				}
				return
			}
			if len(deletes) != 1 {
				t.Fatalf("%d deletes, want 1", len(deletes))
			}
			if pre := deletes[0].(k8stesting.DeleteActionImpl).DeleteOptions.Preconditions; pre == nil || pre.UID == nil || *pre.UID != "uid-report-x1" {
				t.Errorf("delete preconditions %+v, want the pod's UID", pre)
			}
			if len(evs) != 1 || evs[0].Action != "Delete" || evs[0].Reason != EventReason ||
				!strings.Contains(evs[0].Message, "Deleted the pod so that its Job report replaces it") || !strings.Contains(evs[0].Message, "backoffLimit") {
				t.Errorf("events %+v", evs)
			}
			if value(f.c.metrics.PodsDeleted) != 1 {
				t.Errorf("deleted %v, want 1", value(f.c.metrics.PodsDeleted))
			}
		})
	}
}

// A Job's pods are deleted under the safeguards of every deletion: not before the node is
// ready, and a replacement that fails the same way waits for its Job's backoff.
func TestSyncJobPodSafeguards(t *testing.T) {
	f := newFixture(t, DefaultFlags(), false, jobPod("report-a", "report", corev1.RestartPolicyNever, true))
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	f.c.now = func() time.Time { return now }
	if retry, err := f.sync(t, "report-a"); err != nil || retry <= 0 || len(f.actions("delete")) != 0 {
		t.Fatalf("sync before the node is ready = %v, %v, %d deletes; want a retry later", retry, err, len(f.actions("delete")))
	}
	node, err := f.client.CoreV1().Nodes().Get(context.Background(), "node-1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	node.Labels[annotations.CNIReadyLabel] = "true"
	if _, err := f.client.CoreV1().Nodes().Update(context.Background(), node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	now = now.Add(nodeCheckInterval)
	if _, err := f.sync(t, "report-a"); err != nil || len(f.actions("delete")) != 1 {
		t.Fatalf("sync once the node is ready = %v, %d deletes; want 1", err, len(f.actions("delete")))
	}
	// The Job's replacement fails too: the node is not fixed after all.
	f.add(t, jobPod("report-b", "report", corev1.RestartPolicyNever, true))
	now = now.Add(2 * time.Second)
	if wait, err := f.sync(t, "report-b"); err != nil || wait != ownerBackoffBase-2*time.Second || len(f.actions("delete")) != 1 {
		t.Errorf("sync of the failing replacement = %s, %v, %d deletes; want the owner's backoff (%s)", wait, err, len(f.actions("delete")), ownerBackoffBase-2*time.Second)
	}
	if got := value(f.c.metrics.PodsDeferred.WithLabelValues(DeferOwnerBackoff)); got != 1 {
		t.Errorf("deferred{owner-backoff} = %v, want 1", got)
	}
}

func TestSyncWaitsForNodeReady(t *testing.T) {
	f := newFixture(t, DefaultFlags(), false, failedPod("web-1", rsOwner("web-7d9f")))
	retry, err := f.sync(t, "web-1")
	if err != nil || retry <= 0 {
		t.Fatalf("sync = %v, %v; want a retry later", retry, err)
	}
	if len(f.actions("delete")) != 0 || len(f.events(t)) != 0 {
		t.Error("acted before the node was ready")
	}
	if got := value(f.c.metrics.PodsDeferred.WithLabelValues(DeferNodeNotReady)); got != 1 {
		t.Errorf("deferred{node-not-ready} = %v", got)
	}

	// Without the requirement it acts at once.
	flags := DefaultFlags()
	flags.RequireCNIReady = false
	f = newFixture(t, flags, false, failedPod("web-1", rsOwner("web-7d9f")))
	if _, err := f.sync(t, "web-1"); err != nil || len(f.actions("delete")) != 1 {
		t.Errorf("sync = %v, deletes %d", err, len(f.actions("delete")))
	}
}

// Issue 15.4: after a reboot the ready label is stale until the node agent has put detour's
// entry back; the repair controller tells by the boot ID the label was set for.
func TestSyncWaitsForThisBootsReadiness(t *testing.T) {
	f := newFixture(t, DefaultFlags(), true, failedPod("web-1", rsOwner("web-7d9f")))
	node, _ := f.client.CoreV1().Nodes().Get(context.Background(), "node-1", metav1.GetOptions{})
	node.Annotations = map[string]string{annotations.CNIReadyBootAnnotation: "boot-1"}
	node.Status.NodeInfo.BootID = "boot-2" // rebooted; the agent has not marked this boot yet
	if _, err := f.client.CoreV1().Nodes().Update(context.Background(), node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	f.c.now = func() time.Time { return now }
	if retry, err := f.sync(t, "web-1"); err != nil || retry <= 0 || len(f.actions("delete")) != 0 {
		t.Fatalf("sync on a stale label = %v, %v, %d deletes; want a retry later", retry, err, len(f.actions("delete")))
	}
	node.Annotations[annotations.CNIReadyBootAnnotation] = "boot-2"
	if _, err := f.client.CoreV1().Nodes().Update(context.Background(), node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	now = now.Add(nodeCheckInterval)
	if _, err := f.sync(t, "web-1"); err != nil || len(f.actions("delete")) != 1 {
		t.Fatalf("sync once this boot is marked = %v, %d deletes", err, len(f.actions("delete")))
	}
}

func TestSyncRateLimited(t *testing.T) {
	flags := DefaultFlags()
	flags.Rate, flags.Burst = 0.001, 2 // two now, then one every 1000s
	f := newFixture(t, flags, true, failedPod("a", rsOwner("rs")), failedPod("b", rsOwner("rs")), failedPod("c", rsOwner("rs")))
	var delays []time.Duration
	for _, name := range []string{"a", "b", "c"} {
		d, err := f.sync(t, name)
		if err != nil {
			t.Fatal(err)
		}
		delays = append(delays, d)
	}
	if n := len(f.actions("delete")); n != 2 {
		t.Errorf("%d deletes, want the burst of 2", n)
	}
	if delays[0] != 0 || delays[1] != 0 || delays[2] <= 0 {
		t.Errorf("delays %v, want the third put off", delays)
	}
	if got := value(f.c.metrics.PodsDeferred.WithLabelValues(DeferRateLimited)); got != 1 {
		t.Errorf("deferred{rate-limited} = %v", got)
	}
	if got := value(f.c.metrics.PodsSeen); got != 3 {
		t.Errorf("seen %v, want 3", got)
	}
}
