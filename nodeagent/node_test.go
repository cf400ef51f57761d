package nodeagent_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/nodeagent"
)

func TestNodeReadiness(t *testing.T) {
	node := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: "node-1", ResourceVersion: "7", Labels: map[string]string{"zone": "a"}},
		Spec: corev1.NodeSpec{Taints: []corev1.Taint{
			{Key: "node.kubernetes.io/not-ready", Effect: corev1.TaintEffectNoSchedule},
			{Key: annotations.CNINotReadyTaint, Value: "true", Effect: corev1.TaintEffectNoSchedule},
			{Key: annotations.CNINotReadyTaint, Effect: corev1.TaintEffectNoExecute},
		}},
		Status: corev1.NodeStatus{NodeInfo: corev1.NodeSystemInfo{KubeletVersion: "v1.37.2", ContainerRuntimeVersion: "containerd://2.4.2"}},
	}
	client := fake.NewClientset(node)
	// The first patch meets a concurrent change: the agent reads again and retries.
	conflicts := 1
	var patches []string
	client.PrependReactor("patch", "nodes", func(action k8stesting.Action) (bool, runtime.Object, error) {
		patches = append(patches, string(action.(k8stesting.PatchAction).GetPatch()))
		if conflicts > 0 {
			conflicts--
			return true, nil, apierrors.NewConflict(schema.GroupResource{Resource: "nodes"}, "node-1", errors.New("the object has been modified"))
		}
		return false, nil, nil
	})
	e := newEnv(t)
	e.flags.NodeName = "node-1"
	a := e.agent(t, nodeagent.WithNodeClient(client))

	// No config yet: the node is left alone.
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if len(patches) != 0 {
		t.Fatalf("patched the node before the config was in place: %v", patches)
	}
	writeFile(t, filepath.Join(e.confDir, "10-calico.conflist"), calico)
	s, err := a.Reconcile(context.Background())
	if err != nil || !s.NodeReady {
		t.Fatalf("Reconcile = %+v, %v", s, err)
	}
	got, _ := client.CoreV1().Nodes().Get(context.Background(), "node-1", metav1.GetOptions{})
	if len(got.Spec.Taints) != 1 || got.Spec.Taints[0].Key != "node.kubernetes.io/not-ready" {
		t.Errorf("taints %v, want only node.kubernetes.io/not-ready", got.Spec.Taints)
	}
	// The node mounts image volumes (kubelet 1.37, containerd 2.4): labelled in the same patch.
	if got.Labels[annotations.CNIReadyLabel] != "true" || got.Labels["zone"] != "a" || got.Labels[annotations.ImageVolumesLabel] != "true" {
		t.Errorf("labels %v", got.Labels)
	}
	if len(patches) != 2 || !strings.Contains(patches[0], `"resourceVersion":"7"`) {
		t.Errorf("patches %v: want a conflicting one carrying the resourceVersion, then a retry", patches)
	}
	// Ready already: the node is not read or patched on every resync.
	gets := 0
	for _, act := range client.Actions() {
		if act.GetVerb() == "get" {
			gets++
		}
	}
	if _, err := a.Reconcile(context.Background()); err != nil || len(patches) != 2 || len(client.Actions()) != gets+len(patches) {
		t.Errorf("a resync of a ready node called the API: %v, %v", client.Actions(), err)
	}
	// Issue 15.4: the config goes away after the first readiness (a reboot where the primary
	// writes its file first, an operator's mistake): the label follows, once; the taint is
	// not put back.
	os.Remove(filepath.Join(e.confDir, "10-calico.conflist"))
	for range 3 {
		if s, _ := a.Reconcile(context.Background()); s.NodeReady || s.ConfigInPlace {
			t.Errorf("status without config %+v", s)
		}
	}
	got, _ = client.CoreV1().Nodes().Get(context.Background(), "node-1", metav1.GetOptions{})
	// The image volumes label describes the node's software: it stays (the kubelet admits the
	// running pods that select it again when it restarts).
	if _, ok := got.Labels[annotations.CNIReadyLabel]; ok || got.Labels["zone"] != "a" || got.Labels[annotations.ImageVolumesLabel] != "true" || len(got.Spec.Taints) != 1 {
		t.Errorf("without the config: labels %v taints %v; want the ready label gone, the rest kept", got.Labels, got.Spec.Taints)
	}
	if len(patches) != 3 {
		t.Errorf("patches %v: want one removing the label, not one per resync", patches)
	}
	rec := httptest.NewRecorder()
	a.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/readyz", nil))
	if rec.Code != http.StatusServiceUnavailable {
		t.Errorf("/readyz without the config = %d %s", rec.Code, rec.Body)
	}
	writeFile(t, filepath.Join(e.confDir, "10-calico.conflist"), calico)
	before := len(client.Actions())
	if s, err := a.Reconcile(context.Background()); err != nil || !s.NodeReady || len(client.Actions()) != before+2 {
		t.Errorf("config back: %+v, %v, %d new API calls (want a get and a patch)", s, err, len(client.Actions())-before)
	}
	got, _ = client.CoreV1().Nodes().Get(context.Background(), "node-1", metav1.GetOptions{})
	if got.Labels[annotations.CNIReadyLabel] != "true" {
		t.Errorf("config back: labels %v", got.Labels)
	}
	rec = httptest.NewRecorder()
	a.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/readyz", nil))
	if rec.Code != 200 {
		t.Errorf("/readyz = %d %s", rec.Code, rec.Body)
	}
}

// Issue 15.4: the ready label carries the boot it holds for; after a reboot the agent, started
// again, marks the new boot (readers tell a stale label by the boot ID).
func TestNodeReadinessMarksTheBoot(t *testing.T) {
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}, Status: corev1.NodeStatus{NodeInfo: corev1.NodeSystemInfo{BootID: "boot-1"}}}
	client := fake.NewClientset(node)
	e := newEnv(t)
	e.flags.NodeName = "node-1"
	writeFile(t, filepath.Join(e.confDir, "10-calico.conflist"), calico)
	if _, err := e.agent(t, nodeagent.WithNodeClient(client)).Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	got, _ := client.CoreV1().Nodes().Get(context.Background(), "node-1", metav1.GetOptions{})
	if got.Labels[annotations.CNIReadyLabel] != "true" || got.Annotations[annotations.CNIReadyBootAnnotation] != "boot-1" {
		t.Fatalf("labels %v annotations %v", got.Labels, got.Annotations)
	}
	// Reboot: the kubelet reports a new boot ID; the label is still there.
	got.Status.NodeInfo.BootID = "boot-2"
	client.CoreV1().Nodes().Update(context.Background(), got, metav1.UpdateOptions{})
	if _, err := e.agent(t, nodeagent.WithNodeClient(client)).Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	got, _ = client.CoreV1().Nodes().Get(context.Background(), "node-1", metav1.GetOptions{})
	if got.Annotations[annotations.CNIReadyBootAnnotation] != "boot-2" {
		t.Errorf("after the reboot: annotations %v, want boot-2", got.Annotations)
	}
}

func TestReadyzNotReady(t *testing.T) {
	e := newEnv(t)
	a := e.agent(t)
	a.Reconcile(context.Background())
	rec := httptest.NewRecorder()
	a.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/readyz", nil))
	if rec.Code != http.StatusServiceUnavailable || !strings.Contains(rec.Body.String(), "waiting for the primary CNI") {
		t.Errorf("/readyz = %d %q", rec.Code, rec.Body)
	}
	rec = httptest.NewRecorder()
	a.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/healthz", nil))
	if rec.Code != 200 {
		t.Errorf("/healthz = %d", rec.Code)
	}
}
