package scale

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"slices"
	"sort"
	"strings"
	"time"
)

// Request is one API request from the audit log.
type Request struct {
	// Part is the detour part that made it ("install-cni", "repair", "webhook", "check", from its
	// user agent), or "other".
	Part string
	// Node is the node of the token it authenticated with, if bound to a pod on a node.
	Node     string
	Verb     string
	Resource string // resource[/subresource]
	// Query is the request URI's query (the selectors of a list or watch).
	Query    string
	Code     int
	Received time.Time
	// Started is when a watch's response started; Done when the request's response completed
	// (zero while a watch is open at the log's end).
	Started, Done time.Time
}

// Latency is the request's time in the API server, for a request that is not a watch.
func (r Request) Latency() time.Duration { return r.Done.Sub(r.Received) }

// Watch reports whether the request is a watch.
func (r Request) Watch() bool { return r.Verb == "watch" }

// auditEvent is the part of an audit.k8s.io/v1 Event the harness reads.
type auditEvent struct {
	AuditID    string `json:"auditID"`
	Stage      string `json:"stage"`
	RequestURI string `json:"requestURI"`
	Verb       string `json:"verb"`
	User       struct {
		Username string              `json:"username"`
		Extra    map[string][]string `json:"extra"`
	} `json:"user"`
	UserAgent string `json:"userAgent"`
	ObjectRef *struct {
		Resource    string `json:"resource"`
		Subresource string `json:"subresource"`
	} `json:"objectRef"`
	ResponseStatus *struct {
		Code int `json:"code"`
	} `json:"responseStatus"`
	RequestReceivedTimestamp time.Time `json:"requestReceivedTimestamp"`
	StageTimestamp           time.Time `json:"stageTimestamp"`
}

// ReadAudit reads the requests of the audit log at path, in the order they were received.
func ReadAudit(path string) ([]Request, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return parseAudit(f)
}

func parseAudit(r io.Reader) ([]Request, error) {
	byID := map[string]int{}
	var out []Request
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for line := 1; sc.Scan(); line++ {
		var ev auditEvent
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			return nil, fmt.Errorf("audit log line %d: %w", line, err)
		}
		i, seen := byID[ev.AuditID]
		if !seen {
			i = len(out)
			byID[ev.AuditID] = i
			req := Request{Part: partOf(ev.UserAgent), Verb: ev.Verb, Received: ev.RequestReceivedTimestamp}
			if nodes := ev.User.Extra["authentication.kubernetes.io/node-name"]; len(nodes) > 0 {
				req.Node = nodes[0]
			}
			if ev.ObjectRef != nil {
				req.Resource = ev.ObjectRef.Resource
				if ev.ObjectRef.Subresource != "" {
					req.Resource += "/" + ev.ObjectRef.Subresource
				}
			}
			if _, q, ok := strings.Cut(ev.RequestURI, "?"); ok {
				req.Query = q
			}
			out = append(out, req)
		}
		switch ev.Stage {
		case "ResponseStarted":
			out[i].Started = ev.StageTimestamp
		case "ResponseComplete", "Panic":
			out[i].Done = ev.StageTimestamp
			if ev.ResponseStatus != nil {
				out[i].Code = ev.ResponseStatus.Code
			}
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	sort.SliceStable(out, func(a, b int) bool { return out[a].Received.Before(out[b].Received) })
	return out, nil
}

// partOf is the detour part of a user agent "detour-<part>/<version> …".
func partOf(userAgent string) string {
	name, _, _ := strings.Cut(userAgent, "/")
	if part, ok := strings.CutPrefix(name, "detour-"); ok {
		return part
	}
	return "other"
}

// Window is the requests received in [From, To).
type Window struct {
	From, To time.Time
	Requests []Request
}

// In returns the requests received in [from, to).
func In(reqs []Request, from, to time.Time) Window {
	w := Window{From: from, To: to}
	for _, r := range reqs {
		if !r.Received.Before(from) && r.Received.Before(to) {
			w.Requests = append(w.Requests, r)
		}
	}
	return w
}

// Count is a number of requests of one kind.
type Count struct {
	Part, Verb, Resource string
	N                    int
}

// Counts are w's requests by part, verb and resource (watches apart), the largest first.
func (w Window) Counts(part string) []Count {
	m := map[Count]int{}
	for _, r := range w.Requests {
		if part != "" && r.Part != part {
			continue
		}
		m[Count{Part: r.Part, Verb: r.Verb, Resource: r.Resource}]++
	}
	var out []Count
	for k, n := range m {
		k.N = n
		out = append(out, k)
	}
	slices.SortFunc(out, func(a, b Count) int {
		if a.N != b.N {
			return b.N - a.N
		}
		return strings.Compare(a.Part+a.Verb+a.Resource, b.Part+b.Verb+b.Resource)
	})
	return out
}

// PerNodeMinute is part's requests in w per node per minute, watches counted or not.
func (w Window) PerNodeMinute(part string, nodes int, watches bool) float64 {
	n := 0
	for _, r := range w.Requests {
		if r.Part == part && r.Watch() == watches {
			n++
		}
	}
	return float64(n) / float64(nodes) / w.To.Sub(w.From).Minutes()
}

// OpenWatches counts part's watches open at t, by node.
func OpenWatches(reqs []Request, part string, t time.Time) map[string]int {
	open := map[string]int{}
	for _, r := range reqs {
		if r.Part == part && r.Watch() && !r.Received.After(t) && (r.Done.IsZero() || r.Done.After(t)) && r.Code < 300 {
			open[r.Node]++
		}
	}
	return open
}

// Latencies are the quantiles q of the latency of w's requests that are not watches, and how
// many were answered 429 (Too Many Requests).
func (w Window) Latencies(q ...float64) (quantiles []time.Duration, throttled int) {
	var l []time.Duration
	for _, r := range w.Requests {
		if r.Code == 429 {
			throttled++
		}
		if !r.Watch() && !r.Done.IsZero() {
			l = append(l, r.Latency())
		}
	}
	slices.Sort(l)
	for _, p := range q {
		if len(l) == 0 {
			quantiles = append(quantiles, 0)
			continue
		}
		quantiles = append(quantiles, l[min(len(l)-1, int(p*float64(len(l))))])
	}
	return quantiles, throttled
}

// AgentReady is how long each agent took to declare its node ready in w: from its install-cni's
// first request to its first patch of the node (the ready label, the startup taint's removal),
// over the nodes whose agent did both in w; p50, p99 and the longest.
func (w Window) AgentReady() [3]time.Duration {
	first, ready := map[string]time.Time{}, map[string]time.Time{}
	for _, r := range w.Requests {
		if r.Part != "install-cni" || r.Node == "" {
			continue
		}
		if t, ok := first[r.Node]; !ok || r.Received.Before(t) {
			first[r.Node] = r.Received
		}
		if r.Verb == "patch" && r.Resource == "nodes" && r.Code < 300 && !r.Done.IsZero() {
			if t, ok := ready[r.Node]; !ok || r.Done.Before(t) {
				ready[r.Node] = r.Done
			}
		}
	}
	var d []time.Duration
	for node, t := range ready {
		d = append(d, t.Sub(first[node]))
	}
	return spread(d)
}

// spread is d's p50, p99 and largest (zeros for none); it sorts d.
func spread(d []time.Duration) [3]time.Duration {
	if len(d) == 0 {
		return [3]time.Duration{}
	}
	slices.Sort(d)
	return [3]time.Duration{d[len(d)/2], d[min(len(d)-1, len(d)*99/100)], d[len(d)-1]}
}
