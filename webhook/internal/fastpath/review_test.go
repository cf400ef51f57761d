package fastpath

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"testing"

	admissionv1 "k8s.io/api/admission/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) { return 0, e.err }

func TestPlainTopLevelKeys(t *testing.T) {
	for _, tc := range []struct {
		json string
		want bool
	}{
		{`{}`, true},
		{` { "apiVersion" : "v" , "kind":"k", "request": {"a":[1,{"b":"}\"]"}], "kind":1}, "n": null, "t": true, "f": -1.5e3 } `, true},
		{`{"Kind":"x"}`, false},
		{`{"APIVERSION":"x"}`, false},
		{`{"kınd":"x"}`, false}, // non-ASCII
		{`{"k\u0069nd":"x"}`, false},
		{`{"request":{"KIND":"nested keys do not matter"}}`, true},
		{`[]`, false},
		{`null`, false},
		{``, false},
		{`{"a":1`, false},
		{apiServerReview(t), true}, // the API server's review takes the fast path
	} {
		if got := plainTopLevelKeys([]byte(tc.json)); got != tc.want {
			t.Errorf("plainTopLevelKeys(%s) = %v, want %v", tc.json, got, tc.want)
		}
	}
}

// readAll reads everything, whatever size the client announced.
func TestReadAll(t *testing.T) {
	body := bytes.Repeat([]byte("0123456789"), 10_000) // larger than the 64 KiB announcement cap
	for _, n := range []int{0, 1, 511, 512, 513, 3000, 65536, len(body)} {
		for _, announced := range []int64{-1, 0, int64(n) - 1, int64(n), int64(n) + 1, 1 << 40} {
			got, err := readAll(io.LimitReader(bytes.NewReader(body), int64(n)), announced)
			if err != nil || !bytes.Equal(got, body[:n]) {
				t.Fatalf("%d bytes, %d announced: read %d bytes, %v", n, announced, len(got), err)
			}
		}
	}
	got, err := readAll(io.MultiReader(bytes.NewReader(body[:10]), errReader{io.ErrUnexpectedEOF}), 100)
	if !errors.Is(err, io.ErrUnexpectedEOF) || !bytes.Equal(got, body[:10]) {
		t.Errorf("read %q, %v", got, err)
	}
}

// apiServerReview is an AdmissionReview as the API server encodes it.
func apiServerReview(t *testing.T) string {
	b, err := json.Marshal(&admissionv1.AdmissionReview{
		TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"},
		Request: &admissionv1.AdmissionRequest{
			UID:       "00000000-0000-0000-0000-000000000000",
			Kind:      metav1.GroupVersionKind{Version: "v1", Kind: "Pod"},
			Resource:  metav1.GroupVersionResource{Version: "v1", Resource: "pods"},
			Namespace: "shop",
			Operation: admissionv1.Create,
			Object:    runtime.RawExtension{Raw: testPodJSON(t, testContainer("migrate", 0))},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
