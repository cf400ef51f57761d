package webhook

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	authzv1 "k8s.io/api/authorization/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/rest"
	k8stesting "k8s.io/client-go/testing"

	"github.com/detourmesh/detour/inject"
	"github.com/detourmesh/detour/internal/ctxtime"
)

// metricsReplies are the fake API server's answers to GET /metrics, by name.
var metricsReplies = map[string]func(w http.ResponseWriter){
	"on": func(w http.ResponseWriter) {
		_, _ = w.Write([]byte("kubernetes_feature_enabled{name=\"ImageVolume\",stage=\"BETA\"} 1\n"))
	},
	"off": func(w http.ResponseWriter) {
		_, _ = w.Write([]byte("kubernetes_feature_enabled{name=\"ImageVolume\",stage=\"BETA\"} 0\n"))
	},
	"none": func(w http.ResponseWriter) { _, _ = w.Write([]byte("apiserver_request_total{code=\"200\"} 1\n")) },
	"403":  func(w http.ResponseWriter) { http.Error(w, "forbidden", http.StatusForbidden) },
	"404":  func(w http.ResponseWriter) { http.Error(w, "not found", http.StatusNotFound) },
	"429":  func(w http.ResponseWriter) { http.Error(w, "too many requests", http.StatusTooManyRequests) },
	"500":  func(w http.ResponseWriter) { http.Error(w, "internal error", http.StatusInternalServerError) },
	"503": func(w http.ResponseWriter) {
		http.Error(w, "the API server is shutting down", http.StatusServiceUnavailable)
	},
}

// metricsServer is a fake API server over TLS and HTTP/2 that answers its nth GET /metrics with
// script[n] ("on" once the script is done); it counts the requests and the connections.
type metricsServer struct {
	*httptest.Server
	requests, conns atomic.Int32
	http1           atomic.Bool
}

func newMetricsServer(t *testing.T, script ...string) *metricsServer {
	t.Helper()
	s := &metricsServer{}
	s.Server = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := int(s.requests.Add(1)) - 1
		if r.ProtoMajor != 2 {
			s.http1.Store(true)
		}
		reply := "on"
		if n < len(script) {
			reply = script[n]
		}
		metricsReplies[reply](w)
	}))
	s.EnableHTTP2 = true
	s.Config.ConnState = func(_ net.Conn, state http.ConnState) {
		if state == http.StateNew {
			s.conns.Add(1)
		}
	}
	s.StartTLS()
	t.Cleanup(s.Close)
	return s
}

func (s *metricsServer) reader(t *testing.T) func(context.Context) gateRead {
	t.Helper()
	// No client-side rate limit: a case's rounds follow one another without a wait.
	read, err := newGateReader(&rest.Config{Host: s.URL, TLSClientConfig: rest.TLSClientConfig{Insecure: true}, QPS: -1})
	if err != nil {
		t.Fatal(err)
	}
	return read
}

// An answer of the API server is an answer, whatever it says; what is not one (a 5xx, a 429, a
// connection refused) is a transient error.
func TestReadGate(t *testing.T) {
	for _, tc := range []struct {
		reply     string
		want      string // on, off, unknown; transient for an error
		wantWhyIn string
	}{
		{"on", "on", ""},
		{"off", "off", ""},
		{"none", "unknown", "name no ImageVolume feature gate"},
		{"403", "unknown", "grant the webhook's service account get on the non-resource URL /metrics"},
		{"404", "unknown", "reading the API server's /metrics failed"},
		{"429", "transient", ""},
		{"500", "transient", ""},
		{"503", "transient", ""},
	} {
		t.Run(tc.reply, func(t *testing.T) {
			r := newMetricsServer(t, tc.reply).reader(t)(context.Background())
			got := gateName(r.gate)
			if r.err != nil {
				got = "transient"
			}
			if got != tc.want || !strings.Contains(r.why, tc.wantWhyIn) || (got == "unknown") != (r.why != "") {
				t.Errorf("%s: read %s (why %q, error %v), want %s with why containing %q", tc.reply, got, r.why, r.err, tc.want, tc.wantWhyIn)
			}
		})
	}
	t.Run("connection refused", func(t *testing.T) {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := l.Addr().String()
		l.Close()
		read, err := newGateReader(&rest.Config{Host: "https://" + addr, TLSClientConfig: rest.TLSClientConfig{Insecure: true}})
		if err != nil {
			t.Fatal(err)
		}
		if r := read(context.Background()); r.err == nil {
			t.Errorf("read %s (why %q), want a transient error", gateName(r.gate), r.why)
		}
	})
}

// Each read dials anew — even over HTTP/2, which would multiplex every read onto one
// connection — so that a load balancer in front of several API servers spreads them.
func TestGateReadsDialAnew(t *testing.T) {
	s := newMetricsServer(t)
	read := s.reader(t)
	for range gateReads {
		if r := read(context.Background()); r.err != nil || r.gate != inject.GateOn {
			t.Fatalf("read %s, %v", gateName(r.gate), r.err)
		}
	}
	if s.http1.Load() {
		t.Error("a read used HTTP/1.1: the test means to check HTTP/2")
	}
	if got, reads := s.conns.Load(), s.requests.Load(); got != reads || reads < 2 {
		t.Errorf("%d reads on %d connections, want a connection each (and several reads a round)", reads, got)
	}
}

// A round's reads, judged: any answer other than on wins at once; on needs every read; a
// transient error leaves the round undecided unless another read said off.
func TestDecideGate(t *testing.T) {
	on, off := gateRead{gate: inject.GateOn}, gateRead{gate: inject.GateOff}
	none := gateRead{gate: inject.GateUnknown, why: "no metric"}
	failed := gateRead{err: errors.New("503")}
	for _, tc := range []struct {
		name  string
		reads []gateRead
		want  string // on, off, unknown; undecided
	}{
		{"all on", []gateRead{on, on, on, on, on}, "on"},
		{"one off among ons", []gateRead{on, on, off, on, on}, "off"},
		{"no metric among ons", []gateRead{on, none, on}, "unknown"},
		{"one failed among ons", []gateRead{on, failed, on, on, on}, "undecided"},
		{"all failed", []gateRead{failed, failed}, "undecided"},
		{"off among failures", []gateRead{failed, off}, "off"},
		{"no metric among failures", []gateRead{failed, none}, "unknown"},
		{"no read", nil, "undecided"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g, why, err := decideGate(tc.reads)
			got := gateName(g)
			if err != nil {
				got = "undecided"
			}
			if got != tc.want || (got == "unknown") != (why != "") {
				t.Errorf("decideGate = %s, %q, %v; want %s", gateName(g), why, err, tc.want)
			}
		})
	}
}

// The back-off doubles from its first wait up to its cap, which jitter never exceeds.
func TestBackoff(t *testing.T) {
	for _, tc := range []struct {
		failures int
		r        float64
		want     time.Duration
	}{
		{1, 0, time.Second},
		{2, 0, 2 * time.Second},
		{3, 0, 4 * time.Second},
		{6, 0, 32 * time.Second},
		{7, 0, time.Minute},
		{1000, 0, time.Minute},
		{1, 0.5, 900 * time.Millisecond},
		{1000, 0.75, 51 * time.Second},
	} {
		if got := backoff(tc.failures, time.Second, time.Minute, tc.r); got != tc.want {
			t.Errorf("backoff(%d, 1s, 1m, %v) = %s, want %s", tc.failures, tc.r, got, tc.want)
		}
	}
	if gateRetryMax > gateRecheck/5 {
		t.Errorf("the gate's back-off is capped at %s, not well below its recheck %s", gateRetryMax, gateRecheck)
	}
}

// The watch of the API server's gate, against a fake API server whose /metrics answer by the
// script (the rounds' reads one after another, as behind a load balancer): the states it sets,
// the waits between rounds, and how often it logs a failure and a recovery.
func TestWatchGate(t *testing.T) {
	on5 := []string{"on", "on", "on", "on", "on"}
	failed5 := []string{"503", "503", "503", "503", "503"}
	for _, tc := range []struct {
		name       string
		script     [][]string // the rounds
		states     []string   // the states set, each change once
		whyIn      string     // in the last why
		waits      []time.Duration
		failures   int // log lines for a streak of failures
		recoveries int
	}{
		{name: "all on", script: [][]string{on5}, states: []string{"on"}, waits: []time.Duration{gateRecheck}},
		{name: "one off among ons", script: [][]string{{"on", "on", "off"}}, states: []string{"off"}, waits: []time.Duration{gateRecheck}},
		{name: "a 503 after on keeps on", script: [][]string{on5, failed5, on5}, states: []string{"on"},
			waits: []time.Duration{gateRecheck, time.Second, gateRecheck}, failures: 1, recoveries: 1},
		{name: "an error streak, then recovery", script: [][]string{on5, failed5, {"429", "429", "429", "429", "429"}, {"503", "on", "on", "on", "on"}, on5},
			states: []string{"on"}, waits: []time.Duration{gateRecheck, time.Second, 2 * time.Second, 4 * time.Second, gateRecheck}, failures: 1, recoveries: 1},
		{name: "off among failures is adopted", script: [][]string{on5, {"503", "503", "off"}}, states: []string{"on", "off"},
			waits: []time.Duration{gateRecheck, gateRecheck}},
		{name: "before any answer the state is unknown", script: [][]string{failed5, on5}, states: []string{"unknown", "on"}, whyIn: "",
			waits: []time.Duration{time.Second, gateRecheck}, failures: 1, recoveries: 1},
		{name: "forbidden is an answer", script: [][]string{on5, {"403"}}, states: []string{"on", "unknown"}, whyIn: "was forbidden: grant",
			waits: []time.Duration{gateRecheck, gateRecheck}},
		{name: "no metric is an answer", script: [][]string{on5, {"none"}}, states: []string{"on", "unknown"}, whyIn: "name no ImageVolume",
			waits: []time.Duration{gateRecheck, gateRecheck}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newMetricsServer(t, slices.Concat(tc.script...)...)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			var logs bytes.Buffer
			var states []string
			var whys []string
			var waits []time.Duration
			w := &gateWatch{
				read: s.reader(t),
				set: func(g inject.Gate, why string) {
					if len(states) == 0 || states[len(states)-1] != gateName(g) {
						states = append(states, gateName(g))
					}
					whys = append(whys, why)
				},
				log: slog.New(slog.NewTextHandler(&logs, nil)),
				sleep: func(ctx context.Context, d time.Duration) error {
					waits = append(waits, d)
					if len(waits) == len(tc.script) {
						cancel()
					}
					return ctx.Err()
				},
				jitter: func() float64 { return 0 },
			}
			w.run(ctx)
			if got, want := int(s.requests.Load()), len(slices.Concat(tc.script...)); got != want {
				t.Errorf("%d reads, want %d", got, want)
			}
			if !slices.Equal(states, tc.states) {
				t.Errorf("states %q, want %q", states, tc.states)
			}
			if tc.whyIn != "" && (len(whys) == 0 || !strings.Contains(whys[len(whys)-1], tc.whyIn)) {
				t.Errorf("whys %q, want the last to contain %q", whys, tc.whyIn)
			}
			if !slices.Equal(waits, tc.waits) {
				t.Errorf("waits %v, want %v", waits, tc.waits)
			}
			failures := strings.Count(logs.String(), "reading the API server's ImageVolume gate failed")
			recoveries := strings.Count(logs.String(), "read the API server's ImageVolume gate again")
			if failures != tc.failures || recoveries != tc.recoveries {
				t.Errorf("logged %d failures and %d recoveries, want %d and %d:\n%s", failures, recoveries, tc.failures, tc.recoveries, logs.String())
			}
			if tc.failures > 0 && !strings.Contains(logs.String(), "the server is currently unable to handle the request") {
				t.Errorf("the failure's log line does not carry the error:\n%s", logs.String())
			}
		})
	}
}

// ssarClient is a fake clientset whose SelfSubjectAccessReviews fail failures times with a 503,
// then answer allowed.
func ssarClient(failures int, allowed bool) (*fake.Clientset, *atomic.Int32) {
	cs := fake.NewClientset()
	var calls atomic.Int32
	cs.PrependReactor("create", "selfsubjectaccessreviews", func(action k8stesting.Action) (bool, runtime.Object, error) {
		if int(calls.Add(1)) <= failures {
			return true, nil, apierrors.NewServiceUnavailable("the API server is shutting down")
		}
		review := action.(k8stesting.CreateAction).GetObject().(*authzv1.SelfSubjectAccessReview).DeepCopy()
		review.Status.Allowed = allowed
		return true, review, nil
	})
	return cs, &calls
}

// At the webhook's start an API server briefly unavailable is asked again, with back-off, until
// it answers; its answer is used as it is.
func TestMayWatchNodesRetries(t *testing.T) {
	for _, tc := range []struct {
		name     string
		failures int
		allowed  bool
		whyIn    string
	}{
		{"fails twice, then allows", 2, true, ""},
		{"fails once, then denies", 1, false, "the webhook may not list nodes (its RBAC)"},
		{"allows", 0, true, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cs, _ := ssarClient(tc.failures, tc.allowed)
			var logs bytes.Buffer
			var waits []time.Duration
			may, why, err := mayWatchNodes(context.Background(), cs, slog.New(slog.NewTextHandler(&logs, nil)),
				func(_ context.Context, d time.Duration) error { waits = append(waits, d); return nil })
			if err != nil || may != tc.allowed || !strings.Contains(why, tc.whyIn) || tc.allowed != (why == "") {
				t.Fatalf("mayWatchNodes = %v, %q, %v; want %v", may, why, err, tc.allowed)
			}
			if len(waits) != tc.failures || len(waits) == 2 && waits[1] <= waits[0] {
				t.Errorf("waits %v, want %d, growing", waits, tc.failures)
			}
			if got := strings.Count(logs.String(), "the API server is shutting down"); got != tc.failures {
				t.Errorf("%d failures logged with their error, want %d:\n%s", got, tc.failures, logs.String())
			}
		})
	}
}

// The webhook stopping ends the wait, with the context's error.
func TestMayWatchNodesEndsWithContext(t *testing.T) {
	cs, calls := ssarClient(1<<30, true)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, _, err := mayWatchNodes(ctx, cs, slog.New(slog.DiscardHandler),
			func(ctx context.Context, _ time.Duration) error { return ctxtime.Sleep(ctx, time.Hour) })
		done <- err
	}()
	for calls.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("mayWatchNodes = %v, want the context's error", err)
	}
}
