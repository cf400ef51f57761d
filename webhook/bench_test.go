package webhook

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/go-logr/logr"
	admissionv1 "k8s.io/api/admission/v1"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	"github.com/detourmesh/detour/webhook/internal/fastpath"
)

// BenchmarkHandle is one whole admission as the server handles it: decode the request's pod,
// mutate it, and compute the JSON patch (no TLS, no HTTP), with detour's typed-patch handler
// and with controller-runtime's admission.WithDefaulter for comparison.
func BenchmarkHandle(b *testing.B) {
	for _, tc := range []struct {
		name string
		cr   bool
	}{{"typed-patch", false}, {"controller-runtime", true}} {
		b.Run(tc.name, func(b *testing.B) {
			useWithDefaulter = tc.cr
			defer func() { useWithDefaulter = false }()
			h := NewHandler(testConfig(b, ""), staticNamespaces(optedIn), true, nil)
			req := request(b, admissionv1.Create, podJSON(b, benchPod(b)))
			ctx := context.Background()
			b.ReportAllocs()
			for b.Loop() {
				if resp := h.Handle(ctx, req); !resp.Allowed || !patched(resp) {
					b.Fatalf("response %+v", resp.Result)
				}
			}
		})
	}
}

// BenchmarkServeHTTP adds what the webhook server does around Handle: decode the
// AdmissionReview, encode the response (no TLS, no network), with detour's fastpath.ReviewHandler (what
// Run serves) and with controller-runtime's admission.Webhook alone for comparison.
func BenchmarkServeHTTP(b *testing.B) {
	wh := &admission.Webhook{
		Handler:        NewHandler(testConfig(b, ""), staticNamespaces(optedIn), true, nil),
		LogConstructor: func(base logr.Logger, _ *admission.Request) logr.Logger { return base }, // as Run does
	}
	body := review(b, "admission.k8s.io/v1", benchPod(b))
	for _, tc := range []struct {
		name string
		h    http.Handler
	}{{"review-handler", &fastpath.ReviewHandler{Webhook: wh}}, {"controller-runtime", wh}} {
		b.Run(tc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				rec := httptest.NewRecorder()
				req := httptest.NewRequest(http.MethodPost, MutatePath, bytes.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				tc.h.ServeHTTP(rec, req)
				if rec.Code != http.StatusOK {
					b.Fatalf("HTTP %d: %s", rec.Code, rec.Body)
				}
			}
		})
	}
}
