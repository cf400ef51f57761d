package webhook

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"

	"github.com/detourmesh/detour/inject"
)

// Admission outcomes, the values of the outcome label.
const (
	outcomeInjected = "injected"
	outcomeSkipped  = "skipped"
	outcomeDenied   = "denied"
	outcomeError    = "error"
)

// metrics are the webhook's Prometheus metrics, served with controller-runtime's on the
// metrics endpoint; docs/webhook.md lists them.
type metrics struct {
	admissions *prometheus.CounterVec
	duration   *prometheus.HistogramVec
	granted    *prometheus.CounterVec
	refused    prometheus.Counter
	nsMisses   prometheus.Counter
}

var (
	metricsOnce sync.Once
	theMetrics  *metrics
)

// defaultMetrics returns the metrics, registered once in controller-runtime's registry.
func defaultMetrics() *metrics {
	metricsOnce.Do(func() {
		m := &metrics{
			admissions: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "detour_webhook_admissions_total",
				Help: "Pod admissions by outcome: injected, skipped (not opted in, host network, ...), denied, error.",
			}, []string{"outcome"}),
			duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
				Name:    "detour_webhook_admission_duration_seconds",
				Help:    "Time to handle one pod admission (decode, mutate, patch), by outcome.",
				Buckets: []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1},
			}, []string{"outcome"}),
			granted: prometheus.NewCounterVec(prometheus.CounterOpts{
				Name: "detour_webhook_exemptions_granted_total",
				Help: "Init-container egress exemptions granted, by kind: uid, gid (dedicated GID), proxy-uid.",
			}, []string{"via"}),
			refused: prometheus.NewCounter(prometheus.CounterOpts{
				Name: "detour_webhook_exemptions_refused_total",
				Help: "Init containers selected for egress that could not be exempted safely (warned or denied).",
			}),
			nsMisses: prometheus.NewCounter(prometheus.CounterOpts{
				Name: "detour_webhook_namespace_cache_misses_total",
				Help: "Namespaces not yet in the cache, read from the API server instead.",
			}),
		}
		for _, o := range []string{outcomeInjected, outcomeSkipped, outcomeDenied, outcomeError} {
			m.admissions.WithLabelValues(o)
		}
		for _, v := range []inject.Via{inject.ViaUID, inject.ViaGID, inject.ViaProxyUID} {
			m.granted.WithLabelValues(string(v))
		}
		ctrlmetrics.Registry.MustRegister(m.admissions, m.duration, m.granted, m.refused, m.nsMisses)
		theMetrics = m
	})
	return theMetrics
}

func (m *metrics) observe(outcome string, d time.Duration, res *inject.Result) {
	m.admissions.WithLabelValues(outcome).Inc()
	m.duration.WithLabelValues(outcome).Observe(d.Seconds())
	if res == nil {
		return
	}
	for _, d := range res.Decisions {
		switch d.Via {
		case inject.ViaUID, inject.ViaGID, inject.ViaProxyUID:
			if outcome == outcomeInjected {
				m.granted.WithLabelValues(string(d.Via)).Inc()
			}
		case inject.Refused:
			m.refused.Inc()
		}
	}
}
