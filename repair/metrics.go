package repair

import (
	"fmt"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/detourmesh/detour/annotations"
)

// Label values of the metrics.
const (
	// SkipNoController: a bare pod, annotated instead of deleted.
	SkipNoController = "no-controller"
	// SkipJob: a pod of a Job that the kubelet fails by itself (restartPolicy Never, the check
	// in the validator init container), left to its Job, which replaces it.
	SkipJob = "job"
	// SkipOwnerNotRecreating: a pod whose owner is not in --recreating-owners, annotated.
	SkipOwnerNotRecreating = "owner-not-recreating"
	// SkipAlreadyAnnotated: a bare pod annotated earlier (before a restart of the controller).
	SkipAlreadyAnnotated = "already-annotated"
	// SkipGone: the pod was deleted or replaced before the controller acted.
	SkipGone = "gone"
	// SkipCheckPortInUse: a pod whose check found its port taken by a container of the pod
	// (exit 43): a configuration error no new pod fixes; an Event (CheckPortEventReason) says so.
	SkipCheckPortInUse = "check-port-in-use"

	DeferRateLimited  = "rate-limited"
	DeferNodeNotReady = "node-not-ready"
	// DeferOwnerBackoff: a replacement of a pod deleted earlier failed again; see the owner
	// backoff in repair.go.
	DeferOwnerBackoff = "owner-backoff"

	ActionDelete   = "delete"
	ActionAnnotate = "annotate"
	ActionEvent    = "event"
	ActionReadNode = "read-node"
	// ActionSaveBackoff: writing the owner backoff into the node annotation.
	ActionSaveBackoff = "save-backoff"
)

// Metrics are the controller's Prometheus metrics.
type Metrics struct {
	// PodsSeen counts injected pods on the node whose validator found no redirect (each once).
	PodsSeen prometheus.Counter
	// PodsDeleted counts controller-owned pods deleted so their controller recreates them.
	PodsDeleted prometheus.Counter
	// PodsSkipped counts failed pods not deleted, by reason.
	PodsSkipped *prometheus.CounterVec
	// PodsDeferred counts repairs put off, by reason (rate limit, node not ready yet).
	PodsDeferred *prometheus.CounterVec
	// Errors counts failed API calls, by action.
	Errors *prometheus.CounterVec
}

// NewMetrics returns the metrics, registered with reg unless it is nil.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		PodsSeen: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "detour_repair_pods_seen_total",
			Help: "Injected pods on this node whose detour-validator exited with code 42 (no redirect), each counted once.",
		}),
		PodsDeleted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "detour_repair_pods_deleted_total",
			Help: "Controller-owned pods deleted so that their controller recreates them with the redirect.",
		}),
		PodsSkipped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "detour_repair_pods_skipped_total",
			Help: "Failed pods not deleted, by reason: no-controller, owner-not-recreating (annotated instead), job (failed by the kubelet, replaced by its Job), already-annotated, gone, check-port-in-use (the check exited 43: a container of the pod holds its port; an Event DetourCheckPortInUse, no deletion).",
		}, []string{"reason"}),
		PodsDeferred: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "detour_repair_pods_deferred_total",
			Help: "Repairs put off for a while, by reason: rate-limited, node-not-ready, owner-backoff.",
		}, []string{"reason"}),
		Errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "detour_repair_errors_total",
			Help: "Failed API calls, by action: delete, annotate, event, read-node, save-backoff.",
		}, []string{"action"}),
	}
	for _, r := range []string{SkipNoController, SkipAlreadyAnnotated, SkipGone, SkipCheckPortInUse} {
		m.PodsSkipped.WithLabelValues(r)
	}
	for _, r := range []string{DeferRateLimited, DeferNodeNotReady, DeferOwnerBackoff} {
		m.PodsDeferred.WithLabelValues(r)
	}
	for _, a := range []string{ActionDelete, ActionAnnotate, ActionEvent, ActionReadNode, ActionSaveBackoff} {
		m.Errors.WithLabelValues(a)
	}
	if reg != nil {
		reg.MustRegister(m.PodsSeen, m.PodsDeleted, m.PodsSkipped, m.PodsDeferred, m.Errors)
	}
	return m
}

// Handler serves /metrics from gatherer, /healthz, and /readyz (200 once the pod cache synced).
func (c *Controller) Handler(gatherer prometheus.Gatherer) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(gatherer, promhttp.HandlerOpts{}))
	c.addHealth(mux)
	return mux
}

// MetricsHandler serves /metrics from gatherer alone, for a metrics address apart from the
// probes'.
func MetricsHandler(gatherer prometheus.Gatherer) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(gatherer, promhttp.HandlerOpts{}))
	return mux
}

// HealthHandler serves /healthz and /readyz alone, for a probe address apart from the metrics'.
func (c *Controller) HealthHandler() http.Handler {
	mux := http.NewServeMux()
	c.addHealth(mux)
	return mux
}

func (c *Controller) addHealth(mux *http.ServeMux) {
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if !c.HasSynced() {
			w.WriteHeader(http.StatusServiceUnavailable)
			fmt.Fprintln(w, "the pod cache has not synced yet")
			return
		}
		fmt.Fprintln(w, "ok")
	})
}

// Pod states, the values of detour_repair_pods' state label.
const (
	// StateInjected: an injected pod (detour's annotations), running or starting.
	StateInjected = "injected"
	// StateCaught: an injected pod whose validator found no redirect and that is not repaired
	// yet, also while its check runs again ([Caught]; a subset of injected).
	StateCaught = "caught"
	// StateUninjected: a pod that opted in (its own detour.dev/inject or its namespace's) but
	// runs without injection: created while the webhook was down under failurePolicy Ignore,
	// or before its namespace opted in.
	StateUninjected = "uninjected"
)

var descPods = prometheus.NewDesc("detour_repair_pods",
	"This node's pods (not terminal, not in the host network) by state: injected; caught (injected, the validator found no redirect, not repaired yet, also while the check runs again); uninjected (opted in by its own or its namespace's detour.dev/inject, one the webhook injects, but without injection: admitted while the webhook was unreachable, or created before the namespace opted in).",
	[]string{"state"}, nil)

// Collector returns the gauge of the node's pods by state, read from the controller's caches at
// each scrape; it exposes nothing until both caches have synced.
func (c *Controller) Collector() prometheus.Collector { return podStates{c} }

type podStates struct{ c *Controller }

func (p podStates) Describe(ch chan<- *prometheus.Desc) { ch <- descPods }

func (p podStates) Collect(ch chan<- prometheus.Metric) {
	if !p.c.synced() || !p.c.nsSynced() {
		return
	}
	pods, err := p.c.pods.List(labels.Everything())
	if err != nil {
		return
	}
	counts := map[string]float64{StateInjected: 0, StateCaught: 0, StateUninjected: 0}
	for _, pod := range pods {
		if pod.Spec.HostNetwork || pod.DeletionTimestamp != nil ||
			pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed {
			continue
		}
		switch {
		case annotations.IsInjected(pod.Annotations):
			counts[StateInjected]++
			if Caught(pod) {
				counts[StateCaught]++
			}
		case p.c.optedIn(pod):
			counts[StateUninjected]++
		}
	}
	for _, state := range []string{StateInjected, StateCaught, StateUninjected} {
		ch <- prometheus.MustNewConstMetric(descPods, prometheus.GaugeValue, counts[state], state)
	}
}

// optedIn reports whether pod asks for injection — its own detour.dev/inject, else its
// namespace's, else the webhook's default, read with the webhook's parser (a value it refuses
// asks for nothing) — and is one the webhook would inject: not
// [NeverInjected], not in kube-system (which the chart's webhook configuration never selects)
// nor in a namespace the webhook excludes.
func (c *Controller) optedIn(pod *corev1.Pod) bool {
	if NeverInjected(pod) || pod.Namespace == metav1.NamespaceSystem || c.cfg.ExcludeNamespaces[pod.Namespace] {
		return false
	}
	v, ok := pod.Annotations[annotations.Inject]
	if !ok {
		ns, err := c.namespaces.Get(pod.Namespace)
		if err != nil {
			return false
		}
		if v, ok = ns.Annotations[annotations.Inject]; !ok {
			return c.cfg.InjectByDefault
		}
	}
	mode, err := annotations.ParseInjectMode(v)
	return err == nil && mode == annotations.InjectEnabled
}

// NeverInjected reports whether pod is one the webhook never injects, whatever it asks for:
// in the host network, one of detour's own pods (app.kubernetes.io/part-of: detour), a Windows
// pod, or a static pod's mirror (the API server never admits those through webhooks).
func NeverInjected(pod *corev1.Pod) bool {
	_, mirror := pod.Annotations[corev1.MirrorPodAnnotationKey]
	return mirror || pod.Spec.HostNetwork || pod.Labels["app.kubernetes.io/part-of"] == "detour" ||
		pod.Spec.OS != nil && pod.Spec.OS.Name == corev1.Windows
}
