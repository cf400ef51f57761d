package webhook

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"slices"
	"testing"

	"github.com/go-logr/logr"
	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	"github.com/detourmesh/detour/webhook/internal/fastpath"
)

// webhookPair is the same Handler behind controller-runtime's ServeHTTP and behind
// reviewHandler.
func webhookPair(t testing.TB) (cr http.Handler, fast http.Handler) {
	h := NewHandler(testConfig(t, "sidecarMode: container"), staticNamespaces(optedIn), false)
	logc := func(base logr.Logger, _ *admission.Request) logr.Logger { return base }
	cr = &admission.Webhook{Handler: h, LogConstructor: logc}
	return cr, &fastpath.ReviewHandler{Webhook: &admission.Webhook{Handler: h, LogConstructor: logc}}
}

// serve sends one request; body nil sends none, and a non-nil readErr makes the body fail
// after its bytes.
func serve(h http.Handler, contentType string, body []byte, readErr error) *httptest.ResponseRecorder {
	var r io.Reader = http.NoBody
	if body != nil {
		r = bytes.NewReader(body)
		if readErr != nil {
			r = io.MultiReader(r, errReader{readErr})
		}
	}
	req := httptest.NewRequest(http.MethodPost, MutatePath, r)
	if body == nil {
		req.Body = http.NoBody
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}

type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) { return 0, e.err }

// sameResponse fails unless both handlers answer the request alike, byte for byte.
func sameResponse(t *testing.T, cr, fast http.Handler, contentType string, body []byte, readErr error) *httptest.ResponseRecorder {
	t.Helper()
	want := serve(cr, contentType, body, readErr)
	got := serve(fast, contentType, body, readErr)
	if got.Code != want.Code || !sameBody(got.Body.Bytes(), want.Body.Bytes()) || got.Header().Get("Content-Type") != want.Header().Get("Content-Type") {
		t.Fatalf("request %.300q:\ncontroller-runtime: HTTP %d %q\n%s\nreviewHandler:      HTTP %d %q\n%s",
			body, want.Code, want.Header().Get("Content-Type"), want.Body, got.Code, got.Header().Get("Content-Type"), got.Body)
	}
	return got
}

// sameBody reports whether two response bodies are the same, but for the order of the
// operations of a patch: the whole-document diff (a pod the typed patch does not handle)
// orders them by map iteration.
func sameBody(a, b []byte) bool {
	if bytes.Equal(a, b) {
		return true
	}
	var x, y admissionv1.AdmissionReview
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil || x.Response == nil || y.Response == nil {
		return false
	}
	px, py := sortedOps(x.Response.Patch), sortedOps(y.Response.Patch)
	if px == nil || py == nil || !slices.Equal(px, py) {
		return false
	}
	x.Response.Patch, y.Response.Patch = nil, nil
	return reflect.DeepEqual(x, y)
}

func sortedOps(patch []byte) []string {
	var ops []json.RawMessage
	if json.Unmarshal(patch, &ops) != nil {
		return nil
	}
	s := make([]string, len(ops))
	for i, op := range ops {
		s[i] = string(op)
	}
	slices.Sort(s)
	return s
}

// reviewJSON is an AdmissionReview of pod with the request's fields changed by edit.
func reviewJSON(t testing.TB, apiVersion string, pod *corev1.Pod, edit func(*admissionv1.AdmissionRequest)) []byte {
	t.Helper()
	body := review(t, apiVersion, pod)
	var ar admissionv1.AdmissionReview
	if err := json.Unmarshal(body, &ar); err != nil {
		t.Fatal(err)
	}
	if edit != nil {
		edit(ar.Request)
	}
	body, err := json.Marshal(&ar)
	if err != nil {
		t.Fatal(err)
	}
	return body
}

// decodeReview decodes a response body.
func decodeReview(t *testing.T, b []byte) admissionv1.AdmissionReview {
	t.Helper()
	var ar admissionv1.AdmissionReview
	if err := json.Unmarshal(b, &ar); err != nil || ar.Response == nil {
		t.Fatalf("response %s: %v", b, err)
	}
	return ar
}

func TestReviewHandler(t *testing.T) {
	cr, fast := webhookPair(t)
	pod := testPod([]corev1.Container{runAs("migrate", 0, -1)}, nil, nil)
	v1 := reviewJSON(t, "admission.k8s.io/v1", pod, nil)

	t.Run("an injected pod: patch, warnings, UID, apiVersion", func(t *testing.T) {
		ar := decodeReview(t, sameResponse(t, cr, fast, "application/json", v1, nil).Body.Bytes())
		r := ar.Response
		if ar.APIVersion != "admission.k8s.io/v1" || ar.Kind != "AdmissionReview" || r.UID != "00000000-0000-0000-0000-000000000000" ||
			!r.Allowed || r.PatchType == nil || len(r.Patch) == 0 || len(r.Warnings) != 1 || r.Result == nil || r.Result.Code != http.StatusOK {
			t.Errorf("response %+v", ar)
		}
	})
	t.Run("v1beta1 is answered as v1beta1", func(t *testing.T) {
		ar := decodeReview(t, sameResponse(t, cr, fast, "application/json", reviewJSON(t, "admission.k8s.io/v1beta1", pod, nil), nil).Body.Bytes())
		if ar.APIVersion != "admission.k8s.io/v1beta1" || !ar.Response.Allowed || len(ar.Response.Patch) == 0 {
			t.Errorf("response %+v", ar)
		}
	})
	for _, tc := range []struct {
		name string
		edit func(*admissionv1.AdmissionRequest)
		want func(*admissionv1.AdmissionResponse) bool
	}{
		{"dry run is injected alike", func(r *admissionv1.AdmissionRequest) { r.DryRun = ptr(true) },
			func(r *admissionv1.AdmissionResponse) bool { return r.Allowed && len(r.Patch) > 0 }},
		{"DELETE is allowed untouched", func(r *admissionv1.AdmissionRequest) { r.Operation = admissionv1.Delete },
			func(r *admissionv1.AdmissionResponse) bool { return r.Allowed && len(r.Patch) == 0 && r.UID != "" }},
		{"UPDATE is allowed untouched", func(r *admissionv1.AdmissionRequest) { r.Operation = admissionv1.Update },
			func(r *admissionv1.AdmissionResponse) bool { return r.Allowed && len(r.Patch) == 0 }},
		{"CONNECT of a non-pod object is a bad request", func(r *admissionv1.AdmissionRequest) {
			r.Operation = admissionv1.Connect
			r.Object.Raw = []byte(`{"kind":"PodExecOptions","apiVersion":"v1","command":["sh"]}`)
		}, func(r *admissionv1.AdmissionResponse) bool {
			return !r.Allowed && r.Result.Code == http.StatusBadRequest
		}},
		{"an object that is not JSON is a bad request", func(r *admissionv1.AdmissionRequest) { r.Object.Raw = []byte(`"pod"`) },
			func(r *admissionv1.AdmissionResponse) bool {
				return !r.Allowed && r.Result.Code == http.StatusBadRequest
			}},
		{"no object is a bad request", func(r *admissionv1.AdmissionRequest) { r.Object.Raw = nil },
			func(r *admissionv1.AdmissionResponse) bool {
				return !r.Allowed && r.Result.Code == http.StatusBadRequest
			}},
		{"the request UID is echoed", func(r *admissionv1.AdmissionRequest) { r.UID = "a-uid" },
			func(r *admissionv1.AdmissionResponse) bool { return r.UID == "a-uid" }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := reviewJSON(t, "admission.k8s.io/v1", pod, tc.edit)
			ar := decodeReview(t, sameResponse(t, cr, fast, "application/json", body, nil).Body.Bytes())
			if !tc.want(ar.Response) {
				t.Errorf("response %+v", ar.Response)
			}
		})
	}

	// Requests the fast path leaves to controller-runtime: the answers are its own.
	huge := append(append([]byte(`{"kind":"AdmissionReview","apiVersion":"admission.k8s.io/v1","x":"`), bytes.Repeat([]byte("a"), fastpath.MaxReviewSize)...), `"}`...)
	for _, tc := range []struct {
		name, contentType string
		body              []byte
		readErr           error
		code              int32 // in the AdmissionReview's status; 0: allowed
	}{
		{"no body", "application/json", nil, nil, http.StatusBadRequest},
		{"another content type", "application/yaml", v1, nil, http.StatusBadRequest},
		{"too large", "application/json", huge, nil, http.StatusRequestEntityTooLarge},
		{"unreadable", "application/json", v1[:100], errors.New("connection reset"), http.StatusBadRequest},
		{"malformed JSON", "application/json", v1[:len(v1)-1], nil, http.StatusBadRequest},
		{"a JSON array", "application/json", []byte(`[]`), nil, http.StatusBadRequest},
		{"null", "application/json", []byte(`null`), nil, http.StatusBadRequest},
		{"no apiVersion or kind", "application/json", []byte(`{"request":{"uid":"1","operation":"DELETE"}}`), nil, 0},
		{"another kind", "application/json", []byte(`{"apiVersion":"v1","kind":"Pod","request":{"uid":"1","operation":"DELETE"}}`), nil, 0},
		{"a case variant of kind", "application/json", bytes.Replace(v1, []byte(`{`), []byte(`{"KIND":"Other",`), 1), nil, 0},
		{"a case variant of apiVersion, non-ASCII", "application/json", bytes.Replace(v1, []byte(`{`), []byte(`{"apiVerſion":"x/y",`), 1), nil, 0},
		{"an escaped key", "application/json", bytes.Replace(v1, []byte(`{`), []byte(`{"\u004bind":"Other",`), 1), nil, 0},
		{"a mistyped kind", "application/json", bytes.Replace(v1, []byte(`{`), []byte(`{"KIND":7,`), 1), nil, http.StatusBadRequest},
		{"no request", "application/json", []byte(`{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":null}`), nil, http.StatusBadRequest},
		{"YAML", "application/json", []byte("apiVersion: admission.k8s.io/v1\nkind: AdmissionReview\nrequest: {uid: '1', operation: DELETE}\n"), nil, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := sameResponse(t, cr, fast, tc.contentType, tc.body, tc.readErr)
			ar := decodeReview(t, rec.Body.Bytes())
			switch {
			case tc.code == 0 && !ar.Response.Allowed:
				t.Errorf("refused: %+v", ar.Response.Result)
			case tc.code != 0 && (ar.Response.Allowed || ar.Response.Result.Code != tc.code):
				t.Errorf("response %+v, want code %d", ar.Response, tc.code)
			}
		})
	}
}

// Any request body: the fast path answers exactly as controller-runtime's ServeHTTP does.
func FuzzReviewHandler(f *testing.F) {
	pod := testPod([]corev1.Container{runAs("migrate", 0, -1), runAs("fetch", 1001, 7)}, nil, nil)
	f.Add(reviewJSON(f, "admission.k8s.io/v1", pod, nil))
	f.Add(reviewJSON(f, "admission.k8s.io/v1beta1", pod, func(r *admissionv1.AdmissionRequest) { r.Operation = admissionv1.Delete }))
	f.Add(reviewJSON(f, "admission.k8s.io/v1", pod, func(r *admissionv1.AdmissionRequest) { r.Object.Raw = []byte(`{"kind":"Pod"}`) }))
	f.Add([]byte(`{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","KInd":"x","request":{"uid":"1","operation":"CREATE","object":{"apiVersion":"v1","kind":"Pod"}}}`))
	f.Add([]byte(`{"request":{"uid":"1","object":null}}`))
	f.Add([]byte(`null`))
	cr, fast := webhookPair(f)
	f.Fuzz(func(t *testing.T, body []byte) {
		sameResponse(t, cr, fast, "application/json", body, nil)
	})
}
