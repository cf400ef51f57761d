package podevent

import (
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
)

func TestWarningName(t *testing.T) {
	src := Source{Component: "detour-repair", Controller: "detour.dev/repair", Node: "n1"}
	at := time.Unix(1700000000, 0)
	for _, tc := range []struct {
		pod, suffix, want string
	}{
		{"web-0", "check-port-1234", "web-0.check-port-1234"},
		{strings.Repeat("a", 253), "inbound-fallback.0123456789ab", strings.Repeat("a", 253-1-29) + ".inbound-fallback.0123456789ab"},
		{strings.Repeat("b", 250), "x", strings.Repeat("b", 250) + ".x"},
		// Cut where the pod's name has a dash or a dot: the Event's name may not end in one there.
		{strings.Repeat("c", 220) + "-.-" + strings.Repeat("d", 30), "inbound-fallback.0123456789ab", strings.Repeat("c", 220) + ".inbound-fallback.0123456789ab"},
	} {
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: tc.pod, Namespace: "ns", UID: "u1"}}
		ev := Warning(src, pod, at, "R", "A", "msg", tc.suffix)
		if ev.Name != tc.want {
			t.Errorf("pod %d characters, suffix %q: name %q, want %q", len(tc.pod), tc.suffix, ev.Name, tc.want)
		}
		if errs := validation.IsDNS1123Subdomain(ev.Name); len(errs) > 0 {
			t.Errorf("name %q is not a valid Event name: %v", ev.Name, errs)
		}
		if ev.InvolvedObject.Name != tc.pod || ev.InvolvedObject.UID != "u1" || ev.Namespace != "ns" {
			t.Errorf("involved object %+v, namespace %q: want the pod", ev.InvolvedObject, ev.Namespace)
		}
		if ev.Type != corev1.EventTypeWarning || ev.ReportingInstance != "detour-repair-n1" || ev.Source.Host != "n1" || !ev.FirstTimestamp.Time.Equal(at) {
			t.Errorf("event %+v: want a Warning of detour-repair on n1 at %v", ev, at)
		}
	}
}
