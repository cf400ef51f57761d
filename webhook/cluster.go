package webhook

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"time"

	authzv1 "k8s.io/api/authorization/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilnet "k8s.io/apimachinery/pkg/util/net"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/detourmesh/detour/inject"
	"github.com/detourmesh/detour/internal/ctxtime"
)

// What the webhook learns of the cluster besides its nodes, for where the validator's check
// runs: whether the API server keeps image volumes, and whether the webhook may watch nodes.

// imageVolumeGate is the name of the API server's feature gate for image volumes.
const imageVolumeGate = "ImageVolume"

// gateRecheck is how often the webhook reads the API server's gate again: it changes only when
// an API server restarts (an upgrade, a flag changed).
const gateRecheck = 10 * time.Minute

// gateReads is how many times a round reads /metrics, each on a connection of its own. Behind
// one load balancer (or the kubernetes Service) each read may reach another API server, and in a
// rolling control-plane upgrade some keep the gate off: one off is enough to believe off, on
// needs every read. A round misses all of k old API servers of n with probability
// ((n-k)/n)^gateReads — 13% for 1 of 3 — and the next round looks again; more reads would cost
// every API server more scrapes of its /metrics (hundreds of kilobytes each) for little.
const gateReads = 5

// gateReadTimeout bounds one read: an API server that accepts and never answers (it is stopping)
// must not hold the round.
const gateReadTimeout = 15 * time.Second

// The back-off after a transient error (an API server restarting, overloaded: no answer), from
// retryFirst doubling to a cap. The gate's cap is well below gateRecheck, to catch up soon after
// the upgrade that caused the errors, and long enough to add little to an API server's load; the
// nodes' is shorter, as the webhook is not Ready until it knows.
const (
	retryFirst    = time.Second
	gateRetryMax  = time.Minute
	nodesRetryMax = 15 * time.Second
)

// backoff is the wait after failures transient errors in a row: first doubling up to limit,
// less up to a fifth of it at random (r in [0, 1)), so that replicas which failed together do
// not retry together, and never more than limit.
func backoff(failures int, first, limit time.Duration, r float64) time.Duration {
	d := first
	for i := 1; i < failures && d < limit; i++ {
		d *= 2
	}
	d = min(d, limit)
	return d - time.Duration(float64(d)*r/5)
}

// APIServerGate reads whether the API server keeps image volumes: its ImageVolume feature gate,
// from the API server's own /metrics (kubernetes_feature_enabled, Kubernetes 1.26 and later).
// The state is unknown when the metrics cannot be read (why says so, with the fix) or do not
// name the gate. It reads once, and an error is unknown: the webhook itself reads in rounds
// ([gateWatch]), and keeps what it knew through transient errors.
func APIServerGate(ctx context.Context, cs kubernetes.Interface) (inject.Gate, string) {
	r := readGate(ctx, cs.CoreV1().RESTClient())
	if r.err != nil {
		return inject.GateUnknown, fmt.Sprintf("reading the API server's /metrics failed: %v", r.err)
	}
	return r.gate, r.why
}

// gateRead is what one read of /metrics said: an answer (gate, and why when it is unknown), or
// err, a transient error that answers nothing.
type gateRead struct {
	gate inject.Gate
	why  string
	err  error
}

// readGate reads the API server's gate once through rc.
func readGate(ctx context.Context, rc rest.Interface) gateRead {
	ctx, cancel := context.WithTimeout(ctx, gateReadTimeout)
	defer cancel()
	body, err := rc.Get().AbsPath("/metrics").Do(ctx).Raw()
	switch {
	case err == nil:
		g, why := gateFromMetrics(body, imageVolumeGate)
		return gateRead{gate: g, why: why}
	case apierrors.IsForbidden(err):
		return gateRead{gate: inject.GateUnknown, why: "reading the API server's /metrics was forbidden: grant the webhook's service account get on the non-resource URL /metrics, as the chart's ClusterRole detour-webhook does"}
	case transient(err):
		return gateRead{err: err}
	}
	return gateRead{gate: inject.GateUnknown, why: fmt.Sprintf("reading the API server's /metrics failed: %v", err)}
}

// transient reports whether err is no answer of the API server: no response at all (a refused
// or broken connection, a timeout), or one that says to try again (429, 5xx).
func transient(err error) bool {
	var status apierrors.APIStatus
	if !errors.As(err, &status) {
		return true
	}
	code := status.Status().Code
	return code == 0 || code == http.StatusTooManyRequests || code >= http.StatusInternalServerError
}

// newGateReader returns a read of the API server's gate through cfg on a connection of its
// own. client-go shares a transport among the clients of equal configs and keeps its
// connections, HTTP/2 multiplexing every request onto one: each read would reach the same API
// server. A Dial func of its own gives the reader a transport of its own (client-go keys its
// cache on the func's holder, new for this config), whose connections are closed after each
// read, so that the next one dials anew and the load balancer chooses again.
func newGateReader(cfg *rest.Config) (func(context.Context) gateRead, error) {
	c := rest.CopyConfig(cfg)
	c.Dial = (&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext
	hc, err := rest.HTTPClientFor(c)
	if err != nil {
		return nil, fmt.Errorf("create the client that reads the API server's /metrics: %w", err)
	}
	cs, err := kubernetes.NewForConfigAndClient(c, hc)
	if err != nil {
		return nil, fmt.Errorf("create the client that reads the API server's /metrics: %w", err)
	}
	rc := cs.CoreV1().RESTClient()
	return func(ctx context.Context) gateRead {
		defer utilnet.CloseIdleConnectionsFor(hc.Transport)
		return readGate(ctx, rc)
	}, nil
}

// decideGate judges a round of reads: an answer other than on (off, or unknown: no metric,
// forbidden) wins at once, as adopting it is always safe; on needs every read to say on. A
// transient error leaves the round undecided otherwise (the error), since the read that failed
// may have been the only one to reach an API server with the gate off.
func decideGate(reads []gateRead) (inject.Gate, string, error) {
	var first error
	failed := 0
	for _, r := range reads {
		switch {
		case r.err != nil:
			failed++
			first = cmp.Or(first, r.err)
		case r.gate != inject.GateOn:
			return r.gate, r.why, nil
		}
	}
	switch {
	case failed > 0:
		return inject.GateUnknown, "", fmt.Errorf("%d of %d reads of the API server's /metrics failed: %w", failed, len(reads), first)
	case len(reads) == 0:
		return inject.GateUnknown, "", errors.New("the API server's /metrics were not read")
	}
	return inject.GateOn, "", nil
}

// gateWatch keeps the API server's gate up to date: a round of reads at start and every
// gateRecheck. A round with transient errors keeps the last state (an API server restarting in
// an upgrade says nothing of the gate) and is tried again with back-off; before any answer the
// state stays unknown, the init container.
type gateWatch struct {
	read func(context.Context) gateRead
	set  func(inject.Gate, string)
	log  *slog.Logger
	// sleep and jitter (in [0, 1)) are the waits' (default ctxtime.Sleep and math/rand/v2's Float64).
	sleep  func(context.Context, time.Duration) error
	jitter func() float64
}

// run reads until ctx ends.
func (w *gateWatch) run(ctx context.Context) {
	wait, jitter := w.sleep, w.jitter
	if wait == nil {
		wait = ctxtime.Sleep
	}
	if jitter == nil {
		jitter = rand.Float64
	}
	last, answered, failures := inject.Gate(-1), false, 0
	for {
		g, why, err := w.round(ctx)
		if ctx.Err() != nil {
			return
		}
		next := gateRecheck
		switch {
		case err != nil:
			failures++
			next = backoff(failures, retryFirst, gateRetryMax, jitter())
			if failures > 1 {
				break // logged once a streak
			}
			state := "unknown, not read yet"
			if answered {
				state = gateName(last)
			}
			w.log.Warn("reading the API server's ImageVolume gate failed: keeping its last state, retrying with back-off until it answers",
				"error", err, "state", state, "retryIn", next)
			if !answered {
				w.set(inject.GateUnknown, fmt.Sprintf("reading the API server's /metrics failed: %v", err))
			}
		default:
			if failures > 0 {
				w.log.Info("read the API server's ImageVolume gate again", "failedRounds", failures, "state", gateName(g))
				failures = 0
			}
			if g != last {
				w.log.Info("the API server's ImageVolume feature gate", "state", gateName(g), "why", why)
				last = g
			}
			answered = true
			w.set(g, why)
		}
		if wait(ctx, next) != nil {
			return
		}
	}
}

// round reads the gate up to gateReads times, and stops at the first answer other than on.
func (w *gateWatch) round(ctx context.Context) (inject.Gate, string, error) {
	reads := make([]gateRead, 0, gateReads)
	for range gateReads {
		r := w.read(ctx)
		reads = append(reads, r)
		if ctx.Err() != nil || r.err == nil && r.gate != inject.GateOn {
			break
		}
	}
	return decideGate(reads)
}

func gateName(g inject.Gate) string {
	switch g {
	case inject.GateOn:
		return "on"
	case inject.GateOff:
		return "off"
	}
	return "unknown"
}

// gateFromMetrics finds gate in a Prometheus text exposition's kubernetes_feature_enabled.
func gateFromMetrics(body []byte, gate string) (inject.Gate, string) {
	name := `name="` + gate + `"`
	lines := bufio.NewScanner(bytes.NewReader(body))
	lines.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for lines.Scan() {
		rest, ok := strings.CutPrefix(lines.Text(), "kubernetes_feature_enabled{")
		if !ok {
			continue
		}
		labels, value, ok := strings.Cut(rest, "} ")
		if !ok || !strings.Contains(","+labels+",", ","+name+",") {
			continue
		}
		if strings.TrimSpace(value) == "1" {
			return inject.GateOn, ""
		}
		return inject.GateOff, ""
	}
	return inject.GateUnknown, "the API server's /metrics name no " + gate + " feature gate (kubernetes_feature_enabled): an API server older than 1.31, where image volumes do not exist, or one that hides the metric"
}

// mayWatchNodes reports whether the webhook may list and watch nodes, asking the API server
// (a SelfSubjectAccessReview each, which every authenticated identity may create); why says
// what is missing and how to grant it. It asks again, with back-off, until the API server
// answers or ctx ends (then the error is ctx's): an API server briefly unavailable at the
// webhook's start must not end the process.
func mayWatchNodes(ctx context.Context, cs kubernetes.Interface, log *slog.Logger, sleep func(context.Context, time.Duration) error) (bool, string, error) {
	for failures := 1; ; failures++ {
		may, why, err := askWatchNodes(ctx, cs)
		if err == nil {
			return may, why, nil
		}
		if ctx.Err() != nil {
			return false, "", fmt.Errorf("ask whether the webhook may watch nodes: %w", ctx.Err())
		}
		next := backoff(failures, retryFirst, nodesRetryMax, rand.Float64())
		log.Warn("asking the API server whether the webhook may watch nodes failed: asking again; the webhook is not Ready until it answers",
			"error", err, "retryIn", next)
		if err := sleep(ctx, next); err != nil {
			return false, "", fmt.Errorf("ask whether the webhook may watch nodes: %w", err)
		}
	}
}

// askWatchNodes asks once.
func askWatchNodes(ctx context.Context, cs kubernetes.Interface) (bool, string, error) {
	for _, verb := range []string{"list", "watch"} {
		review := &authzv1.SelfSubjectAccessReview{Spec: authzv1.SelfSubjectAccessReviewSpec{
			ResourceAttributes: &authzv1.ResourceAttributes{Verb: verb, Resource: "nodes"},
		}}
		res, err := cs.AuthorizationV1().SelfSubjectAccessReviews().Create(ctx, review, metav1.CreateOptions{})
		if err != nil {
			return false, "", fmt.Errorf("ask whether the webhook may %s nodes: %w", verb, err)
		}
		if !res.Status.Allowed {
			return false, fmt.Sprintf("the webhook may not %s nodes (its RBAC): grant its service account list and watch on nodes, as the chart's ClusterRole detour-webhook does, for the check to run in the proxy's start", verb), nil
		}
	}
	return true, "", nil
}
