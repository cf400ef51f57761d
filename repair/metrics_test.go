package repair

import (
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/detourmesh/detour/annotations"
)

func TestHandler(t *testing.T) {
	f := newFixture(t, DefaultFlags(), true, failedPod("web-1", rsOwner("web-7d9f")))
	f.sync(t, "web-1")
	rec := httptest.NewRecorder()
	f.c.Handler(f.reg).ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	for _, want := range []string{"detour_repair_pods_seen_total 1", "detour_repair_pods_deleted_total 1", `detour_repair_pods_skipped_total{reason="no-controller"} 0`, `detour_repair_pods_skipped_total{reason="check-port-in-use"} 0`, `detour_repair_errors_total{action="delete"} 0`,
		`detour_repair_errors_total{action="save-backoff"} 0`} {
		if !strings.Contains(rec.Body.String(), want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	rec = httptest.NewRecorder()
	f.c.Handler(f.reg).ServeHTTP(rec, httptest.NewRequest("GET", "/readyz", nil))
	if rec.Code != 200 {
		t.Errorf("/readyz = %d", rec.Code)
	}
}

// detour_repair_pods counts the node's pods by state, from the caches: injected, caught
// (injected, no redirect; issue 32.5: also while the check runs again, so that a pod in
// Init:CrashLoopBackOff stays caught through its retries), and uninjected though opted in (by
// the pod or its namespace, read as the webhook reads them, or, with the webhook's defaultInject
// enabled, by neither saying otherwise).
func TestPodStates(t *testing.T) {
	for _, tc := range []struct {
		defaultInject string
		uninjected    float64
	}{
		{"disabled", 4}, // missed, own-opt-in, spaced, in-padded
		{"enabled", 5},  // and plain, whose namespace says nothing
	} {
		t.Run("defaultInject "+tc.defaultInject, func(t *testing.T) {
			testPodStates(t, tc.defaultInject, tc.uninjected)
		})
	}
}

func testPodStates(t *testing.T, defaultInject string, uninjected float64) {
	pod := func(name, ns string, annots map[string]string, mutate ...func(*corev1.Pod)) *corev1.Pod {
		p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, UID: types.UID("uid-" + name), Annotations: annots},
			Spec: corev1.PodSpec{NodeName: "node-1"}, Status: corev1.PodStatus{Phase: corev1.PodRunning}}
		for _, m := range mutate {
			m(p)
		}
		return p
	}
	enabled := map[string]string{annotations.Inject: "enabled"}
	disabled := map[string]string{annotations.Inject: "disabled"}
	objs := []runtime.Object{
		&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}}, // not ready: nothing is repaired
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Annotations: enabled}},
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "plain"}},
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "off", Annotations: disabled}},
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "kube-public"}},
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "detour-system"}},
		&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "padded", Annotations: map[string]string{annotations.Inject: " enabled"}}},
		pod("meshed", "shop", injected),
		failedPod("caught", nil),
		// The check runs again after it found no redirect: still caught.
		retrying(failedPod("retrying", nil)),
		retrying(foldedPod("proxy-retrying")),
		// The proxy started after its check failed once: it passed, not caught.
		healed(foldedPod("healed")),
		pod("spaced", "plain", map[string]string{annotations.Inject: "enabled\n"}),
		pod("in-padded", "padded", nil),
		pod("missed", "shop", nil),
		pod("opted-out", "shop", disabled),
		pod("own-opt-in", "plain", enabled),
		pod("plain", "plain", nil),
		pod("off", "off", nil),
		pod("host", "shop", nil, func(p *corev1.Pod) { p.Spec.HostNetwork = true }),
		pod("done", "shop", nil, func(p *corev1.Pod) { p.Status.Phase = corev1.PodSucceeded }),
		// Pods the webhook never injects, whatever they ask for.
		pod("mirror", "shop", map[string]string{corev1.MirrorPodAnnotationKey: "x"}),
		pod("system", "kube-system", enabled),
		pod("public", "kube-public", nil), // excluded (the webhook's default excludeNamespaces)
		pod("own", "detour-system", nil),  // detour's own namespace (--namespace)
		pod("ours", "shop", nil, func(p *corev1.Pod) { p.Labels = map[string]string{"app.kubernetes.io/part-of": "detour"} }),
	}
	c := newNodeController(t, fake.NewClientset(objs...), func(f *Flags) { f.DefaultInject, f.OwnNamespace = defaultInject, "detour-system" })
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c.Collector())
	if families, err := reg.Gather(); err != nil || len(families) != 0 {
		t.Fatalf("before the caches synced: %v, %v; want nothing", families, err)
	}
	runController(t, c)
	want := map[string]float64{StateInjected: 5, StateCaught: 3, StateUninjected: uninjected}
	deadline := time.Now().Add(20 * time.Second)
	for {
		got := map[string]float64{}
		families, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range families {
			for _, m := range f.GetMetric() {
				got[m.GetLabel()[0].GetValue()] = m.GetGauge().GetValue()
			}
		}
		if len(got) > 0 {
			for state, n := range want {
				if got[state] != n {
					t.Errorf("detour_repair_pods{state=%q} = %v, want %v", state, got[state], n)
				}
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the caches did not sync")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
