package webhook

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"

	jsonpatch "github.com/evanphx/json-patch/v5"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	toolscache "k8s.io/client-go/tools/cache"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"
	sigsjson "sigs.k8s.io/json"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/inject"
	"github.com/detourmesh/detour/webhook/internal/fastpath"
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
	// In native mode, the check in the proxy's start: volumes and the node selector change too.
	folded := NewValidatorModes(foldingConfig(f), "v1.37.2", slog.New(slog.DiscardHandler), nil)
	withVolumes := testPod(nil, nil, nil)
	withVolumes.Spec.Volumes = []corev1.Volume{{Name: "data"}, {Name: annotations.ValidatorVolume}}
	withVolumes.Spec.NodeSelector = map[string]string{"zone": "a", annotations.ImageVolumesLabel: "true"}
	for _, p := range []*corev1.Pod{
		testPod(nil, nil, nil),
		testPod([]corev1.Container{runAs("migrate", 0, -1), runAs("fetch", 1001, 7), runAs("x", -1, -1)}, nil, nil),
		testPod(nil, nil, map[string]string{annotations.InitEgress: "fetch", annotations.SkipOutboundPorts: "25,8000-8100", annotations.ExemptUIDs: "0"}),
		withPodSecurity(testPod([]corev1.Container{runAs("a", -1, -1)}, nil, nil), corev1.PodSecurityContext{RunAsUser: ptr(int64(0)), FSGroup: ptr(int64(2600))}),
		withVolumes,
		testPod(nil, nil, map[string]string{annotations.ValidatorMode: "init-container"}),
	} {
		f.Add(podJSON(f, p), false)
		f.Add(podJSON(f, p), true)
	}
	f.Add([]byte(`{"apiVersion":"v1","kind":"Pod","spec":{"initContainers":[{"name":"a","securityContext":{"runAsUser":-5}}]}}`), true)
	f.Add([]byte(`{"apiVersion":"v1","kind":"Pod","metadata":{"annotations":{"detour.dev/sidecar-mode":"native"}}}`), true)
	f.Add([]byte(`{"apiVersion":"v1","kind":"Pod","metadata":{"annotations":{"detour.dev/injected":"v1"}},"spec":{"nodeSelector":{"detour.dev/image-volumes":"true"},"volumes":[{"name":"detour-validator","image":{"reference":"x"}}]}}`), true)
	f.Add([]byte(`null`), false)
	f.Fuzz(func(t *testing.T, raw []byte, native bool) {
		h := NewHandler(cfg, staticNamespaces(optedIn), native)
		if native {
			h = NewHandler(folded.cfg, staticNamespaces(optedIn), true, WithValidatorModes(folded))
		}
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

// foldingConfig runs the validator's check in the proxy's start (validator.mode image-volume).
func foldingConfig(t testing.TB) *inject.Config {
	t.Helper()
	cfg, err := inject.ParseConfig([]byte(`
proxy: {image: proxy:test, command: [proxy], startupProbe: {tcpSocket: {port: 4191}}}
validator: {mode: image-volume}
`))
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// The folded form's patch — the proxy first without a validator, detour's image volume, the
// node selector — comes from the typed patch, not the whole-document diff that costs most of an
// admission (docs/benchmarks-webhook.md).
func TestFoldedPatchIsTyped(t *testing.T) {
	cfg := foldingConfig(t)
	pod := benchPod(t)
	pod.Spec.NodeSelector = map[string]string{"zone": "a"}
	delete(pod.Annotations, annotations.SidecarMode) // the proxy as a native sidecar
	orig := pod.DeepCopy()
	res, err := inject.Mutate(pod, inject.Input{NamespaceAnnotations: optedIn, NativeSidecars: true, Validator: annotations.ValidatorImageVolume}, cfg)
	if err != nil || res.Validator != annotations.ValidatorImageVolume {
		t.Fatalf("Mutate = %+v, %v", res, err)
	}
	ops, ok := fastpath.Patch(orig, pod, podJSON(t, orig))
	if !ok {
		t.Fatal("the typed patch declined the folded form")
	}
	var paths []string
	for _, op := range ops {
		paths = append(paths, op.Operation+" "+op.Path)
	}
	for _, want := range []string{"add /spec/nodeSelector/detour.dev~1image-volumes", "add /spec/volumes/" + strconv.Itoa(len(orig.Spec.Volumes)), "add /spec/initContainers/0"} {
		if !slices.Contains(paths, want) {
			t.Errorf("patch %v lacks %q", paths, want)
		}
	}
}

// The decision follows the nodes' image-volume labels (issue 34): a node without it joining
// turns auto to the init container with a reason that names it and why (its kubelet's
// version); the node upgraded in place counts once its agent labels it, and a downgrade that
// takes the label off turns auto back; a Windows node does not count; a status update that
// changes nothing decides nothing; the API server's gate off, or unknown, is the init
// container; the gauge shows the mode.
func TestValidatorModesFollowTheNodes(t *testing.T) {
	cfg, err := inject.ParseConfig([]byte("proxy: {image: proxy:test, command: [proxy], startupProbe: {tcpSocket: {port: 4191}}}"))
	if err != nil {
		t.Fatal(err)
	}
	gauge := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "g"}, []string{"mode"})
	var logs strings.Builder
	v := NewValidatorModes(cfg, "v1.37.2", slog.New(slog.NewTextHandler(&logs, nil)), gauge)
	node := func(name, kubelet string, labelled bool, os string) *corev1.Node {
		n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{corev1.LabelOSStable: os}},
			Status: corev1.NodeStatus{NodeInfo: corev1.NodeSystemInfo{KubeletVersion: kubelet, ContainerRuntimeVersion: "containerd://2.4.2"}}}
		if labelled {
			n.Labels[annotations.ImageVolumesLabel] = "true"
		}
		got, err := nodeImageVolumes(n) // what the cache holds
		if err != nil {
			t.Fatal(err)
		}
		return got.(*corev1.Node)
	}
	value := func(mode string) float64 {
		var m dto.Metric
		if err := gauge.WithLabelValues(mode).Write(&m); err != nil {
			t.Fatal(err)
		}
		return m.GetGauge().GetValue()
	}
	mode := func() string {
		return string(v.Current().Mode) + fmt.Sprintf(" %v/%v", value("image-volume"), value("init-container"))
	}
	want := func(what, wantMode, because string) {
		t.Helper()
		if got := mode(); got != wantMode || !strings.Contains(v.Current().Reason, because) {
			t.Errorf("%s: %s (%s), want %s because %q", what, got, v.Current().Reason, wantMode, because)
		}
	}
	h := v.Handler()
	want("before the gate is read", "init-container 0/1", "cannot tell whether the API server keeps image volumes (not read yet)")
	v.SetAPIServerGate(inject.GateOn, "")
	want("without nodes", "init-container 0/1", "no node has registered yet")
	h.OnAdd(node("a", "v1.37.2", true, "linux"), true)
	h.OnAdd(node("b", "v1.37.2", true, "linux"), true)
	want("two labelled nodes", "image-volume 1/0", "every node (2)")
	h.OnAdd(node("win", "v1.37.2", false, "windows"), false)
	want("a Windows node joined", "image-volume 1/0", "every node (2)")
	h.OnAdd(node("old", "v1.34.2", false, "linux"), false)
	want("an old node joined", "init-container 0/1", "1 of 3 nodes do not carry detour.dev/image-volumes=true: old: the kubelet v1.34.2")
	before := logs.Len()
	h.OnUpdate(node("old", "v1.34.2", false, "linux"), node("old", "v1.34.2", false, "linux"))
	if logs.Len() != before {
		t.Errorf("a status update that changes nothing logged: %s", logs.String()[before:])
	}
	h.OnUpdate(node("old", "v1.34.2", false, "linux"), node("old", "v1.35.1", false, "linux")) // its kubelet upgraded in place
	want("the old node upgraded, not labelled yet", "init-container 0/1", "old: no node agent labelled it")
	h.OnUpdate(node("old", "v1.35.1", false, "linux"), node("old", "v1.35.1", true, "linux")) // its agent labelled it
	want("the upgraded node labelled", "image-volume 1/0", "every node (3)")
	h.OnUpdate(node("old", "v1.35.1", true, "linux"), node("old", "v1.34.2", false, "linux")) // downgraded: the agent took the label off
	want("the node downgraded", "init-container 0/1", "old: the kubelet v1.34.2")
	h.OnDelete(toolscache.DeletedFinalStateUnknown{Key: "old", Obj: node("old", "v1.34.2", false, "linux")})
	want("the old node left", "image-volume 1/0", "every node (2)")
	v.SetAPIServerGate(inject.GateOff, "")
	want("the API server's gate off", "init-container 0/1", "has its ImageVolume feature gate off")
	if !strings.Contains(logs.String(), "mode=image-volume") || !strings.Contains(logs.String(), "mode=init-container") {
		t.Errorf("the mode changes were not logged:\n%s", logs.String())
	}
}

// The API server's gate, from its /metrics.
func TestGateFromMetrics(t *testing.T) {
	for _, tc := range []struct {
		body string
		want inject.Gate
	}{
		{"# TYPE kubernetes_feature_enabled gauge\nkubernetes_feature_enabled{name=\"ImageVolume\",stage=\"\"} 1\n", inject.GateOn},
		{"kubernetes_feature_enabled{name=\"ImageVolumeWithDigest\",stage=\"ALPHA\"} 0\nkubernetes_feature_enabled{stage=\"BETA\",name=\"ImageVolume\"} 0\n", inject.GateOff},
		{"kubernetes_feature_enabled{name=\"ImageVolumeWithDigest\",stage=\"ALPHA\"} 1\n", inject.GateUnknown},
		{"apiserver_request_total{name=\"ImageVolume\"} 1\n", inject.GateUnknown},
		{"", inject.GateUnknown},
	} {
		if got, why := gateFromMetrics([]byte(tc.body), imageVolumeGate); got != tc.want || (got == inject.GateUnknown) != (why != "") {
			t.Errorf("gateFromMetrics(%q) = %v, %q; want %v", tc.body, got, why, tc.want)
		}
	}
}
