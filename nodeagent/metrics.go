package nodeagent

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/detourmesh/detour/cniplugin"
)

// Reasons of detour_node_reconcile_errors_total.
const (
	// ReasonRefused: a primary configuration the agent will not chain into (a CNI version the
	// plugin does not speak, a symlink out of the directory or to a .conf).
	ReasonRefused = "refused-primary"
	// ReasonRace: the primary rewrote its file while the agent wrote it (retried at once).
	ReasonRace = "primary-race"
	// ReasonNodeAPI: the node's taint or label could not be read or patched.
	ReasonNodeAPI = "node-api"
	// ReasonPluginCredentials: the plugin's kubeconfig or token could not be written, or its
	// token requested.
	ReasonPluginCredentials = "plugin-credentials"
	// ReasonFiles: anything else: reading or writing the CNI directories, the binary.
	ReasonFiles = "files"
)

var reconcileReasons = []string{ReasonRefused, ReasonRace, ReasonNodeAPI, ReasonPluginCredentials, ReasonFiles}

// reasonError is a reconcile error with its metric reason.
type reasonError struct {
	reason string
	err    error
}

func (e *reasonError) Error() string { return e.err.Error() }
func (e *reasonError) Unwrap() error { return e.err }

// withReason wraps a non-nil err with reason.
func withReason(reason string, err error) error {
	if err == nil {
		return nil
	}
	return &reasonError{reason, err}
}

// errorReason is the metric reason of a reconcile error; of errors joined, the first one's.
func errorReason(err error) string {
	if joined, ok := err.(interface{ Unwrap() []error }); ok {
		if errs := joined.Unwrap(); len(errs) > 0 {
			return errorReason(errs[0])
		}
	}
	if isRace(err) {
		return ReasonRace
	}
	if _, ok := errors.AsType[*refusedError](err); ok {
		return ReasonRefused
	}
	if re, ok := errors.AsType[*reasonError](err); ok {
		return re.reason
	}
	return ReasonFiles
}

// metrics are the agent's own counters; its gauges come from its status at each scrape.
type metrics struct {
	reconcileErrors *prometheus.CounterVec
	primaryRewrites prometheus.Counter
	tokenFailures   prometheus.Counter
	// primarySeen is a digest of the primary's file as the agent last saw or left it, and its
	// path: a different one at the next reconcile is a rewrite by someone else.
	primarySeen     [sha256.Size]byte
	primarySeenPath string
}

func newMetrics() *metrics {
	m := &metrics{
		reconcileErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "detour_node_reconcile_errors_total",
			Help: "Reconcile passes of the node agent that failed, by reason: refused-primary, primary-race, node-api, plugin-credentials, files.",
		}, []string{"reason"}),
		primaryRewrites: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "detour_node_primary_rewrites_total",
			Help: "Changes the node agent found in the primary CNI configuration file that it did not make itself (the primary rewriting its conflist, another file taking its place).",
		}),
		tokenFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "detour_node_plugin_token_refresh_failures_total",
			Help: "TokenRequest calls for the plugin's service account that failed.",
		}),
	}
	for _, r := range reconcileReasons {
		m.reconcileErrors.WithLabelValues(r)
	}
	return m
}

// sawPrimary records the primary's content at path, and counts a rewrite when it is not what the
// agent saw or left there last time.
func (m *metrics) sawPrimary(path string, data []byte) {
	if m.primarySeenPath != "" && (path != m.primarySeenPath || sha256.Sum256(data) != m.primarySeen) {
		m.primaryRewrites.Inc()
	}
	m.leftPrimary(path, data)
}

// leftPrimary records the primary's content as the agent leaves it, without counting it.
func (m *metrics) leftPrimary(path string, data []byte) {
	m.primarySeen, m.primarySeenPath = sha256.Sum256(data), path
}

// Descriptions of the gauges read from the agent's status.
var (
	descReady = prometheus.NewDesc("detour_node_ready",
		"1 while the node is ready for injected pods (what the agent's /readyz and the detour.dev/cni-ready label say), else 0.", nil, nil)
	descPrimary = prometheus.NewDesc("detour_node_primary_cni_config_present",
		"1 while the primary CNI has written its configuration into the node's CNI config directory, else 0.", nil, nil)
	descEntry = prometheus.NewDesc("detour_node_cni_entry_in_place",
		"1 while detour's entry or drop-in and the plugin's binary are in place: the runtime runs detour-cni for every pod's sandbox.", nil, nil)
	descInPlace = prometheus.NewDesc("detour_node_cni_config_in_place",
		"1 while detour's configuration is in place: its entry or drop-in, the binary, the plugin's kubeconfig and token.", nil, nil)
	descMode = prometheus.NewDesc("detour_node_cni_config_mode",
		"1 for how detour's configuration reaches the runtime on this node (drop-in or chained-entry), 0 for the other; both 0 before the agent could choose.", []string{"mode"}, nil)
	descTokenExpiry = prometheus.NewDesc("detour_node_plugin_token_expiry_timestamp_seconds",
		"When the plugin's token expires (Unix time), when the agent requests one for the plugin's service account.", nil, nil)
	descAdd = prometheus.NewDesc("detour_cni_add_duration_seconds",
		"Duration of detour-cni's ADDs on this node, by result: redirected, skipped (not injected, excluded namespace), failed (the pod's sandbox failed). Counted by the plugin in its state directory since the node's boot.", []string{"result"}, nil)
	descInboundFallbacks = prometheus.NewDesc("detour_cni_inbound_fallbacks_total",
		"Pods on this node (since its boot) that asked for inbound connections to their listening ports only (detour.dev/redirect-inbound: listening) and got every inbound connection redirected: the kernel has no socket lookup (xt_socket, nft_socket).", nil, nil)
)

// collector exposes the agent's status and the plugin's ADD counts at scrape time.
type collector struct {
	a          *Agent
	statsFile  string
	statsFails prometheus.Counter
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descReady, descPrimary, descEntry, descInPlace, descMode, descTokenExpiry} {
		ch <- d
	}
	if c.statsFile != "" {
		ch <- descAdd
		ch <- descInboundFallbacks
		c.statsFails.Describe(ch)
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	// An uninstalled node is clean on purpose: no node state to alert on.
	if s := c.a.Status(); !s.Uninstalled {
		ready, _ := c.a.Ready()
		ch <- prometheus.MustNewConstMetric(descReady, prometheus.GaugeValue, boolValue(ready))
		ch <- prometheus.MustNewConstMetric(descPrimary, prometheus.GaugeValue, boolValue(s.Primary != ""))
		ch <- prometheus.MustNewConstMetric(descEntry, prometheus.GaugeValue, boolValue(s.EntryInPlace))
		ch <- prometheus.MustNewConstMetric(descInPlace, prometheus.GaugeValue, boolValue(s.ConfigInPlace))
		for _, m := range []Mode{ModeDropIn, ModeChainedEntry} {
			ch <- prometheus.MustNewConstMetric(descMode, prometheus.GaugeValue, boolValue(s.Mode == m && s.Primary != ""), string(m))
		}
		if !s.PluginTokenExpires.IsZero() {
			ch <- prometheus.MustNewConstMetric(descTokenExpiry, prometheus.GaugeValue, float64(s.PluginTokenExpires.Unix()))
		}
	}
	if c.statsFile == "" {
		return
	}
	stats, err := cniplugin.ReadAddStats(c.statsFile)
	if err != nil {
		// No series rather than zeros: zeros would read as a counter reset, and the next good
		// read as a burst of ADDs.
		c.statsFails.Inc()
		c.a.log.Warn("cannot read the plugin's ADD counts; leaving them out of this scrape", "err", err)
		ch <- c.statsFails
		return
	}
	ch <- c.statsFails
	for _, result := range cniplugin.AddResults {
		h := stats.Results[result]
		if h == nil {
			h = &cniplugin.AddHistogram{Buckets: make([]uint64, len(cniplugin.AddDurationBuckets))}
		}
		buckets := make(map[float64]uint64, len(h.Buckets))
		for i, le := range cniplugin.AddDurationBuckets {
			buckets[le] = h.Buckets[i]
		}
		ch <- prometheus.MustNewConstHistogram(descAdd, h.Count, h.SumSeconds, buckets, result)
	}
	ch <- prometheus.MustNewConstMetric(descInboundFallbacks, prometheus.CounterValue, float64(stats.InboundFallbacks))
}

func boolValue(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// Register registers the agent's metrics with reg: its status, its reconcile errors, the primary's
// rewrites, the plugin token's refreshes and, when statsFile is set, the plugin's ADDs counted in
// that file (the plugin's state directory, cniplugin.StatsFileName).
func (a *Agent) Register(reg prometheus.Registerer, statsFile string) error {
	c := &collector{a: a, statsFile: statsFile, statsFails: prometheus.NewCounter(prometheus.CounterOpts{
		Name: "detour_cni_add_stats_read_errors_total", Help: "Scrapes at which the node agent could not read the plugin's ADD counts (unreadable, unparsable, or locked for more than a second): detour_cni_add_duration_seconds is left out of those scrapes.",
	})}
	for _, m := range []prometheus.Collector{c, a.metrics.reconcileErrors, a.metrics.primaryRewrites, a.metrics.tokenFailures} {
		if err := reg.Register(m); err != nil {
			return fmt.Errorf("register the node agent's metrics: %w", err)
		}
	}
	return nil
}

// RemoteGatherer gathers detour's metrics (detour_*) that another process on the node serves in
// the Prometheus text format at url — the repair controller's, next to the agent in its pod — so
// that the agent's /metrics holds both and one scrape of one port covers the pod. The other
// process's own runtime metrics (go_*, process_*) are left out: the agent has its own.
func RemoteGatherer(url string) prometheus.Gatherer {
	return prometheus.GathererFunc(func() ([]*dto.MetricFamily, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return nil, err
		}
		req.Header.Set("Accept", string(expfmt.NewFormat(expfmt.TypeTextPlain)))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return nil, fmt.Errorf("merge the metrics of %s: %w", url, err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return nil, fmt.Errorf("merge the metrics of %s: %s", url, resp.Status)
		}
		parser := expfmt.NewTextParser(model.UTF8Validation)
		families, err := parser.TextToMetricFamilies(resp.Body)
		if err != nil {
			return nil, fmt.Errorf("merge the metrics of %s: %w", url, err)
		}
		out := make([]*dto.MetricFamily, 0, len(families))
		for name, f := range families {
			if strings.HasPrefix(name, "detour_") {
				out = append(out, f)
			}
		}
		return out, nil
	})
}
