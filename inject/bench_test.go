package inject

import (
	"encoding/json"
	"os"
	"testing"

	corev1 "k8s.io/api/core/v1"
)

// BenchmarkMutate mutates a realistic pod (testdata/pod.json, which the webhook's benchmarks
// admit too): three init containers, as root, a UID of its own and the app's, and two app
// containers with resources, probes, env and volumes.
func BenchmarkMutate(b *testing.B) {
	cfg := testConfig(b, "")
	raw, err := os.ReadFile("testdata/pod.json")
	if err != nil {
		b.Fatal(err)
	}
	var pod corev1.Pod
	if err := json.Unmarshal(raw, &pod); err != nil {
		b.Fatal(err)
	}
	in := Input{NamespaceAnnotations: optedIn}
	b.ReportAllocs()
	for b.Loop() {
		p := pod.DeepCopy()
		if _, err := Mutate(p, in, cfg); err != nil {
			b.Fatal(err)
		}
	}
}
