package webhook

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

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

// report is what the defaulter tells the handler wrapper about one admission: the typed
// defaulter API returns only an error, so warnings and the outcome travel in the context.
type report struct {
	mu       sync.Mutex
	warnings []string
	result   *inject.Result
}

type reportKey struct{}

func reportFrom(ctx context.Context) *report {
	r, _ := ctx.Value(reportKey{}).(*report)
	return r
}

// defaulter is the typed defaulter of *corev1.Pod that applies [inject.Mutate].
type defaulter struct {
	cfg        *inject.Config
	namespaces NamespaceLookup
	native     bool
}

// internalError is a failure of the webhook itself (a namespace it cannot read), not a denial
// of the pod: the response carries code 500.
type internalError struct{ err error }

func (e *internalError) Error() string { return e.err.Error() }
func (e *internalError) Unwrap() error { return e.err }

// Status makes the defaulter answer with code 500 (apierrors.APIStatus).
func (e *internalError) Status() metav1.Status {
	return *newStatus(http.StatusInternalServerError, e.err.Error())
}

func newStatus(code int32, msg string) *metav1.Status {
	return &metav1.Status{Status: metav1.StatusFailure, Code: code, Message: msg}
}

func (d *defaulter) Default(ctx context.Context, pod *corev1.Pod) error {
	req, err := admission.RequestFromContext(ctx)
	if err != nil {
		return fmt.Errorf("detour webhook: %w", err)
	}
	// Only new pods are injected; an update cannot add containers anyway.
	if req.Operation != admissionv1.Create || req.SubResource != "" {
		return nil
	}
	namespace := req.Namespace
	if namespace == "" {
		namespace = pod.Namespace
	}
	nsAnnotations, err := d.namespaces.NamespaceAnnotations(ctx, namespace)
	if err != nil {
		return &internalError{fmt.Errorf("detour webhook: read namespace %q: %w", namespace, err)}
	}
	res, err := inject.Mutate(pod, inject.Input{Namespace: namespace, NamespaceAnnotations: nsAnnotations, NativeSidecars: d.native}, d.cfg)
	if r := reportFrom(ctx); r != nil {
		r.mu.Lock()
		r.warnings = append(r.warnings, res.Warnings...)
		r.result = &res
		r.mu.Unlock()
	}
	if err != nil && !inject.IsDenial(err) {
		return &internalError{err}
	}
	return err
}

// useWithDefaulter selects controller-runtime's admission.WithDefaulter instead of
// podDefaulter; the benchmarks compare the two.
var useWithDefaulter = false

// Handler is the admission handler of [MutatePath]: the typed defaulter wrapped so that the
// mutation's warnings reach the client, malformed requests are denied with a clear message,
// and every admission is counted and timed.
type Handler struct {
	inner   admission.Handler
	log     *slog.Logger
	metrics *metrics
}

// NewHandler returns the admission handler for cfg. native says whether the cluster runs
// native sidecars; log may be nil.
func NewHandler(cfg *inject.Config, namespaces NamespaceLookup, native bool, log *slog.Logger) *Handler {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	scheme := runtime.NewScheme()
	_ = corev1.AddToScheme(scheme) // cannot fail: a fresh scheme and a fixed group
	d := &defaulter{cfg: cfg, namespaces: namespaces, native: native}
	var inner admission.Handler = &podDefaulter{defaulter: d}
	if useWithDefaulter {
		inner = admission.WithDefaulter[*corev1.Pod](scheme, d).Handler
	}
	return &Handler{inner: inner, log: log, metrics: defaultMetrics()}
}

// Handle implements admission.Handler.
func (h *Handler) Handle(ctx context.Context, req admission.Request) admission.Response {
	start := time.Now()
	rep := &report{}
	var resp admission.Response
	if req.Operation == admissionv1.Create && !isJSONObject(req.Object.Raw) {
		// The API server sends JSON; anything else would reach the patch code as garbage.
		resp = admission.Errored(http.StatusBadRequest, errors.New("the object is not a JSON object"))
	} else {
		resp = h.inner.Handle(context.WithValue(ctx, reportKey{}, rep), req)
	}
	if len(resp.Patches) > 0 {
		// What admission.Response.Complete would do, with the same bytes, at half the cost.
		// Should encoding fail, Patches stay for Complete to fail on.
		if b, err := fastpath.MarshalPatch(resp.Patches); err == nil {
			pt := admissionv1.PatchTypeJSONPatch
			resp.Patch, resp.PatchType, resp.Patches = b, &pt, nil
		}
	}

	rep.mu.Lock()
	warnings, res := rep.warnings, rep.result
	rep.mu.Unlock()
	resp = resp.WithWarnings(warnings...)

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

	refused := outcome == outcomeDenied || outcome == outcomeError
	if !refused && !h.log.Enabled(ctx, slog.LevelDebug) {
		return resp
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
	return resp
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
