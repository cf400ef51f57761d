package webhook

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"
	sigsjson "sigs.k8s.io/json"

	"github.com/detourmesh/detour/inject"
	"github.com/detourmesh/detour/webhook/internal/fastpath"
)

// MutatePath is the URL path of the pod mutation; the Helm chart's MutatingWebhookConfiguration
// uses the same value.
const MutatePath = "/mutate-v1-pod"

// NamespaceLookup returns the annotations of a namespace. The webhook's reads a cache; the
// returned map must not be modified.
type NamespaceLookup interface {
	NamespaceAnnotations(ctx context.Context, name string) (map[string]string, error)
}

// NamespaceLookupFunc adapts a function to [NamespaceLookup].
type NamespaceLookupFunc func(ctx context.Context, name string) (map[string]string, error)

func (f NamespaceLookupFunc) NamespaceAnnotations(ctx context.Context, name string) (map[string]string, error) {
	return f(ctx, name)
}

// internalError is a failure of the webhook itself (a namespace it cannot read), not a denial
// of the pod: the response carries code 500.
type internalError struct{ err error }

func (e *internalError) Error() string { return e.err.Error() }
func (e *internalError) Unwrap() error { return e.err }

// Status makes the response carry code 500 (apierrors.APIStatus).
func (e *internalError) Status() metav1.Status {
	return *newStatus(http.StatusInternalServerError, e.err.Error())
}

func newStatus(code int32, msg string) *metav1.Status {
	return &metav1.Status{Status: metav1.StatusFailure, Code: code, Message: msg}
}

// Handler is the admission handler of [MutatePath]. It answers as controller-runtime's typed
// defaulter (admission.WithDefaulter on *corev1.Pod) would — decode, mutate, a denial for an
// error (a status error keeps its code), a JSON patch for a change — and more: the mutation's
// warnings reach the client, malformed requests are denied with a clear message, and every
// admission is counted and timed. The patch comes from [fastpath.Patch] rather than from
// diffing the whole documents, which took most of an admission's time
// (docs/benchmarks-webhook.md); should a mutation ever change more than it handles, the
// handler falls back to the whole-document diff. The tests hold it to WithDefaulter's answers.
type Handler struct {
	cfg        *inject.Config
	namespaces NamespaceLookup
	native     bool
	validator  func() inject.ValidatorDecision
	log        *slog.Logger
	metrics    *Metrics
}

// HandlerOption configures [NewHandler].
type HandlerOption func(*Handler)

// WithLogger makes the handler log refusals (and, at debug level, every admission) to log.
func WithLogger(log *slog.Logger) HandlerOption { return func(h *Handler) { h.log = log } }

// WithMetrics makes the handler count and time admissions in m; without it they are counted
// in metrics that no registry holds.
func WithMetrics(m *Metrics) HandlerOption { return func(h *Handler) { h.metrics = m } }

// WithValidatorModes makes the handler take where the validator's check runs from v (the
// webhook's decision from the cluster's nodes). Without it, validator.mode auto means the init
// container.
func WithValidatorModes(v *ValidatorModes) HandlerOption {
	return func(h *Handler) { h.validator = v.Current }
}

// NewHandler returns the admission handler for cfg. native says whether the cluster runs
// native sidecars.
func NewHandler(cfg *inject.Config, namespaces NamespaceLookup, native bool, opts ...HandlerOption) *Handler {
	h := &Handler{cfg: cfg, namespaces: namespaces, native: native}
	for _, o := range opts {
		o(h)
	}
	if h.log == nil {
		h.log = slog.New(slog.DiscardHandler)
	}
	if h.metrics == nil {
		h.metrics = newMetrics()
	}
	if h.validator == nil {
		d := inject.ResolveValidatorMode(cfg, inject.Cluster{})
		h.validator = func() inject.ValidatorDecision { return d }
	}
	return h
}

// Handle implements admission.Handler.
func (h *Handler) Handle(ctx context.Context, req admission.Request) admission.Response {
	start := time.Now()
	resp, res := h.admit(ctx, req)
	if len(resp.Patches) > 0 {
		// What admission.Response.Complete would do, with the same bytes, at half the cost.
		// Should encoding fail, Patches stay for Complete to fail on.
		if b, err := fastpath.MarshalPatch(resp.Patches); err == nil {
			pt := admissionv1.PatchTypeJSONPatch
			resp.Patch, resp.PatchType, resp.Patches = b, &pt, nil
		}
	}
	if res != nil {
		resp = resp.WithWarnings(res.Warnings...)
	}

	outcome := outcomeSkipped
	switch {
	case !resp.Allowed && resp.Result != nil && resp.Result.Code == http.StatusForbidden:
		outcome = outcomeDenied
	case !resp.Allowed:
		outcome = outcomeError
		if resp.Result == nil {
			resp.Result = newStatus(http.StatusInternalServerError, "")
		}
		if resp.Result.Code == http.StatusBadRequest {
			// The decoder's message alone ("couldn't get version/kind; json parse error...")
			// does not say that the object was the problem.
			resp.Result.Message = "detour webhook: the admission request does not hold a pod it can read: " + resp.Result.Message
		}
	case res != nil && res.Outcome == inject.Injected:
		outcome = outcomeInjected
	}
	elapsed := time.Since(start)
	h.metrics.observe(outcome, elapsed, res)
	h.logAdmission(ctx, req, resp, res, outcome, elapsed)
	return resp
}

// admit decodes the request's pod, mutates it and answers with the patch, as
// admission.WithDefaulter does. The result is nil when the pod was not mutated (an update, a
// request it could not read, a namespace it could not read).
func (h *Handler) admit(ctx context.Context, req admission.Request) (admission.Response, *inject.Result) {
	switch {
	case req.Operation == admissionv1.Delete:
		return admission.Allowed(""), nil
	case req.Operation == admissionv1.Create && !isJSONObject(req.Object.Raw):
		// The API server sends JSON; anything else would reach the patch code as garbage.
		return admission.Errored(http.StatusBadRequest, errors.New("the object is not a JSON object")), nil
	}
	// The API server sends webhooks JSON; decode it as the API server does (case-sensitive,
	// integers kept), without the universal deserializer's kind sniffing.
	pod := &corev1.Pod{}
	if err := sigsjson.UnmarshalCaseSensitivePreserveInts(req.Object.Raw, pod); err != nil {
		return admission.Errored(http.StatusBadRequest, fmt.Errorf("decode the pod: %w", err)), nil
	}
	if pod.APIVersion != "v1" || pod.Kind != "Pod" {
		return admission.Errored(http.StatusBadRequest, fmt.Errorf("the object is apiVersion %q kind %q, not a v1 Pod", pod.APIVersion, pod.Kind)), nil
	}
	orig := pod.DeepCopy()
	res, err := h.mutate(ctx, req, pod)
	if err != nil {
		return errorResponse(err), res
	}
	if ops, ok := fastpath.Patch(orig, pod, req.Object.Raw); ok {
		if len(ops) == 0 {
			return admission.Allowed(""), res
		}
		return admission.Patched("", ops...), res
	}
	b, err := json.Marshal(pod)
	if err != nil {
		return admission.Errored(http.StatusInternalServerError, err), res
	}
	return admission.PatchResponseFromRaw(req.Object.Raw, b), res
}

// mutate applies [inject.Mutate] to the pod of a create request and leaves any other alone:
// only new pods are injected, and an update cannot add containers anyway. The error is a
// [*inject.DenialError], or an [*internalError] for a failure of the webhook itself.
func (h *Handler) mutate(ctx context.Context, req admission.Request, pod *corev1.Pod) (*inject.Result, error) {
	if req.Operation != admissionv1.Create || req.SubResource != "" {
		return nil, nil
	}
	namespace := req.Namespace
	if namespace == "" {
		namespace = pod.Namespace
	}
	nsAnnotations, err := h.namespaces.NamespaceAnnotations(ctx, namespace)
	if err != nil {
		return nil, &internalError{fmt.Errorf("detour webhook: read namespace %q: %w", namespace, err)}
	}
	d := h.validator()
	in := inject.Input{Namespace: namespace, NamespaceAnnotations: nsAnnotations, NativeSidecars: h.native, Validator: d.Mode, ImageVolumesWhyNot: d.WhyNot}
	res, err := inject.Mutate(pod, in, h.cfg)
	if err != nil && !inject.IsDenial(err) {
		return &res, &internalError{err}
	}
	return &res, err
}

// errorResponse is the answer to a mutation's error, as admission.WithDefaulter gives it: a
// status error keeps its code, anything else is a denial.
func errorResponse(err error) admission.Response {
	var status apierrors.APIStatus
	if errors.As(err, &status) {
		s := status.Status()
		return admission.Response{AdmissionResponse: admissionv1.AdmissionResponse{Allowed: false, Result: &s}}
	}
	return admission.Denied(err.Error())
}

// logAdmission logs a refused admission, and at debug level every one.
func (h *Handler) logAdmission(ctx context.Context, req admission.Request, resp admission.Response, res *inject.Result, outcome string, elapsed time.Duration) {
	refused := outcome == outcomeDenied || outcome == outcomeError
	if !refused && !h.log.Enabled(ctx, slog.LevelDebug) {
		return
	}
	attrs := []any{
		"namespace", req.Namespace, "name", podName(req), "uid", string(req.UID),
		"outcome", outcome, "dryRun", req.DryRun != nil && *req.DryRun, "duration", elapsed,
	}
	if res != nil {
		attrs = append(attrs, "mode", res.Mode, "reason", res.Reason, "warnings", len(res.Warnings))
	}
	if refused {
		msg := ""
		if resp.Result != nil {
			msg = resp.Result.Message
		}
		h.log.Info("admission refused", append(attrs, "message", msg)...)
	} else {
		h.log.Debug("admission", attrs...)
	}
}

// isJSONObject is a cheap first check; the decoder finds any later syntax error.
func isJSONObject(b []byte) bool {
	b = bytes.TrimLeft(b, " \t\r\n")
	return len(b) > 0 && b[0] == '{'
}

// podName is the name of the pod in req, or its generateName prefix.
func podName(req admission.Request) string {
	if req.Name != "" {
		return req.Name
	}
	return "(generated)"
}
