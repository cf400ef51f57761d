package webhook

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"slices"
	"strings"
	"testing"

	jsonpatch "github.com/evanphx/json-patch/v5"
	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"
	sigsjson "sigs.k8s.io/json"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/inject"
)

func staticNamespaces(a map[string]string) NamespaceLookup {
	return NamespaceLookupFunc(func(context.Context, string) (map[string]string, error) { return a, nil })
}

func request(t testing.TB, op admissionv1.Operation, raw []byte) admission.Request {
	t.Helper()
	return admission.Request{AdmissionRequest: admissionv1.AdmissionRequest{
		UID:       "42",
		Kind:      metaGVK("", "v1", "Pod"),
		Resource:  metaGVR("", "v1", "pods"),
		Namespace: "shop",
		Operation: op,
		Object:    runtime.RawExtension{Raw: raw},
	}}
}

func podJSON(t testing.TB, pod *corev1.Pod) []byte {
	t.Helper()
	pod = pod.DeepCopy()
	pod.APIVersion, pod.Kind = "v1", "Pod"
	b, err := json.Marshal(pod)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// patched reports whether resp carries a patch, encoded or not.
func patched(resp admission.Response) bool { return len(resp.Patch) > 0 || len(resp.Patches) > 0 }

// applyResponse applies the response's patch to raw and decodes the pod.
func applyResponse(t testing.TB, raw []byte, resp admission.Response) *corev1.Pod {
	t.Helper()
	if err := resp.Complete(admission.Request{}); err != nil {
		t.Fatal(err)
	}
	out := raw
	if len(resp.Patch) > 0 {
		p, err := jsonpatch.DecodePatch(resp.Patch)
		if err != nil {
			t.Fatalf("decode the patch: %v", err)
		}
		if out, err = p.Apply(raw); err != nil {
			t.Fatalf("apply the patch: %v", err)
		}
	}
	// Case-sensitive, as the API server decodes.
	var pod corev1.Pod
	if err := sigsjson.UnmarshalCaseSensitivePreserveInts(out, &pod); err != nil {
		t.Fatal(err)
	}
	return &pod
}

func TestHandler(t *testing.T) {
	cfg := testConfig(t, "sidecarMode: container")
	h := NewHandler(cfg, staticNamespaces(optedIn), false)
	ctx := context.Background()

	t.Run("injects and returns the warnings", func(t *testing.T) {
		raw := podJSON(t, testPod([]corev1.Container{runAs("migrate", 0, -1)}, nil, nil))
		resp := h.Handle(ctx, request(t, admissionv1.Create, raw))
		if !resp.Allowed {
			t.Fatalf("denied: %+v", resp.Result)
		}
		if len(resp.Warnings) != 1 || !strings.Contains(resp.Warnings[0], `"migrate" runs as root; it keeps egress through GID 2600`) {
			t.Errorf("warnings = %q", resp.Warnings)
		}
		pod := applyResponse(t, raw, resp)
		if pod.Annotations[annotations.ExemptGIDs] != "2600" || pod.Spec.InitContainers[0].Name != annotations.ValidatorContainer {
			t.Errorf("patched pod: %v %v", pod.Annotations, containerNames(pod.Spec.InitContainers))
		}
		// Admitting the patched pod again changes nothing.
		again := h.Handle(ctx, request(t, admissionv1.Create, podJSON(t, pod)))
		if !again.Allowed || patched(again) {
			t.Errorf("re-admission patched: %s", again.Patch)
		}
	})

	t.Run("fields a newer API server sends survive the patch", func(t *testing.T) {
		raw := []byte(`{"apiVersion":"v1","kind":"Pod","metadata":{"name":"p","futureMeta":1},"spec":{"futureSpec":{"a":1},` +
			`"initContainers":[{"name":"migrate","image":"m","futureField":"x","securityContext":{"runAsUser":0,"futureSC":true}}],` +
			`"containers":[{"name":"app","image":"a","securityContext":{"runAsUser":1000},"futureField":[1,2]}]}}`)
		resp := h.Handle(ctx, request(t, admissionv1.Create, raw))
		if err := resp.Complete(admission.Request{}); err != nil || !resp.Allowed {
			t.Fatalf("response %+v, %v", resp.Result, err)
		}
		p, err := jsonpatch.DecodePatch(resp.Patch)
		if err != nil {
			t.Fatal(err)
		}
		out, err := p.Apply(raw)
		if err != nil {
			t.Fatal(err)
		}
		for _, want := range []string{`"futureMeta":1`, `"futureSpec":{"a":1}`, `"futureField":"x"`, `"futureSC":true`, `"futureField":[1,2]`, `"runAsGroup":2600`} {
			if !strings.Contains(string(out), want) {
				t.Errorf("patched pod lacks %s:\n%s", want, out)
			}
		}
	})

	t.Run("denies with the fix under deny", func(t *testing.T) {
		h := NewHandler(testConfig(t, "conflictPolicy: deny\nsidecarMode: container"), staticNamespaces(optedIn), true)
		resp := h.Handle(ctx, request(t, admissionv1.Create, podJSON(t, testPod(nil, []corev1.Container{runAs("app", inject.DefaultProxyUID, -1)}, nil))))
		if resp.Allowed || resp.Result.Code != http.StatusForbidden || !strings.Contains(resp.Result.Message, "set its securityContext.runAsUser") {
			t.Errorf("response = %v %+v", resp.Allowed, resp.Result)
		}
		if len(resp.Warnings) == 0 {
			t.Error("a denial carries no warnings")
		}
	})

	t.Run("an injected pod in a namespace that is not opted in loses detour's containers", func(t *testing.T) {
		injected := testPod([]corev1.Container{runAs("migrate", 0, -1)}, nil, nil)
		if _, err := inject.Mutate(injected, inject.Input{NamespaceAnnotations: optedIn}, cfg); err != nil {
			t.Fatal(err)
		}
		h := NewHandler(cfg, staticNamespaces(map[string]string{}), false)
		raw := podJSON(t, injected)
		resp := h.Handle(ctx, request(t, admissionv1.Create, raw))
		if !resp.Allowed || len(resp.Warnings) != 1 || !strings.Contains(resp.Warnings[0], "removed its containers") {
			t.Fatalf("response = %v %+v, warnings %q", resp.Allowed, resp.Result, resp.Warnings)
		}
		pod := applyResponse(t, raw, resp)
		if names := append(containerNames(pod.Spec.InitContainers), containerNames(pod.Spec.Containers)...); !slices.Equal(names, []string{"migrate", "app"}) {
			t.Errorf("containers after the skip = %v", names)
		}
		if annotations.IsInjected(pod.Annotations) {
			t.Errorf("the skipped pod keeps the injected marker")
		}
	})

	t.Run("updates pass untouched", func(t *testing.T) {
		resp := h.Handle(ctx, request(t, admissionv1.Update, podJSON(t, testPod(nil, nil, nil))))
		if !resp.Allowed || patched(resp) {
			t.Errorf("update: allowed %v, patch %s", resp.Allowed, resp.Patch)
		}
	})

	t.Run("an unreadable object is refused clearly", func(t *testing.T) {
		resp := h.Handle(ctx, request(t, admissionv1.Create, []byte(`{"kind":"Pod","apiVersion":"v1","spec":{"containers":7}}`)))
		if resp.Allowed || resp.Result.Code != http.StatusBadRequest || !strings.HasPrefix(resp.Result.Message, "detour webhook: the admission request does not hold a pod") {
			t.Errorf("response = %v %+v", resp.Allowed, resp.Result)
		}
	})

	t.Run("a namespace that cannot be read is an error, not a denial", func(t *testing.T) {
		h := NewHandler(cfg, NamespaceLookupFunc(func(context.Context, string) (map[string]string, error) {
			return nil, errors.New("connection refused")
		}), false)
		resp := h.Handle(ctx, request(t, admissionv1.Create, podJSON(t, testPod(nil, nil, nil))))
		if resp.Allowed || resp.Result.Code != http.StatusInternalServerError || !strings.Contains(resp.Result.Message, `read namespace "shop": connection refused`) {
			t.Errorf("response = %v %+v", resp.Allowed, resp.Result)
		}
	})
}

// Random pod JSON: the handler never panics, and every response is an allow (whose patch
// yields a pod the plugin can read, when injected) or a denial with a message.
func FuzzHandler(f *testing.F) {
	cfg := testConfig(f, "sidecarMode: container")
	for _, p := range []*corev1.Pod{
		testPod(nil, nil, nil),
		testPod([]corev1.Container{runAs("migrate", 0, -1), runAs("fetch", 1001, 7), runAs("x", -1, -1)}, nil, nil),
		testPod(nil, nil, map[string]string{annotations.InitEgress: "fetch", annotations.SkipOutboundPorts: "25,8000-8100", annotations.ExemptUIDs: "0"}),
		withPodSecurity(testPod([]corev1.Container{runAs("a", -1, -1)}, nil, nil), corev1.PodSecurityContext{RunAsUser: ptr(int64(0)), FSGroup: ptr(int64(2600))}),
	} {
		f.Add(podJSON(f, p), false)
	}
	f.Add([]byte(`{"apiVersion":"v1","kind":"Pod","spec":{"initContainers":[{"name":"a","securityContext":{"runAsUser":-5}}]}}`), true)
	f.Add([]byte(`{"apiVersion":"v1","kind":"Pod","metadata":{"annotations":{"detour.dev/sidecar-mode":"native"}}}`), true)
	f.Add([]byte(`null`), false)
	f.Fuzz(func(t *testing.T, raw []byte, native bool) {
		h := NewHandler(cfg, staticNamespaces(optedIn), native)
		resp := h.Handle(context.Background(), request(t, admissionv1.Create, raw))
		if !resp.Allowed {
			if resp.Result == nil || resp.Result.Message == "" || resp.Result.Code < 400 || resp.Result.Code >= 500 {
				t.Fatalf("refusal without a clear message: %+v", resp.Result)
			}
			return
		}
		if !patched(resp) {
			return
		}
		pod := applyResponse(t, raw, resp)
		if _, err := annotations.ParseRedirect(pod.Annotations); err != nil {
			t.Fatalf("injected pod's annotations do not parse: %v", err)
		}
		// detour's typed patch yields the same pod as controller-runtime's whole-document diff.
		cr := withDefaulter(h).Handle(context.Background(), request(t, admissionv1.Create, raw))
		if want := applyResponse(t, raw, cr); !equality.Semantic.DeepEqual(pod, want) {
			t.Fatalf("the typed patch and the document diff disagree:\n%s", diffPods(t, want, pod))
		}
	})
}

// oracle is the handler's mutation as controller-runtime's typed defaulter: the fuzz test and
// the benchmarks hold the handler to admission.WithDefaulter's answers.
type oracle struct{ h *Handler }

func (o oracle) Default(ctx context.Context, pod *corev1.Pod) error {
	req, err := admission.RequestFromContext(ctx)
	if err != nil {
		return err
	}
	_, err = o.h.mutate(ctx, req, pod)
	return err
}

// withDefaulter serves h's mutation through admission.WithDefaulter.
func withDefaulter(h *Handler) admission.Handler {
	scheme := runtime.NewScheme()
	if err := corev1.AddToScheme(scheme); err != nil {
		panic(err)
	}
	return admission.WithDefaulter[*corev1.Pod](scheme, oracle{h}).Handler
}

func metaGVK(group, version, kind string) metav1.GroupVersionKind {
	return metav1.GroupVersionKind{Group: group, Version: version, Kind: kind}
}

func metaGVR(group, version, resource string) metav1.GroupVersionResource {
	return metav1.GroupVersionResource{Group: group, Version: version, Resource: resource}
}
