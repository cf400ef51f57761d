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
// mutate it, compute the JSON patch and encode it (no TLS, no HTTP), with detour's Handler and
// with controller-runtime's admission.WithDefaulter on the same mutation for comparison.
func BenchmarkHandle(b *testing.B) {
	h := NewHandler(testConfig(b, ""), staticNamespaces(optedIn), true)
	for _, tc := range []struct {
		name string
		h    admission.Handler
	}{{"typed-patch", h}, {"controller-runtime", withDefaulter(h)}} {
		b.Run(tc.name, func(b *testing.B) {
			req := request(b, admissionv1.Create, podJSON(b, benchPod(b)))
			ctx := context.Background()
			b.ReportAllocs()
			for b.Loop() {
				resp := tc.h.Handle(ctx, req)
				if err := resp.Complete(req); err != nil || !resp.Allowed || len(resp.Patch) == 0 {
					b.Fatalf("response %+v, %v", resp.Result, err)
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
		Handler:        NewHandler(testConfig(b, ""), staticNamespaces(optedIn), true),
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
