package fastpath

import (
	"encoding/json"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

func ptr[T any](v T) *T { return &v }

// testContainer is a container with a field of every kind the diff meets: strings, lists of
// structs, maps of quantities, pointers to structs and to scalars.
func testContainer(name string, uid int64) corev1.Container {
	return corev1.Container{
		Name:  name,
		Image: "registry.example.com/" + name + ":1.0",
		Env:   []corev1.EnvVar{{Name: "MODE", Value: "production"}, {Name: "PORT", Value: "8080"}},
		Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8080, Protocol: corev1.ProtocolTCP}},
		Resources: corev1.ResourceRequirements{
			Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("250m")},
			Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("512Mi")},
		},
		ReadinessProbe:  &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/ready", Port: intstr.FromInt32(8080)}}},
		SecurityContext: &corev1.SecurityContext{RunAsUser: ptr(uid), RunAsGroup: ptr(uid)},
	}
}

// testPodJSON is a pod with the given init containers and one app container, as JSON.
func testPodJSON(t testing.TB, inits ...corev1.Container) []byte {
	t.Helper()
	pod := &corev1.Pod{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
		ObjectMeta: metav1.ObjectMeta{Name: "web", Annotations: map[string]string{"team": "payments"}},
		Spec:       corev1.PodSpec{InitContainers: inits, Containers: []corev1.Container{testContainer("api", 1000)}},
	}
	b, err := json.Marshal(pod)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
