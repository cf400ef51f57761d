package webhook

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"strings"
	"time"

	authzv1 "k8s.io/api/authorization/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/detourmesh/detour/inject"
)

// What the webhook learns of the cluster besides its nodes, for where the validator's check
// runs: whether the API server keeps image volumes, and whether the webhook may watch nodes.

// imageVolumeGate is the name of the API server's feature gate for image volumes.
const imageVolumeGate = "ImageVolume"

// gateRecheck is how often the webhook reads the API server's gate again: it changes only when
// an API server restarts (an upgrade, a flag changed).
const gateRecheck = 10 * time.Minute

// APIServerGate reads whether the API server keeps image volumes: its ImageVolume feature gate,
// from the API server's own /metrics (kubernetes_feature_enabled, Kubernetes 1.26 and later).
// The state is unknown when the metrics cannot be read (why says so, with the fix) or do not
// name the gate.
func APIServerGate(ctx context.Context, cs kubernetes.Interface) (inject.Gate, string) {
	body, err := cs.CoreV1().RESTClient().Get().AbsPath("/metrics").Do(ctx).Raw()
	switch {
	case apierrors.IsForbidden(err):
		return inject.GateUnknown, "reading the API server's /metrics was forbidden: grant the webhook's service account get on the non-resource URL /metrics, as the chart's ClusterRole detour-webhook does"
	case err != nil:
		return inject.GateUnknown, fmt.Sprintf("reading the API server's /metrics failed: %v", err)
	}
	return gateFromMetrics(body, imageVolumeGate)
}

// gateFromMetrics finds gate in a Prometheus text exposition's kubernetes_feature_enabled.
func gateFromMetrics(body []byte, gate string) (inject.Gate, string) {
	name := `name="` + gate + `"`
	lines := bufio.NewScanner(bytes.NewReader(body))
	lines.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for lines.Scan() {
		rest, ok := strings.CutPrefix(lines.Text(), "kubernetes_feature_enabled{")
		if !ok {
			continue
		}
		labels, value, ok := strings.Cut(rest, "} ")
		if !ok || !strings.Contains(","+labels+",", ","+name+",") {
			continue
		}
		if strings.TrimSpace(value) == "1" {
			return inject.GateOn, ""
		}
		return inject.GateOff, ""
	}
	return inject.GateUnknown, "the API server's /metrics name no " + gate + " feature gate (kubernetes_feature_enabled): an API server older than 1.31, where image volumes do not exist, or one that hides the metric"
}

// mayWatchNodes reports whether the webhook may list and watch nodes, asking the API server
// (a SelfSubjectAccessReview each, which every authenticated identity may create); why says
// what is missing and how to grant it.
func mayWatchNodes(ctx context.Context, cs kubernetes.Interface) (bool, string, error) {
	for _, verb := range []string{"list", "watch"} {
		review := &authzv1.SelfSubjectAccessReview{Spec: authzv1.SelfSubjectAccessReviewSpec{
			ResourceAttributes: &authzv1.ResourceAttributes{Verb: verb, Resource: "nodes"},
		}}
		res, err := cs.AuthorizationV1().SelfSubjectAccessReviews().Create(ctx, review, metav1.CreateOptions{})
		if err != nil {
			return false, "", fmt.Errorf("ask whether the webhook may %s nodes: %w", verb, err)
		}
		if !res.Status.Allowed {
			return false, fmt.Sprintf("the webhook may not %s nodes (its RBAC): grant its service account list and watch on nodes, as the chart's ClusterRole detour-webhook does, for the check to run in the proxy's start", verb), nil
		}
	}
	return true, "", nil
}
