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
