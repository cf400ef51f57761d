package nodeagent_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/cniplugin"
	"github.com/detourmesh/detour/nodeagent"
	"github.com/detourmesh/detour/test/testenv"
)

// Issue 42.3d: a pod whose sandbox got the inbound fallback is told about, once, where people
// look — a Warning Event and detour.dev/inbound-fallback on the pod — and counted in
// detour_cni_inbound_fallback_pods until DEL takes its record away; a record whose pod is gone
// (a lost DEL) is not counted.
func TestIntegrationFallbackReporter(t *testing.T) {
	client := kubernetes.NewForConfigOrDie(testenv.ControlPlane(t))
	ctx := context.Background()
	ns := randomName("fallback-")
	if _, err := client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pod, err := client.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Annotations: map[string]string{annotations.RedirectInbound: "listening"}},
		Spec:       corev1.PodSpec{NodeName: "node-a", Containers: []corev1.Container{{Name: "app", Image: "example.invalid/app"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	state := t.TempDir()
	write := func(r cniplugin.FallbackRecord) string {
		dir := filepath.Join(state, cniplugin.FallbackDirName)
		os.MkdirAll(dir, 0o755)
		path := filepath.Join(dir, r.ContainerID+".json")
		b, _ := json.Marshal(r)
		if err := os.WriteFile(path, b, 0o644); err != nil {
			t.Fatal(err)
		}
		return path
	}
	refusal := "apply ipv4 rules in /var/run/netns/cni-1 (nftables backend): no such file or directory"
	live := write(cniplugin.FallbackRecord{Namespace: ns, Name: "web", UID: string(pod.UID), ContainerID: "0123456789abcdef", Refusal: refusal, Time: time.Now()})
	write(cniplugin.FallbackRecord{Namespace: ns, Name: "gone", UID: "u-gone", ContainerID: "fedcba9876543210", Refusal: refusal, Time: time.Now()})

	r := nodeagent.NewFallbackReporter(client, state, "node-a", slog.New(slog.DiscardHandler))
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(r)
	if _, ok := metricValue(t, reg, "detour_cni_inbound_fallback_pods", nil); ok {
		t.Error("detour_cni_inbound_fallback_pods is exposed before the first pass")
	}
	for range 3 { // an agent's passes, and one after its restart
		r.Report(ctx)
	}
	nodeagent.NewFallbackReporter(client, state, "node-a", slog.New(slog.DiscardHandler)).Report(ctx)

	got, err := client.CoreV1().Pods(ns).Get(ctx, "web", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if note := got.Annotations[annotations.InboundFallback]; !strings.Contains(note, refusal) || !strings.Contains(note, "every inbound connection of this pod goes to the proxy") {
		t.Errorf("%s = %q, want the fallback and the kernel's refusal", annotations.InboundFallback, note)
	}
	events, err := client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(events.Items) != 1 {
		t.Fatalf("%d events, want one for the live pod's sandbox: %+v", len(events.Items), events.Items)
	}
	ev := events.Items[0]
	if ev.Reason != nodeagent.FallbackEventReason || ev.Type != corev1.EventTypeWarning || ev.InvolvedObject.UID != pod.UID ||
		!strings.Contains(ev.Message, "load nft_socket (nftables backend) or xt_socket (iptables backends) on the node, then recreate the pod") {
		t.Errorf("event %+v", ev)
	}
	wantMetric(t, reg, "detour_cni_inbound_fallback_pods", nil, 1) // the gone pod's record is not counted

	// DEL took the live sandbox's record away.
	os.Remove(live)
	r.Report(ctx)
	wantMetric(t, reg, "detour_cni_inbound_fallback_pods", nil, 0)
}
