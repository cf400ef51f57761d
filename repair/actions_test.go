package repair

import (
	"context"
	"errors"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	k8stesting "k8s.io/client-go/testing"

	"github.com/detourmesh/detour/annotations"
)

func TestSyncDeletesControllerOwnedPod(t *testing.T) {
	f := newFixture(t, DefaultFlags(), true, failedPod("web-1", rsOwner("web-7d9f")))
	if _, err := f.sync(t, "web-1"); err != nil {
		t.Fatal(err)
	}
	deletes := f.actions("delete")
	if len(deletes) != 1 {
		t.Fatalf("%d deletes, want 1", len(deletes))
	}
	pre := deletes[0].(k8stesting.DeleteActionImpl).DeleteOptions.Preconditions
	if pre == nil || pre.UID == nil || *pre.UID != "uid-web-1" {
		t.Errorf("delete preconditions %+v, want the pod's UID", pre)
	}
	evs := f.events(t)
	if len(evs) != 1 || evs[0].Reason != EventReason || evs[0].InvolvedObject.UID != "uid-web-1" || evs[0].Action != "Delete" ||
		!strings.Contains(evs[0].Message, "its ReplicaSet web-7d9f recreates it") {
		t.Errorf("events %+v", evs)
	}
	if value(f.c.metrics.PodsSeen) != 1 || value(f.c.metrics.PodsDeleted) != 1 {
		t.Errorf("seen %v deleted %v", value(f.c.metrics.PodsSeen), value(f.c.metrics.PodsDeleted))
	}
	// Seen again (the informer still shows it, or an update arrives): no second action or Event.
	if _, err := f.sync(t, "web-1"); err != nil {
		t.Fatal(err)
	}
	if len(f.actions("delete")) != 1 || len(f.events(t)) != 1 || value(f.c.metrics.PodsSeen) != 1 {
		t.Errorf("acted twice on one pod")
	}
}

func TestSyncAnnotatesBarePod(t *testing.T) {
	f := newFixture(t, DefaultFlags(), true, failedPod("debug", nil))
	if _, err := f.sync(t, "debug"); err != nil {
		t.Fatal(err)
	}
	if n := len(f.actions("delete")); n != 0 {
		t.Fatalf("deleted a bare pod (%d deletes)", n)
	}
	pod, _ := f.client.CoreV1().Pods("shop").Get(context.Background(), "debug", metav1.GetOptions{})
	if v := pod.Annotations[RecreateAnnotation]; !strings.Contains(v, "delete it and create it again") {
		t.Errorf("annotation %q", v)
	}
	evs := f.events(t)
	if len(evs) != 1 || evs[0].Action != "Annotate" || evs[0].Type != corev1.EventTypeWarning {
		t.Errorf("events %+v", evs)
	}
	if got := value(f.c.metrics.PodsSkipped.WithLabelValues(SkipNoController)); got != 1 {
		t.Errorf("skipped{no-controller} = %v", got)
	}
}

func TestSyncErrors(t *testing.T) {
	f := newFixture(t, DefaultFlags(), true, failedPod("web-1", rsOwner("web-7d9f")), failedPod("web-2", rsOwner("web-7d9f")))
	failures := 1
	f.client.PrependReactor("delete", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if failures > 0 {
			failures--
			return true, nil, apierrors.NewInternalError(errors.New("etcd is sad"))
		}
		if a.(k8stesting.DeleteAction).GetName() == "web-2" {
			return true, nil, apierrors.NewConflict(schema.GroupResource{Resource: "pods"}, "web-2", errors.New("Precondition failed: UID in precondition"))
		}
		return false, nil, nil
	})
	if _, err := f.sync(t, "web-1"); err == nil || !strings.Contains(err.Error(), "delete pod shop/web-1") {
		t.Fatalf("sync = %v, want the delete error", err)
	}
	if got := value(f.c.metrics.Errors.WithLabelValues(ActionDelete)); got != 1 {
		t.Errorf("errors{delete} = %v", got)
	}
	// The retry succeeds; the pod is counted seen once.
	if _, err := f.sync(t, "web-1"); err != nil {
		t.Fatal(err)
	}
	if value(f.c.metrics.PodsDeleted) != 1 || value(f.c.metrics.PodsSeen) != 1 || len(f.events(t)) != 1 {
		t.Errorf("after retry: deleted %v seen %v events %d", value(f.c.metrics.PodsDeleted), value(f.c.metrics.PodsSeen), len(f.events(t)))
	}
	// Replaced under the same name (UID precondition fails): skipped, no Event.
	if _, err := f.sync(t, "web-2"); err != nil {
		t.Fatal(err)
	}
	if got := value(f.c.metrics.PodsSkipped.WithLabelValues(SkipGone)); got != 1 || len(f.events(t)) != 1 {
		t.Errorf("skipped{gone} = %v, events %d", got, len(f.events(t)))
	}
}

// portTakenLog is the log's end of a check at the proxy's start whose port a container holds.
const portTakenLog = "detour: port 4142 is taken by a socket listening on 0.0.0.0:4142 owned by uid 1000, not by the proxy (uid 2102): a container of this pod listens on the port where the redirect check at the proxy's start listens (validator.checkPort). …\n"

// A pod whose check found its port taken by a container of the pod (exit 43) is not deleted —
// a new pod would pass the check only until its proxy restarts again — but gets one Warning
// Event, DetourCheckPortInUse, with the check's message and the fix; counted as skipped
// check-port-in-use. Seen again, or by a restarted controller, it gets no second Event.
func TestSyncReportsCheckPortInUse(t *testing.T) {
	atStart := func(name string, owner *metav1.OwnerReference) *corev1.Pod {
		p := failedPod(name, owner)
		folded(portTakenLog)(p)
		p.Status.InitContainerStatuses[0].LastTerminationState.Terminated.ExitCode = 43
		p.Annotations[annotations.ValidatorCheckPort] = "4142"
		return p
	}
	inValidator := failedPod("batch-1", rsOwner("batch-7d9f"))
	inValidator.Status.InitContainerStatuses[0].LastTerminationState = terminated(43)
	noMessage := atStart("web-3", nil)
	noMessage.Status.InitContainerStatuses[0].LastTerminationState.Terminated.Message = "detour: \n"
	for _, tc := range []struct {
		name string
		pod  *corev1.Pod
		want []string // parts of the Event's message
	}{
		{"at the proxy's start, a ReplicaSet's pod", atStart("web-1", rsOwner("web-7d9f")), []string{
			"detour-proxy exited with code 43 on node node-1: port 4142 is taken by a socket listening on 0.0.0.0:4142 owned by uid 1000, not by the proxy (uid 2102)",
			"Detour does not recreate the pod: a new one would pass the check only until its proxy restarts again.",
			"move the port of the container that listens on the check port (4142), or have the cluster admin set the webhook's validator.checkPort"}},
		{"at the proxy's start, a bare pod", atStart("web-2", nil), []string{"owned by uid 1000", "validator.checkPort"}},
		{"the message not in the status", noMessage, []string{"kubectl -n shop logs web-3 -c detour-proxy --previous"}},
		{"the validator container", inValidator, []string{"detour-validator exited with code 43 on node node-1: its message is not in the container's termination message",
			"a new one would fail the same way", "keep detour-validator the first init container"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, DefaultFlags(), true, tc.pod)
			for range 2 {
				if _, err := f.sync(t, tc.pod.Name); err != nil {
					t.Fatal(err)
				}
			}
			if n := len(f.actions("delete")) + len(f.actions("patch")); n != 0 {
				t.Errorf("acted on the pod (%d deletes and patches): %v", n, f.client.Actions())
			}
			evs := f.events(t)
			if len(evs) != 1 {
				t.Fatalf("%d Events, want 1: %+v", len(evs), evs)
			}
			ev := evs[0]
			if ev.Reason != CheckPortEventReason || ev.Type != corev1.EventTypeWarning || ev.InvolvedObject.UID != tc.pod.UID ||
				ev.InvolvedObject.FieldPath != "spec.initContainers{"+tc.pod.Status.InitContainerStatuses[0].Name+"}" {
				t.Errorf("Event %+v", ev)
			}
			for _, w := range tc.want {
				if !strings.Contains(ev.Message, w) {
					t.Errorf("Event message\n%s\nlacks\n%s", ev.Message, w)
				}
			}
			if got := value(f.c.metrics.PodsSkipped.WithLabelValues(SkipCheckPortInUse)); got != 1 {
				t.Errorf("skipped{check-port-in-use} = %v, want 1", got)
			}
			if value(f.c.metrics.PodsSeen) != 0 {
				t.Errorf("counted in pods_seen, which counts exit 42")
			}

			// A restarted controller finds the Event there (its name is the pod's UID's).
			again := newFixture(t, DefaultFlags(), true, tc.pod)
			again.client.Tracker().Add(&ev)
			if _, err := again.sync(t, tc.pod.Name); err != nil {
				t.Fatal(err)
			}
			if evs := again.events(t); len(evs) != 1 {
				t.Errorf("after a restart: %d Events, want 1", len(evs))
			}
		})
	}
}

// An Event that could not be recorded is retried (it is the only thing repair does for such a
// pod), and counted in errors{event}.
func TestSyncCheckPortInUseEventFails(t *testing.T) {
	p := failedPod("web-1", nil)
	folded(portTakenLog)(p)
	p.Status.InitContainerStatuses[0].LastTerminationState.Terminated.ExitCode = 43
	f := newFixture(t, DefaultFlags(), true, p)
	failures := 1
	f.client.PrependReactor("create", "events", func(k8stesting.Action) (bool, runtime.Object, error) {
		if failures > 0 {
			failures--
			return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "events"}, "", errors.New("no"))
		}
		return false, nil, nil
	})
	if _, err := f.sync(t, "web-1"); err == nil || !strings.Contains(err.Error(), "needs create on events") {
		t.Fatalf("sync = %v, want the Event's error", err)
	}
	if value(f.c.metrics.Errors.WithLabelValues(ActionEvent)) != 1 || value(f.c.metrics.PodsSkipped.WithLabelValues(SkipCheckPortInUse)) != 0 {
		t.Errorf("errors{event} %v, skipped{check-port-in-use} %v", value(f.c.metrics.Errors.WithLabelValues(ActionEvent)), value(f.c.metrics.PodsSkipped.WithLabelValues(SkipCheckPortInUse)))
	}
	if _, err := f.sync(t, "web-1"); err != nil || len(f.events(t)) != 1 {
		t.Errorf("the retry: %v, %d Events", err, len(f.events(t)))
	}
}
