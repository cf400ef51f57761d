package webhook

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"
	sigsjson "sigs.k8s.io/json"

	"github.com/detourmesh/detour/webhook/internal/fastpath"
)

// podDefaulter serves a typed defaulter of *corev1.Pod (admission.Defaulter[*corev1.Pod]),
// exactly as controller-runtime's admission.WithDefaulter does — decode, Default, answer a
// denial for an error (a status error keeps its code), a JSON patch for a change — except
// that the patch comes from [fastpath.Patch] rather than from diffing the whole documents, which
// took most of an admission's time (see docs/benchmarks-webhook.md). Should a mutation ever
// change more than fastpath.Patch handles, it falls back to the whole-document diff.
type podDefaulter struct {
	defaulter admission.Defaulter[*corev1.Pod]
}

func (h *podDefaulter) Handle(ctx context.Context, req admission.Request) admission.Response {
	if req.Operation == admissionv1.Delete {
		return admission.Allowed("")
	}
	ctx = admission.NewContextWithRequest(ctx, req)
	// The API server sends webhooks JSON; decode it as the API server does (case-sensitive,
	// integers kept), without the universal deserializer's kind sniffing.
	pod := &corev1.Pod{}
	if err := sigsjson.UnmarshalCaseSensitivePreserveInts(req.Object.Raw, pod); err != nil {
		return admission.Errored(http.StatusBadRequest, fmt.Errorf("decode the pod: %w", err))
	}
	if pod.APIVersion != "v1" || pod.Kind != "Pod" {
		return admission.Errored(http.StatusBadRequest, fmt.Errorf("the object is apiVersion %q kind %q, not a v1 Pod", pod.APIVersion, pod.Kind))
	}
	orig := pod.DeepCopy()
	if err := h.defaulter.Default(ctx, pod); err != nil {
		var status apierrors.APIStatus
		if errors.As(err, &status) {
			s := status.Status()
			return admission.Response{AdmissionResponse: admissionv1.AdmissionResponse{Allowed: false, Result: &s}}
		}
		return admission.Denied(err.Error())
	}
	if ops, ok := fastpath.Patch(orig, pod, req.Object.Raw); ok {
		if len(ops) == 0 {
			return admission.Allowed("")
		}
		return admission.Patched("", ops...)
	}
	b, err := json.Marshal(pod)
	if err != nil {
		return admission.Errored(http.StatusInternalServerError, err)
	}
	return admission.PatchResponseFromRaw(req.Object.Raw, b)
}
