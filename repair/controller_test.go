package repair

import (
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/detourmesh/detour/annotations"
)

// Run feeds the queue from the informer: a pod that fails after the controller started is
// repaired without a direct call.
func TestRun(t *testing.T) {
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1", Labels: map[string]string{annotations.CNIReadyLabel: "true"}}})
	ctx := runController(t, newNodeController(t, client))
	pod := failedPod("web-1", rsOwner("web-7d9f"))
	if _, err := client.CoreV1().Pods("shop").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, err := client.CoreV1().Pods("shop").Get(ctx, "web-1", metav1.GetOptions{}); apierrors.IsNotFound(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the failed pod was not deleted")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A pod whose check at the proxy's start exits 43 reaches the controller through the informer
// too: it gets its Event and stays.
func TestRunReportsCheckPortInUse(t *testing.T) {
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1", Labels: map[string]string{annotations.CNIReadyLabel: "true"}}})
	ctx := runController(t, newNodeController(t, client))
	pod := failedPod("web-1", rsOwner("web-7d9f"))
	folded(portTakenLog)(pod)
	pod.Status.InitContainerStatuses[0].LastTerminationState.Terminated.ExitCode = 43
	if _, err := client.CoreV1().Pods("shop").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		evs, err := client.CoreV1().Events("shop").List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if len(evs.Items) > 0 {
			if evs.Items[0].Reason != CheckPortEventReason {
				t.Errorf("Event reason %q, want %q", evs.Items[0].Reason, CheckPortEventReason)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no Event for the pod whose check port is taken")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, err := client.CoreV1().Pods("shop").Get(ctx, "web-1", metav1.GetOptions{}); err != nil {
		t.Errorf("the pod is gone: %v", err)
	}
}
