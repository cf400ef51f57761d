package webhook

import (
	"encoding/json"
	"fmt"
	"os"
	"testing"

	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/inject"
	"github.com/detourmesh/detour/test/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

func ptr[T any](v T) *T { return &v }

var optedIn = map[string]string{annotations.Inject: "enabled"}

// testConfig is the configuration of the handler tests: defaults, a proxy image, and the
// changes of the case.
func testConfig(t testing.TB, yaml string) *inject.Config {
	t.Helper()
	cfg, err := inject.ParseConfig([]byte("proxy: {image: proxy:test}\n" + yaml))
	if err != nil {
		t.Fatalf("ParseConfig: %v", err)
	}
	return cfg
}

// runAs is a container that runs as uid (root when 0) with gid, or without a security
// context when uid < 0.
func runAs(name string, uid, gid int64) corev1.Container {
	c := corev1.Container{Name: name, Image: name + ":1"}
	if uid >= 0 {
		c.SecurityContext = &corev1.SecurityContext{RunAsUser: ptr(uid)}
		if gid >= 0 {
			c.SecurityContext.RunAsGroup = ptr(gid)
		}
	}
	return c
}

// testPod is pod web in namespace shop with the given init containers, app containers
// (default one as UID 1000) and annotations.
func testPod(initContainers, containers []corev1.Container, ann map[string]string) *corev1.Pod {
	if containers == nil {
		containers = []corev1.Container{runAs("app", 1000, -1)}
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "shop", Annotations: ann},
		Spec:       corev1.PodSpec{InitContainers: initContainers, Containers: containers},
	}
}

// benchPod is the benchmarks' realistic pod, the one BenchmarkMutate of package inject mutates
// (three init containers, as root, a UID of its own and the app's, and two app containers with
// resources, probes, env and volumes).
func benchPod(t testing.TB) *corev1.Pod {
	t.Helper()
	b, err := os.ReadFile("../inject/testdata/pod.json")
	if err != nil {
		t.Fatal(err)
	}
	var pod corev1.Pod
	if err := json.Unmarshal(b, &pod); err != nil {
		t.Fatal(err)
	}
	return &pod
}

// review is the AdmissionReview request body that creates pod in namespace shop.
func review(t testing.TB, apiVersion string, pod *corev1.Pod) []byte {
	t.Helper()
	body, err := json.Marshal(&admissionv1.AdmissionReview{
		TypeMeta: metav1.TypeMeta{APIVersion: apiVersion, Kind: "AdmissionReview"},
		Request: &admissionv1.AdmissionRequest{
			UID:       "00000000-0000-0000-0000-000000000000",
			Kind:      metav1.GroupVersionKind{Version: "v1", Kind: "Pod"},
			Resource:  metav1.GroupVersionResource{Version: "v1", Resource: "pods"},
			Namespace: "shop",
			Operation: admissionv1.Create,
			Object:    runtime.RawExtension{Raw: podJSON(t, pod)},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	return body
}

func containerNames(cs []corev1.Container) []string {
	names := make([]string, len(cs))
	for i, c := range cs {
		names[i] = c.Name
	}
	return names
}

// diffPods shows two pods for a failure message.
func diffPods(t testing.TB, want, got *corev1.Pod) string {
	return fmt.Sprintf("--- want\n%s\n--- got\n%s", podJSON(t, want), podJSON(t, got))
}

func withPodSecurity(pod *corev1.Pod, sc corev1.PodSecurityContext) *corev1.Pod {
	pod.Spec.SecurityContext = &sc
	return pod
}
