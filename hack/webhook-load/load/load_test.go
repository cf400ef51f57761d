package load

import (
	"context"
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/detourmesh/detour/test/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

func fakeWebhook(t *testing.T, response string) (*httptest.Server, *atomic.Int64) {
	var n atomic.Int64
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.Add(1)
		w.Write([]byte(response))
	}))
	t.Cleanup(srv.Close)
	return srv, &n
}

func options(srv *httptest.Server) Options {
	body, _ := Review(Pod(), "bench")
	return Options{
		URL: srv.URL, CA: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}),
		Body: body, Concurrency: 4, Duration: 300 * time.Millisecond,
	}
}

func TestRun(t *testing.T) {
	srv, n := fakeWebhook(t, `{"response":{"uid":"0","allowed":true,"patch":"W10="}}`)
	r, err := Run(context.Background(), options(srv))
	if err != nil {
		t.Fatal(err)
	}
	if r.Requests == 0 || r.Errors != 0 || int64(r.Requests) > n.Load() || r.Percentile(50) > r.Percentile(99) || r.Percentile(99) > r.Percentile(100) {
		t.Errorf("closed loop: %d requests (%d served), %d errors, p50 %s p99 %s", r.Requests, n.Load(), r.Errors, r.Percentile(50), r.Percentile(99))
	}

	o := options(srv)
	o.Rate, o.Duration = 100, time.Second
	r, err = Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	if r.Requests < 80 || r.Requests > 101 {
		t.Errorf("fixed rate 100/s for 1s sent %d requests", r.Requests)
	}
}

func TestCheck(t *testing.T) {
	good, _ := fakeWebhook(t, `{"response":{"uid":"0","allowed":true,"patchType":"JSONPatch","patch":"`+
		"W3sib3AiOiJhZGQiLCJwYXRoIjoiL21ldGFkYXRhL2Fubm90YXRpb25zL2RldG91ci5kZXZ+MWluamVjdGVkIiwidmFsdWUiOiJ2MSJ9XQ=="+`"}}`)
	if err := Check(context.Background(), options(good)); err != nil {
		t.Errorf("Check of a good response: %v", err)
	}
	noMarker, _ := fakeWebhook(t, `{"response":{"uid":"0","allowed":true,"patchType":"JSONPatch","patch":"W10="}}`)
	if err := Check(context.Background(), options(noMarker)); err == nil || !strings.Contains(err.Error(), "does not mark the pod injected") {
		t.Errorf("Check of a patch without the marker: %v", err)
	}
}

func TestRunCountsRefusals(t *testing.T) {
	srv, _ := fakeWebhook(t, `{"response":{"uid":"0","allowed":false,"status":{"message":"no"}}}`)
	r, err := Run(context.Background(), options(srv))
	if err != nil {
		t.Fatal(err)
	}
	if r.Requests != 0 || r.Errors == 0 || !strings.Contains(r.FirstError, "did not inject") {
		t.Errorf("refusals: %d ok, %d errors, first %q", r.Requests, r.Errors, r.FirstError)
	}
	o := options(srv)
	o.CA = []byte("not a certificate")
	if _, err := Run(context.Background(), o); err == nil {
		t.Error("a bad CA bundle was accepted")
	}
}

func TestProcessFigures(t *testing.T) {
	rss, err := PeakRSS(os.Getpid())
	if err != nil || rss < 1<<20 {
		t.Errorf("PeakRSS = %d, %v", rss, err)
	}
	busy := time.Now()
	x := 0
	for time.Since(busy) < 50*time.Millisecond {
		x++
	}
	cpu, err := CPUTime(os.Getpid())
	if err != nil || cpu < 20*time.Millisecond {
		t.Errorf("CPUTime = %s, %v (after %d spins)", cpu, err, x)
	}
	if _, err := PeakRSS(-1); err == nil {
		t.Error("PeakRSS of no process succeeded")
	}
}
