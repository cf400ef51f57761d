package webhook

import (
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/detourmesh/detour/inject"
)

// Admission outcomes, the values of the outcome label.
const (
	outcomeInjected = "injected"
	outcomeSkipped  = "skipped"
	outcomeDenied   = "denied"
	outcomeError    = "error"
)

// Metrics are the webhook's Prometheus metrics, served with controller-runtime's on the
// metrics endpoint; docs/webhook.md lists them.
type Metrics struct {
	admissions *prometheus.CounterVec
	duration   *prometheus.HistogramVec
	granted    *prometheus.CounterVec
	refused    prometheus.Counter
	nsMisses   prometheus.Counter
	// validatorMode is 1 for where the validator's check runs now, 0 for the other place.
	validatorMode *prometheus.GaugeVec
}

// NewMetrics returns the webhook's metrics, registered in reg. A metric reg holds already
// (a second [Run] in one process) is used as it is, and keeps counting.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := newMetrics()
	var err error
	if m.admissions, err = register(reg, m.admissions); err != nil {
		return nil, err
	}
	if m.duration, err = register(reg, m.duration); err != nil {
		return nil, err
	}
	if m.granted, err = register(reg, m.granted); err != nil {
		return nil, err
	}
	if m.refused, err = register(reg, m.refused); err != nil {
		return nil, err
	}
	if m.nsMisses, err = register(reg, m.nsMisses); err != nil {
		return nil, err
	}
	if m.validatorMode, err = register(reg, m.validatorMode); err != nil {
		return nil, err
	}
	return m, nil
}

// register registers c in reg, or returns the equal collector reg holds already.
func register[C prometheus.Collector](reg prometheus.Registerer, c C) (C, error) {
	err := reg.Register(c)
	if are, ok := errors.AsType[prometheus.AlreadyRegisteredError](err); ok {
		if existing, ok := are.ExistingCollector.(C); ok {
			return existing, nil
		}
	}
	if err != nil {
		return c, fmt.Errorf("register the webhook's metrics: %w", err)
	}
	return c, nil
}

// newMetrics returns the metrics, in no registry.
func newMetrics() *Metrics {
	m := &Metrics{
		admissions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "detour_webhook_admissions_total",
			Help: "Pod admissions by outcome: injected, skipped (not opted in, host network, ...), denied, error.",
		}, []string{"outcome"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "detour_webhook_admission_duration_seconds",
			Help: "Time to handle one pod admission (decode, mutate, patch), by outcome.",
			// Up to the API server's longest webhook timeout (10 s), for the DetourWebhookSlow alert.
			Buckets: []float64{0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 2.5, 5, 10},
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
		validatorMode: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "detour_webhook_validator_mode",
			Help: "Where the validator's check runs in the pods injected now as native sidecars: 1 for the mode in use (init-container or image-volume), 0 for the other.",
		}, []string{"mode"}),
	}
	for _, o := range []string{outcomeInjected, outcomeSkipped, outcomeDenied, outcomeError} {
		m.admissions.WithLabelValues(o)
	}
	for _, v := range []inject.Via{inject.ViaUID, inject.ViaGID, inject.ViaProxyUID} {
		m.granted.WithLabelValues(string(v))
	}
	return m
}

func (m *Metrics) observe(outcome string, d time.Duration, res *inject.Result) {
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

var descCertExpiry = prometheus.NewDesc("detour_webhook_certificate_expiry_timestamp_seconds",
	"When the serving certificate the webhook reads from its certificate directory expires (Unix time): detour's own or cert-manager's.", nil, nil)

// CertificateExpiry returns a collector of the expiry of the PEM certificate at path (its first
// block, the serving certificate), read at each scrape: a rotated certificate shows at once. It
// exposes nothing while the file is missing or not a certificate.
func CertificateExpiry(path string) prometheus.Collector { return certExpiry{path} }

type certExpiry struct{ path string }

func (c certExpiry) Describe(ch chan<- *prometheus.Desc) { ch <- descCertExpiry }

func (c certExpiry) Collect(ch chan<- prometheus.Metric) {
	data, err := os.ReadFile(c.path)
	if err != nil {
		return
	}
	block, _ := pem.Decode(data)
	if block == nil {
		return
	}
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		return
	}
	ch <- prometheus.MustNewConstMetric(descCertExpiry, prometheus.GaugeValue, float64(cert.NotAfter.Unix()))
}
