package fastpath

import (
	"reflect"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	sigsjson "sigs.k8s.io/json"
)

// deepEqual agrees with reflect.DeepEqual.
func TestDeepEqual(t *testing.T) {
	base := testContainer("api", 1000)
	for _, tc := range []struct {
		name   string
		change func(*corev1.Container)
	}{
		{"nothing", func(*corev1.Container) {}},
		{"a string", func(c *corev1.Container) { c.Image += "x" }},
		{"nil and empty slices", func(c *corev1.Container) { c.Args = []string{} }},
		{"a slice element", func(c *corev1.Container) { c.Env[1].Value = "9" }},
		{"a slice's length", func(c *corev1.Container) { c.Env = c.Env[:1] }},
		{"nil and empty maps", func(c *corev1.Container) { c.Resources.Claims = nil; c.Resources.Requests = corev1.ResourceList{} }},
		{"a map value", func(c *corev1.Container) { c.Resources.Limits[corev1.ResourceMemory] = resource.MustParse("1Gi") }},
		{"the same quantity written otherwise", func(c *corev1.Container) { c.Resources.Limits[corev1.ResourceMemory] = resource.MustParse("536870912") }},
		{"a map key", func(c *corev1.Container) {
			delete(c.Resources.Limits, corev1.ResourceMemory)
			c.Resources.Limits[corev1.ResourceCPU] = resource.MustParse("512Mi")
		}},
		{"a nil pointer", func(c *corev1.Container) { c.SecurityContext.RunAsGroup = nil }},
		{"a pointer to an equal value", func(c *corev1.Container) { c.SecurityContext.RunAsUser = ptr(*c.SecurityContext.RunAsUser) }},
		{"a pointed-to value", func(c *corev1.Container) { c.SecurityContext.RunAsUser = ptr(int64(7)) }},
		{"a pointer to an empty struct", func(c *corev1.Container) { c.LivenessProbe = &corev1.Probe{} }},
		{"a nested int", func(c *corev1.Container) { c.Ports[0].ContainerPort++ }},
		{"a bool", func(c *corev1.Container) { c.TTY = true }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := base.DeepCopy(), base.DeepCopy()
			tc.change(b)
			if got, want := equalValues(a, b), reflect.DeepEqual(a, b); got != want {
				t.Errorf("deepEqual = %v, reflect.DeepEqual = %v", got, want)
			}
			if !equalValues(b, b) || !equalValues(b, b.DeepCopy()) {
				t.Error("a container differs from itself")
			}
		})
	}
	var x, y any = 1, "1"
	if deepEqual(reflect.ValueOf(&x).Elem(), reflect.ValueOf(&y).Elem()) {
		t.Error("interfaces holding different types are equal")
	}
}

// Any two pods decoded from JSON: deepEqual agrees with reflect.DeepEqual.
func FuzzDeepEqual(f *testing.F) {
	raw := testPodJSON(f, testContainer("migrate", 0), testContainer("fetch", 1001))
	f.Add(raw, raw)
	f.Add(raw, testPodJSON(f, testContainer("migrate", 0)))
	f.Add([]byte(`{"spec":{"containers":[]}}`), []byte(`{"spec":{"containers":null}}`))
	f.Add([]byte(`{"metadata":{"labels":{}}}`), []byte(`{"metadata":{}}`))
	f.Fuzz(func(t *testing.T, ja, jb []byte) {
		var a, b corev1.Pod
		if sigsjson.UnmarshalCaseSensitivePreserveInts(ja, &a) != nil || sigsjson.UnmarshalCaseSensitivePreserveInts(jb, &b) != nil {
			return
		}
		if got, want := equalValues(&a, &b), reflect.DeepEqual(&a, &b); got != want {
			t.Fatalf("deepEqual = %v, reflect.DeepEqual = %v", got, want)
		}
		if !equalValues(&a, a.DeepCopy()) {
			t.Fatal("a pod differs from its copy")
		}
	})
}
