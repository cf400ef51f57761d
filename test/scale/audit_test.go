package scale

import (
	"strings"
	"testing"
	"time"
)

// Two events of a watch (its start and its end) and one of a list, as the API server writes
// them at the Metadata level with RequestReceived omitted.
const auditSample = `{"auditID":"w1","stage":"ResponseStarted","requestURI":"/api/v1/pods?fieldSelector=spec.nodeName%3Dscale-0001\u0026watch=true","verb":"watch","user":{"username":"system:serviceaccount:detour-system:detour-node-agent","extra":{"authentication.kubernetes.io/node-name":["scale-0001"]}},"userAgent":"detour-repair/v0.2.0","objectRef":{"resource":"pods","apiVersion":"v1"},"responseStatus":{"code":200},"requestReceivedTimestamp":"2026-12-07T10:00:00.000000Z","stageTimestamp":"2026-12-07T10:00:00.010000Z"}
{"auditID":"l1","stage":"ResponseComplete","requestURI":"/api/v1/nodes/scale-0001","verb":"get","user":{"username":"system:serviceaccount:detour-system:detour-node-agent","extra":{"authentication.kubernetes.io/node-name":["scale-0001"]}},"userAgent":"detour-install-cni/v0.2.0 linux/amd64","objectRef":{"resource":"nodes","name":"scale-0001","apiVersion":"v1"},"responseStatus":{"code":200},"requestReceivedTimestamp":"2026-12-07T10:00:30.000000Z","stageTimestamp":"2026-12-07T10:00:30.004000Z"}
{"auditID":"w1","stage":"ResponseComplete","requestURI":"/api/v1/pods?fieldSelector=spec.nodeName%3Dscale-0001\u0026watch=true","verb":"watch","user":{"username":"system:serviceaccount:detour-system:detour-node-agent","extra":{"authentication.kubernetes.io/node-name":["scale-0001"]}},"userAgent":"detour-repair/v0.2.0","objectRef":{"resource":"pods","apiVersion":"v1"},"responseStatus":{"code":200},"requestReceivedTimestamp":"2026-12-07T10:00:00.000000Z","stageTimestamp":"2026-12-07T10:05:00.000000Z"}
{"auditID":"k1","stage":"ResponseComplete","requestURI":"/api/v1/nodes","verb":"list","user":{"username":"admin"},"userAgent":"kwok/v0.8.0","objectRef":{"resource":"nodes","apiVersion":"v1"},"responseStatus":{"code":429},"requestReceivedTimestamp":"2026-12-07T10:00:40.000000Z","stageTimestamp":"2026-12-07T10:00:40.100000Z"}
`

func TestParseAudit(t *testing.T) {
	reqs, err := parseAudit(strings.NewReader(auditSample))
	if err != nil {
		t.Fatal(err)
	}
	if len(reqs) != 3 {
		t.Fatalf("%d requests, want 3 (a watch's two events are one request): %+v", len(reqs), reqs)
	}
	w := reqs[0]
	if w.Part != "repair" || w.Node != "scale-0001" || !w.Watch() || w.Resource != "pods" || !strings.Contains(w.Query, "fieldSelector=spec.nodeName") || w.Started.IsZero() || w.Done.IsZero() {
		t.Errorf("the watch is %+v", w)
	}
	if g := reqs[1]; g.Part != "install-cni" || g.Verb != "get" || g.Latency() != 4*time.Millisecond {
		t.Errorf("the get is %+v (latency %s)", g, g.Latency())
	}
	if k := reqs[2]; k.Part != "other" || k.Code != 429 {
		t.Errorf("KWOK's list is %+v", k)
	}
	t0 := time.Date(2026, 12, 7, 10, 0, 0, 0, time.UTC)
	win := In(reqs, t0, t0.Add(time.Minute))
	if got := win.PerNodeMinute("install-cni", 1, false); got != 1 {
		t.Errorf("install-cni: %.2f requests per node per minute, want 1", got)
	}
	if q, throttled := win.Latencies(0.5); throttled != 1 || q[0] != 100*time.Millisecond {
		t.Errorf("latencies: p50 %s, %d throttled; want 100ms (the get's 4ms and the list's 100ms) and 1", q[0], throttled)
	}
	if open := OpenWatches(reqs, "repair", t0.Add(time.Minute)); open["scale-0001"] != 1 {
		t.Errorf("repair's open watches at 10:01: %v, want scale-0001's one", open)
	}
	if open := OpenWatches(reqs, "repair", t0.Add(6*time.Minute)); len(open) != 0 {
		t.Errorf("repair's open watches at 10:06: %v, want none (it ended at 10:05)", open)
	}
}

func TestParseAuditRefusesGarbage(t *testing.T) {
	if _, err := parseAudit(strings.NewReader("{\"auditID\":\"a\"}\nnot json\n")); err == nil || !strings.Contains(err.Error(), "line 2") {
		t.Errorf("parseAudit of a broken line: %v, want an error naming line 2", err)
	}
}

func TestAgentReady(t *testing.T) {
	t0 := time.Date(2026, 12, 7, 10, 0, 0, 0, time.UTC)
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	req := func(node, part, verb, resource string, received, done float64, code int) Request {
		return Request{Node: node, Part: part, Verb: verb, Resource: resource, Received: at(received), Done: at(done), Code: code}
	}
	w := In([]Request{
		req("a", "install-cni", "get", "nodes", 1, 1.1, 200),
		req("a", "install-cni", "patch", "nodes", 3, 3.5, 200), // a: 2.5 s
		req("a", "install-cni", "patch", "nodes", 9, 9.1, 200), // a later patch: not its readiness
		req("b", "repair", "get", "nodes", 0, 0.1, 200),        // another part: not b's start
		req("b", "install-cni", "get", "nodes", 2, 2.1, 200),
		req("b", "install-cni", "patch", "nodes", 3, 3.2, 409), // refused: not ready yet
		req("b", "install-cni", "patch", "nodes", 6, 7, 200),   // b: 5 s
		req("c", "install-cni", "get", "nodes", 2, 2.1, 200),   // c never ready: left out
	}, t0, at(60))
	got := w.AgentReady()
	want := [3]time.Duration{5 * time.Second, 5 * time.Second, 5 * time.Second}
	if got != want {
		t.Errorf("AgentReady: %v, want %v (p50 of a's 2.5 s and b's 5 s is the upper one; c never patched)", got, want)
	}
	if got := In(nil, t0, at(60)).AgentReady(); got != [3]time.Duration{} {
		t.Errorf("AgentReady of no requests: %v, want zeros", got)
	}
}
