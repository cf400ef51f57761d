package manifest_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	jsonpatch "github.com/evanphx/json-patch/v5"
	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"
	sigsjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/inject"
	"github.com/detourmesh/detour/internal/manifest"
	"github.com/detourmesh/detour/webhook"
)

var optedIn = map[string]string{annotations.Inject: string(annotations.InjectEnabled)}

// kinds are the workload kinds detour inject reads, each with where it keeps its pod template
// (nil: the object is the pod).
var kinds = []struct {
	apiVersion, kind string
	path             []string
}{
	{"v1", "Pod", nil},
	{"apps/v1", "Deployment", []string{"spec", "template"}},
	{"apps/v1", "StatefulSet", []string{"spec", "template"}},
	{"apps/v1", "DaemonSet", []string{"spec", "template"}},
	{"apps/v1", "ReplicaSet", []string{"spec", "template"}},
	{"v1", "ReplicationController", []string{"spec", "template"}},
	{"batch/v1", "Job", []string{"spec", "template"}},
	{"batch/v1", "CronJob", []string{"spec", "jobTemplate", "spec", "template"}},
	{"v1", "PodTemplate", []string{"template"}},
}

// detour inject writes every field the mutation changes (issue 32, item 3b): for random pods,
// in both validator modes, in container and native sidecar mode, as a Pod or as the template
// of every workload kind it reads (alone or in a List), its output holds exactly the pod the
// webhook makes of the same pod — the webhook's JSON patch applied to the same JSON. Some pods
// arrive injected already (by the other mode), so what the mutation removes (the image volume,
// the node selector it added) is covered too; fields the typed Pod does not know survive.
// DETOUR_PROPERTY_SEED reproduces a run; DETOUR_PROPERTY_PODS sets its size (default 300).
func TestInjectStreamMatchesTheWebhook(t *testing.T) {
	seed, pods := propertySeed(t, 300)
	configs := map[annotations.ValidatorModeValue]*inject.Config{}
	for _, mode := range []annotations.ValidatorModeValue{annotations.ValidatorInitContainer, annotations.ValidatorImageVolume} {
		cfg, err := inject.ParseConfig([]byte(`
proxy: {image: proxy:test, command: [proxy, run], args: [--v], startupProbe: {tcpSocket: {port: 4191}, periodSeconds: 1}}
validator: {image: "detour:test", mode: ` + string(mode) + `}
`))
		if err != nil {
			t.Fatal(err)
		}
		configs[mode] = cfg
	}
	seen := map[string]int{}
	for i := range pods {
		r := rand.New(rand.NewPCG(seed, uint64(i)))
		native := r.IntN(4) != 0
		template := randomTemplate(r)
		if r.IntN(5) == 0 {
			// Injected before, in the other mode.
			other := configs[pickOne(r, annotations.ValidatorInitContainer, annotations.ValidatorImageVolume)]
			var err error
			if template, err = injectedTemplate(template, other, native); err != nil {
				t.Fatalf("pod %d of seed %d: inject it first: %v", i, seed, err)
			}
		}
		k := kinds[r.IntN(len(kinds))]
		list := r.IntN(5) == 0
		for _, mode := range []annotations.ValidatorModeValue{annotations.ValidatorInitContainer, annotations.ValidatorImageVolume} {
			cfg := configs[mode]
			where := fmt.Sprintf("pod %d of seed %d (DETOUR_PROPERTY_SEED=%d reproduces it), %s in %s, native sidecars %v, validator.mode %s",
				i, seed, seed, k.kind, map[bool]string{true: "a List", false: "a document"}[list], native, mode)
			want, res := webhookPod(t, where, cfg, native, template)
			seen[fmt.Sprintf("%s/%s", res.Mode, res.Validator)]++

			doc := wrap(k.apiVersion, k.kind, k.path, template)
			if list {
				doc = map[string]any{"apiVersion": "v1", "kind": "List", "items": []any{doc}}
			}
			in, err := yaml.Marshal(doc)
			if err != nil {
				t.Fatal(err)
			}
			var out bytes.Buffer
			if _, err := manifest.InjectStream(bytes.NewReader(in), &out, manifest.InjectOptions{
				Config: cfg, NamespaceAnnotations: optedIn, NativeSidecars: native,
				Validator: inject.ResolveValidatorMode(cfg, inject.OfflineCluster(true)).Mode,
			}); err != nil {
				t.Fatalf("%s: detour inject: %v\ninput:\n%s", where, err, in)
			}
			got := outputTemplate(t, where, out.Bytes(), k.path, list)
			// A template has no name of its own; the rest of the metadata must be the webhook's.
			got.TypeMeta, got.Name, got.Namespace = metav1.TypeMeta{}, "", ""
			want.TypeMeta, want.Name, want.Namespace = metav1.TypeMeta{}, "", ""
			if !equality.Semantic.DeepEqual(got.ObjectMeta, want.ObjectMeta) || !equality.Semantic.DeepEqual(got.Spec, want.Spec) {
				g, _ := yaml.Marshal(got)
				w, _ := yaml.Marshal(want)
				t.Fatalf("%s: detour inject wrote\n%s\nthe webhook made\n%s\ninput:\n%s", where, g, w, in)
			}
			if !strings.Contains(out.String(), "x-unknown-field: kept") {
				t.Fatalf("%s: detour inject dropped a field the typed Pod does not know:\n%s", where, out.String())
			}
		}
	}
	for _, m := range []string{"container/init-container", "native/init-container", "native/image-volume"} {
		if seen[m] == 0 {
			t.Errorf("no pod was injected as %s: %v", m, seen)
		}
	}
	t.Logf("%d pods: %v", pods, seen)
}

// The reported case: validator.mode image-volume, a native-sidecar pod with an init container.
func TestInjectStreamImageVolume(t *testing.T) {
	cfg, err := inject.ParseConfig([]byte("proxy: {image: proxy:1, command: [/proxy], startupProbe: {tcpSocket: {port: 4191}}}\nvalidator: {mode: image-volume}\n"))
	if err != nil {
		t.Fatal(err)
	}
	pod := "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  initContainers: [{name: fetch, image: busybox}]\n  containers: [{name: app, image: nginx}]\n"
	var out bytes.Buffer
	if _, err := manifest.InjectStream(strings.NewReader(pod), &out, manifest.InjectOptions{Config: cfg, NativeSidecars: true, Validator: annotations.ValidatorImageVolume}); err != nil {
		t.Fatalf("detour inject: %v", err)
	}
	var got corev1.Pod
	if err := yaml.UnmarshalStrict(out.Bytes(), &got); err != nil {
		t.Fatal(err)
	}
	if len(got.Spec.Volumes) != 1 || got.Spec.Volumes[0].Image == nil || got.Spec.NodeSelector[annotations.ImageVolumesLabel] != "true" {
		t.Errorf("the output lacks the image volume or the node selector:\n%s", out.String())
	}
}

type handlerKey struct {
	cfg    *inject.Config
	native bool
}

// handlers are the webhook's handlers of the test's configurations.
var handlers = map[handlerKey]*webhook.Handler{}

// webhookPod is the pod the webhook's handler makes of template: its JSON patch applied to the
// pod's JSON.
func webhookPod(t *testing.T, where string, cfg *inject.Config, native bool, template map[string]any) (*corev1.Pod, inject.Result) {
	t.Helper()
	pod := wrap("v1", "Pod", nil, template)
	raw, err := json.Marshal(pod)
	if err != nil {
		t.Fatal(err)
	}
	key := handlerKey{cfg, native}
	h := handlers[key]
	if h == nil {
		lookup := webhook.NamespaceLookupFunc(func(context.Context, string) (map[string]string, error) { return optedIn, nil })
		// The webhook on the cluster detour inject assumes (inject.OfflineCluster(true)): an
		// API server that keeps image volumes, one node that mounts them.
		modes := webhook.NewValidatorModes(cfg, "v1.37.2", slog.New(slog.DiscardHandler), nil)
		modes.SetAPIServerGate(inject.GateOn, "")
		modes.Handler().OnAdd(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n", Labels: map[string]string{annotations.ImageVolumesLabel: "true"}}}, true)
		h = webhook.NewHandler(cfg, lookup, native, webhook.WithValidatorModes(modes))
		handlers[key] = h
	}
	resp := h.Handle(context.Background(), admission.Request{AdmissionRequest: admissionv1.AdmissionRequest{
		UID: "1", Kind: metav1.GroupVersionKind{Version: "v1", Kind: "Pod"}, Resource: metav1.GroupVersionResource{Version: "v1", Resource: "pods"},
		Namespace: "shop", Operation: admissionv1.Create, Object: runtime.RawExtension{Raw: raw},
	}})
	if !resp.Allowed {
		t.Fatalf("%s: the webhook refused the pod: %+v", where, resp.Result)
	}
	out := raw
	if len(resp.Patch) > 0 {
		p, err := jsonpatch.DecodePatch(resp.Patch)
		if err == nil {
			out, err = p.Apply(raw)
		}
		if err != nil {
			t.Fatalf("%s: the webhook's patch: %v", where, err)
		}
	}
	var got corev1.Pod
	if err := sigsjson.UnmarshalCaseSensitivePreserveInts(out, &got); err != nil {
		t.Fatal(err)
	}
	// What the webhook decided, for the coverage count: the same mutation on the typed pod.
	var typed corev1.Pod
	if err := sigsjson.UnmarshalCaseSensitivePreserveInts(raw, &typed); err != nil {
		t.Fatal(err)
	}
	validator := inject.ResolveValidatorMode(cfg, inject.OfflineCluster(true)).Mode
	res, err := inject.Mutate(&typed, inject.Input{Namespace: "shop", NamespaceAnnotations: optedIn, NativeSidecars: native, Validator: validator}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return &got, res
}

// injectedTemplate is template as detour inject writes it with cfg.
func injectedTemplate(template map[string]any, cfg *inject.Config, native bool) (map[string]any, error) {
	in, err := yaml.Marshal(wrap("v1", "Pod", nil, template))
	if err != nil {
		return nil, err
	}
	var out bytes.Buffer
	if _, err := manifest.InjectStream(bytes.NewReader(in), &out, manifest.InjectOptions{
		Config: cfg, NamespaceAnnotations: optedIn, NativeSidecars: native, Validator: inject.ResolveValidatorMode(cfg, inject.OfflineCluster(true)).Mode,
	}); err != nil {
		return nil, err
	}
	var pod map[string]any
	if err := yaml.Unmarshal(out.Bytes(), &pod); err != nil {
		return nil, err
	}
	meta := pod["metadata"].(map[string]any)
	delete(meta, "name")
	delete(meta, "namespace")
	delete(pod, "apiVersion")
	delete(pod, "kind")
	return pod, nil
}

// wrap is an object of kind holding a copy of template at path (the pod itself for nil).
func wrap(apiVersion, kind string, path []string, template map[string]any) map[string]any {
	t := deepCopy(template)
	meta := map[string]any{"name": "web", "namespace": "shop"}
	if path == nil {
		m, _ := t["metadata"].(map[string]any)
		if m == nil {
			m = map[string]any{}
		}
		for k, v := range meta {
			m[k] = v
		}
		t["metadata"] = m
		t["apiVersion"], t["kind"] = apiVersion, kind
		return t
	}
	obj := map[string]any{"apiVersion": apiVersion, "kind": kind, "metadata": meta}
	cur := obj
	for _, k := range path[:len(path)-1] {
		next := map[string]any{}
		if k == "spec" && cur["kind"] != nil && kind != "PodTemplate" {
			next["selector"] = map[string]any{"matchLabels": map[string]any{"app": "web"}}
		}
		cur[k] = next
		cur = next
	}
	cur[path[len(path)-1]] = t
	return obj
}

func deepCopy(m map[string]any) map[string]any {
	b, err := json.Marshal(m)
	if err != nil {
		panic(err)
	}
	var out map[string]any
	if err := json.Unmarshal(b, &out); err != nil {
		panic(err)
	}
	return out
}

// outputTemplate decodes the pod (template) of detour inject's output.
func outputTemplate(t *testing.T, where string, out []byte, path []string, list bool) *corev1.Pod {
	t.Helper()
	var obj map[string]any
	if err := yaml.Unmarshal(out, &obj); err != nil {
		t.Fatalf("%s: the output does not parse: %v\n%s", where, err, out)
	}
	if list {
		obj = obj["items"].([]any)[0].(map[string]any)
	}
	for _, k := range path {
		obj, _ = obj[k].(map[string]any)
	}
	b, err := json.Marshal(obj)
	if err != nil {
		t.Fatal(err)
	}
	var pod corev1.Pod
	if err := sigsjson.UnmarshalCaseSensitivePreserveInts(b, &pod); err != nil {
		t.Fatalf("%s: the output's pod: %v", where, err)
	}
	return &pod
}

func pickOne[T any](r *rand.Rand, s ...T) T { return s[r.IntN(len(s))] }

// randomTemplate is a random pod template as a manifest holds it: metadata (labels,
// annotations) and spec, with a field the typed Pod does not know on its first container.
func randomTemplate(r *rand.Rand) map[string]any {
	pod := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": "web"}}}
	if r.IntN(2) == 0 {
		pod.Annotations = map[string]string{"example.com/owner": "team-a"}
		for _, kv := range [][2]string{
			{annotations.SidecarMode, pickOne(r, "container", "native")},
			{annotations.ValidatorMode, pickOne(r, "auto", "init-container", "image-volume")},
			{annotations.InitEgress, pickOne(r, "*", "none", "init-0")},
			{annotations.SkipOutboundPorts, pickOne(r, "25", "3306,5432")},
		} {
			if r.IntN(4) == 0 {
				pod.Annotations[kv[0]] = kv[1]
			}
		}
	}
	s := &pod.Spec
	s.RestartPolicy = pickOne(r, corev1.RestartPolicy(""), corev1.RestartPolicyAlways, corev1.RestartPolicyOnFailure, corev1.RestartPolicyNever)
	if r.IntN(2) == 0 {
		s.SecurityContext = &corev1.PodSecurityContext{}
		if r.IntN(2) == 0 {
			s.SecurityContext.RunAsUser = ptr(pickOne[int64](r, 0, 1000, 1001))
		}
		if r.IntN(3) == 0 {
			s.SecurityContext.FSGroup = ptr(int64(2000))
		}
	}
	newContainer := func(name string) corev1.Container {
		c := corev1.Container{Name: name, Image: "example/" + name + ":1"}
		if r.IntN(2) == 0 {
			c.SecurityContext = &corev1.SecurityContext{}
			if r.IntN(3) != 0 {
				c.SecurityContext.RunAsUser = ptr(pickOne[int64](r, 0, 1000, 1001, 1200))
			}
			if r.IntN(3) == 0 {
				c.SecurityContext.RunAsGroup = ptr(pickOne[int64](r, 0, 1000, 3000))
			}
		}
		if r.IntN(3) == 0 {
			c.Env = []corev1.EnvVar{{Name: "MODE", Value: "x"}}
		}
		if r.IntN(3) == 0 {
			c.Ports = []corev1.ContainerPort{{ContainerPort: 8080}}
		}
		return c
	}
	for i := range r.IntN(4) {
		c := newContainer("init-" + strconv.Itoa(i))
		if r.IntN(4) == 0 {
			c.RestartPolicy = ptr(corev1.ContainerRestartPolicyAlways)
		}
		s.InitContainers = append(s.InitContainers, c)
	}
	for i := range 1 + r.IntN(3) {
		s.Containers = append(s.Containers, newContainer("app-"+strconv.Itoa(i)))
	}
	for i := range r.IntN(3) {
		v := corev1.Volume{Name: "data-" + strconv.Itoa(i)}
		if r.IntN(2) == 0 {
			v.EmptyDir = &corev1.EmptyDirVolumeSource{}
		} else {
			v.ConfigMap = &corev1.ConfigMapVolumeSource{LocalObjectReference: corev1.LocalObjectReference{Name: "config"}}
		}
		s.Volumes = append(s.Volumes, v)
	}
	if r.IntN(3) == 0 {
		s.NodeSelector = map[string]string{"disk": "ssd"}
	}
	if r.IntN(3) == 0 {
		s.Tolerations = []corev1.Toleration{{Key: "dedicated", Operator: corev1.TolerationOpExists}}
	}
	b, err := json.Marshal(pod)
	if err != nil {
		panic(err)
	}
	var t map[string]any
	if err := json.Unmarshal(b, &t); err != nil {
		panic(err)
	}
	delete(t, "status")
	meta := t["metadata"].(map[string]any)
	delete(meta, "creationTimestamp")
	spec := t["spec"].(map[string]any)
	for _, list := range []string{"initContainers", "containers"} {
		cs, _ := spec[list].([]any)
		for _, c := range cs {
			delete(c.(map[string]any), "resources") // {} as encoded; a manifest omits it
		}
	}
	app := spec["containers"].([]any)[0].(map[string]any)
	app["x-unknown-field"] = "kept"
	if r.IntN(2) == 0 {
		app["resources"] = map[string]any{"requests": map[string]any{"cpu": "0.5"}} // not as Quantity writes it
	}
	return t
}

func ptr[T any](v T) *T { return &v }

// propertySeed is the seed (DETOUR_PROPERTY_SEED, else the clock) and the number of pods
// (DETOUR_PROPERTY_PODS, else def) of a property test.
func propertySeed(t *testing.T, def int) (uint64, int) {
	t.Helper()
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("DETOUR_PROPERTY_SEED"); s != "" {
		var err error
		if seed, err = strconv.ParseUint(s, 10, 64); err != nil {
			t.Fatalf("DETOUR_PROPERTY_SEED=%q: %v", s, err)
		}
	}
	if s := os.Getenv("DETOUR_PROPERTY_PODS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 {
			t.Fatalf("DETOUR_PROPERTY_PODS=%q: a positive number of pods", s)
		}
		def = n
	}
	t.Logf("seed %d (DETOUR_PROPERTY_SEED=%d reproduces this run)", seed, seed)
	return seed, def
}
