//go:build conformance

package e2e

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/test/e2e/framework"
	"github.com/detourmesh/detour/test/e2e/upstream"
)

const (
	// relabelPairs is how many pairs of each form are relabelled at once.
	relabelPairs = 3
	// relabelWatch is how long their clients are watched after the relabel: four times the
	// step of e2e.test's "should deny ingress access to updated pod" (two rounds of probes
	// retried for 10 s each).
	relabelWatch = 90 * time.Second
	// relabelMinAfter is the fewest dials after the first denial that show a policy holding
	// (the client dials every 500 ms, a denied dial ends at its 2 s timeout).
	relabelMinAfter = 10
)

// relabelForm is one kind of pair netpolRelabel watches: meshed (detour injects both pods) or
// not, and whether the namespace opts out of injection (a cluster where detour injects every
// pod otherwise).
type relabelForm struct {
	Name, Prefix   string
	Meshed, OptOut bool
}

// relabelResult is one pair's outcome, with its form's name.
type relabelResult struct {
	Form string
	upstream.Relabel
}

// netpolRelabel is e2e.test's "should deny ingress access to updated pod" watched for longer:
// relabelPairs pairs of each form at once, in a namespace each, a client dialling a server's
// Service every half second; every server is relabelled into a policy that denies it all
// ingress, and the clients are watched for relabelWatch. Cilium enforces a relabelled pod's
// policy only once it has allocated the pod's new identity, which took from 7 to 37 s here,
// around the 20 s the upstream test's step gives it: so the test fails at times without
// detour, and its step ends before the policy is in force at times with it. Here the policy has
// time to come into force: the figures are when it did, and that no dial got through after it;
// the forms run side by side so that they share the cluster's load. It fails the run when a
// pod is injected against its form, or a meshed pair's policy does not hold.
func netpolRelabel(t *testing.T, ctx context.Context, e *framework.Env, forms ...relabelForm) []relabelResult {
	t.Helper()
	var out []relabelResult
	var names []string
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, f := range forms {
		for i := range relabelPairs {
			ns := fmt.Sprintf("%s-%d", f.Prefix, i)
			relabelNamespace(t, ctx, e, ns, f.OptOut)
			names = append(names, ns)
			wg.Add(1)
			go func() {
				defer wg.Done()
				r, err := relabelOne(ctx, e, ns, f.Meshed)
				if err != nil {
					t.Errorf("%s: %v\n%s", ns, err, e.Describe(ctx, ns))
					return
				}
				if f.Meshed && !r.Held(relabelMinAfter) {
					t.Errorf("with detour, the relabelled server's policy did not hold: %s", r)
				}
				mu.Lock()
				out = append(out, relabelResult{f.Name, r})
				mu.Unlock()
			}()
		}
	}
	wg.Wait()
	e.DropNamespaces(t, ctx, names...)
	slices.SortFunc(out, func(a, b relabelResult) int { return strings.Compare(a.Pod, b.Pod) })
	return out
}

// relabelNamespace creates ns, opted out of injection if optOut.
func relabelNamespace(t *testing.T, ctx context.Context, e *framework.Env, ns string, optOut bool) {
	t.Helper()
	if !optOut {
		e.Namespace(t, ctx, ns, false)
		return
	}
	obj := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns, Annotations: map[string]string{annotations.Inject: "disabled"}}}
	if _, err := e.Node.Client.CoreV1().Namespaces().Create(ctx, obj, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := e.Node.WaitServiceAccount(ctx, ns); err != nil {
		t.Fatalf("namespace %s has no default ServiceAccount: %v", ns, err)
	}
}

// relabelOne runs one server and its client in ns (see netpolRelabel).
func relabelOne(ctx context.Context, e *framework.Env, ns string, meshed bool) (upstream.Relabel, error) {
	c := e.Node.Client
	policy := &networkingv1.NetworkPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: "deny-ingress-via-label-selector", Namespace: ns},
		Spec: networkingv1.NetworkPolicySpec{
			PodSelector: metav1.LabelSelector{MatchLabels: map[string]string{"target": "isolated"}},
			PolicyTypes: []networkingv1.PolicyType{networkingv1.PolicyTypeIngress},
		},
	}
	if _, err := c.NetworkingV1().NetworkPolicies(ns).Create(ctx, policy, metav1.CreateOptions{}); err != nil {
		return upstream.Relabel{}, err
	}
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "server", Namespace: ns},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"name": "server"},
			Ports:    []corev1.ServicePort{{Port: 8080, TargetPort: intstr.FromInt32(8080)}},
		},
	}
	svc, err := c.CoreV1().Services(ns).Create(ctx, svc, metav1.CreateOptions{})
	if err != nil {
		return upstream.Relabel{}, err
	}
	addr := svc.Spec.ClusterIP + ":8080"

	server := e.Pod("server", ns)
	server.Spec.InitContainers = nil
	server.Spec.Containers[0].Args = []string{"serve", "-listen", ":8080"}
	client := e.Pod("client", ns)
	client.Spec.InitContainers = nil
	client.Spec.Containers[0].Args = []string{"dial", "-retry", "2m", "-addr", addr, "-timeout", "2s", "-every", "500ms"}
	client.Spec.Containers[0].ReadinessProbe = nil
	for _, p := range []*corev1.Pod{server, client} {
		created, err := c.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{})
		if err != nil {
			return upstream.Relabel{}, err
		}
		if meshed != annotations.IsInjected(created.Annotations) {
			return upstream.Relabel{}, fmt.Errorf("pod %s/%s injected: %v, want %v", ns, p.Name, !meshed, meshed)
		}
	}
	// The client's dials get through before the relabel.
	var lines []upstream.LogLine
	if err := framework.Poll(ctx, 3*time.Minute, func() (bool, error) {
		lines, err = relabelClientLog(ctx, e, ns)
		for _, l := range lines {
			if strings.Contains(l.Text, " ok: ") {
				return true, nil
			}
		}
		return false, framework.Seen("client's log: %v %d lines", err, len(lines))
	}); err != nil {
		return upstream.Relabel{}, fmt.Errorf("the client never got through before the relabel: %w", err)
	}
	patch := []byte(`{"metadata":{"labels":{"target":"isolated"}}}`)
	at := time.Now()
	if _, err := c.CoreV1().Pods(ns).Patch(ctx, "server", types.StrategicMergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return upstream.Relabel{}, err
	}
	select {
	case <-ctx.Done():
		return upstream.Relabel{}, ctx.Err()
	case <-time.After(relabelWatch):
	}
	if lines, err = relabelClientLog(ctx, e, ns); err != nil {
		return upstream.Relabel{}, err
	}
	return upstream.ReadRelabel(ns+"/client", at, lines), nil
}

// relabelClientLog is the client's log, its lines stamped by the kubelet.
func relabelClientLog(ctx context.Context, e *framework.Env, ns string) ([]upstream.LogLine, error) {
	data, err := e.Node.Client.CoreV1().Pods(ns).GetLogs("client", &corev1.PodLogOptions{Container: "app", Timestamps: true}).DoRaw(ctx)
	if err != nil {
		return nil, err
	}
	var lines []upstream.LogLine
	for s := range strings.SplitSeq(string(data), "\n") {
		if l, ok := upstream.ParseLogLine(ns+"/client", s); ok {
			lines = append(lines, l)
		}
	}
	return lines, nil
}

// relabelTable is the relabels as a Markdown section of the report.
func relabelTable(results ...[]relabelResult) string {
	var b strings.Builder
	fmt.Fprintf(&b, "\n## A relabelled server, watched for %s\n\n", relabelWatch)
	fmt.Fprintf(&b, "e2e.test's \"should deny ingress access to updated pod\" gives Cilium about 20 s to enforce a relabelled pod's policy; here a client dials the relabelled server's Service every 500 ms for %s, %d pairs of each form at once, the forms of a run side by side.\n\n", relabelWatch, relabelPairs)
	b.WriteString("| form | client | last dial through, after the relabel | first dial denied | dials after it | of them through |\n|---|---|---|---|---|---|\n")
	for _, rs := range results {
		for _, r := range rs {
			denied := "never"
			if r.FirstDenied > 0 {
				denied = r.FirstDenied.Round(100 * time.Millisecond).String()
			}
			fmt.Fprintf(&b, "| %s | %s | %s | %s | %d | %d |\n", r.Form, r.Pod, r.LastThrough.Round(100*time.Millisecond), denied, r.After, r.Through)
		}
	}
	return b.String()
}
