package nodeagent_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/detourmesh/detour/cniplugin"
	"github.com/detourmesh/detour/nodeagent"
)

// metricValue returns the value of the series name{labels} that g gathers (a histogram's
// sample count), and whether it is there.
func metricValue(t *testing.T, g prometheus.Gatherer, name string, labels map[string]string) (float64, bool) {
	t.Helper()
	families, err := g.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			got := map[string]string{}
			for _, l := range m.GetLabel() {
				got[l.GetName()] = l.GetValue()
			}
			for k, v := range labels {
				if got[k] != v {
					continue series
				}
			}
			switch f.GetType() {
			case dto.MetricType_COUNTER:
				return m.GetCounter().GetValue(), true
			case dto.MetricType_GAUGE:
				return m.GetGauge().GetValue(), true
			case dto.MetricType_HISTOGRAM:
				return float64(m.GetHistogram().GetSampleCount()), true
			}
		}
	}
	return 0, false
}

func wantMetric(t *testing.T, g prometheus.Gatherer, name string, labels map[string]string, want float64) {
	t.Helper()
	got, ok := metricValue(t, g, name, labels)
	if !ok {
		t.Errorf("%s%v is not exposed, want %v", name, labels, want)
	} else if got != want {
		t.Errorf("%s%v = %v, want %v", name, labels, got, want)
	}
}

// The agent's metrics follow what it finds and does: no primary, detour in place, a primary
// that rewrites its file, a primary it refuses.
func TestAgentMetrics(t *testing.T) {
	e := newEnv(t)
	a := e.agent(t)
	reg := prometheus.NewPedanticRegistry()
	if err := a.Register(reg, ""); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := a.Reconcile(ctx); err != nil {
		t.Fatal(err)
	}
	wantMetric(t, reg, "detour_node_ready", nil, 0)
	wantMetric(t, reg, "detour_node_primary_cni_config_present", nil, 0)
	wantMetric(t, reg, "detour_node_cni_config_in_place", nil, 0)
	wantMetric(t, reg, "detour_node_cni_config_mode", map[string]string{"mode": "drop-in"}, 0)
	wantMetric(t, reg, "detour_node_cni_config_mode", map[string]string{"mode": "chained-entry"}, 0)

	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	s, err := a.Reconcile(ctx)
	if err != nil {
		t.Fatal(err)
	}
	wantMetric(t, reg, "detour_node_ready", nil, 1)
	wantMetric(t, reg, "detour_node_primary_cni_config_present", nil, 1)
	wantMetric(t, reg, "detour_node_cni_entry_in_place", nil, 1)
	wantMetric(t, reg, "detour_node_cni_config_in_place", nil, 1)
	wantMetric(t, reg, "detour_node_cni_config_mode", map[string]string{"mode": string(s.Mode)}, 1)
	// The agent's own write of its entry, and passes that change nothing, are no rewrite.
	for range 3 {
		if _, err := a.Reconcile(ctx); err != nil {
			t.Fatal(err)
		}
	}
	wantMetric(t, reg, "detour_node_primary_rewrites_total", nil, 0)

	writeAtomic(t, primary, calico) // the primary writes its file again, without detour's entry
	for range 2 {
		if _, err := a.Reconcile(ctx); err != nil {
			t.Fatal(err)
		}
	}
	wantMetric(t, reg, "detour_node_primary_rewrites_total", nil, 1)
	wantMetric(t, reg, "detour_node_reconcile_errors_total", map[string]string{"reason": nodeagent.ReasonRefused}, 0)

	// A primary of a CNI version the plugin does not speak takes its place.
	if err := os.Remove(primary); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(e.confDir, "05-old.conf"), `{"name":"old","cniVersion":"0.2.0","type":"bridge"}`)
	if _, err := a.Reconcile(ctx); err == nil {
		t.Fatal("a primary of CNI 0.2.0 was accepted")
	}
	wantMetric(t, reg, "detour_node_reconcile_errors_total", map[string]string{"reason": nodeagent.ReasonRefused}, 1)
	wantMetric(t, reg, "detour_node_reconcile_errors_total", map[string]string{"reason": nodeagent.ReasonFiles}, 0)
	wantMetric(t, reg, "detour_node_primary_rewrites_total", nil, 2)
	wantMetric(t, reg, "detour_node_ready", nil, 0)
	wantMetric(t, reg, "detour_node_cni_entry_in_place", nil, 0)
	wantMetric(t, reg, "detour_node_cni_config_in_place", nil, 0)

	// A node detour was uninstalled from is clean on purpose: no node state to alert on.
	if err := a.Uninstall(ctx); err != nil {
		t.Fatal(err)
	}
	if _, ok := metricValue(t, reg, "detour_node_cni_config_in_place", nil); ok {
		t.Error("detour_node_cni_config_in_place is exposed after the uninstall")
	}
}

// A primary that is a symlink, edited through it, is no rewrite at each pass; a change of its
// target is one.
func TestAgentMetricsSymlinkedPrimary(t *testing.T) {
	e := newEnv(t)
	if err := os.MkdirAll(filepath.Join(e.confDir, "calico"), 0o755); err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(e.confDir, "calico", "k8s.conflist.real")
	writeFile(t, target, calico)
	if err := os.Symlink("calico/k8s.conflist.real", filepath.Join(e.confDir, "10-calico.conflist")); err != nil {
		t.Fatal(err)
	}
	a := e.agent(t)
	reg := prometheus.NewPedanticRegistry()
	if err := a.Register(reg, ""); err != nil {
		t.Fatal(err)
	}
	for range 5 {
		if s, err := a.Reconcile(context.Background()); err != nil || !s.ConfigInPlace {
			t.Fatalf("Reconcile = %+v, %v", s, err)
		}
	}
	wantMetric(t, reg, "detour_node_primary_rewrites_total", nil, 0)
	writeAtomic(t, target, calico)
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	wantMetric(t, reg, "detour_node_primary_rewrites_total", nil, 1)
}

// The plugin's ADD counts reach the agent's /metrics as a histogram by result; a file the agent
// cannot read is counted and leaves the rest of the scrape intact.
func TestAgentMetricsPluginAdds(t *testing.T) {
	e := newEnv(t)
	state := t.TempDir()
	stats := filepath.Join(state, cniplugin.StatsFileName)
	reg := prometheus.NewPedanticRegistry()
	if err := e.agent(t).Register(reg, stats); err != nil {
		t.Fatal(err)
	}
	wantMetric(t, reg, "detour_cni_add_duration_seconds", map[string]string{"result": cniplugin.AddFailed}, 0)
	for range 3 {
		if err := cniplugin.RecordAdd(state, cniplugin.AddRedirected, 20*time.Millisecond, false); err != nil {
			t.Fatal(err)
		}
	}
	if err := cniplugin.RecordAdd(state, cniplugin.AddFailed, time.Second, false); err != nil {
		t.Fatal(err)
	}
	wantMetric(t, reg, "detour_cni_add_duration_seconds", map[string]string{"result": cniplugin.AddRedirected}, 3)
	wantMetric(t, reg, "detour_cni_add_duration_seconds", map[string]string{"result": cniplugin.AddFailed}, 1)
	wantMetric(t, reg, "detour_cni_add_duration_seconds", map[string]string{"result": cniplugin.AddSkipped}, 0)
	// Issue 33: a pod whose kernel had no socket lookup is counted, so the node's fallback shows.
	wantMetric(t, reg, "detour_cni_inbound_fallbacks_total", nil, 0)
	if err := cniplugin.RecordAdd(state, cniplugin.AddRedirected, 20*time.Millisecond, true); err != nil {
		t.Fatal(err)
	}
	wantMetric(t, reg, "detour_cni_inbound_fallbacks_total", nil, 1)

	writeFile(t, stats, "not json")
	wantMetric(t, reg, "detour_cni_add_stats_read_errors_total", nil, 1)
	wantMetric(t, reg, "detour_node_ready", nil, 0)
	// Issue 32.5: a failed read exposes no ADD series at all. Zeros would be a counter reset
	// for Prometheus, and the next good read a spike in rate().
	if v, ok := metricValue(t, reg, "detour_cni_add_duration_seconds", nil); ok {
		t.Errorf("detour_cni_add_duration_seconds = %v after a failed read; want no series", v)
	}
}

// Issue 32.5: a scrape waits for the plugin's lock on the stats file no longer than the plugin
// waits for the agent's (cniplugin's bound): a lock held too long counts as a failed read, and
// the rest of the scrape is served.
func TestAgentMetricsPluginAddsLockHeld(t *testing.T) {
	e := newEnv(t)
	state := t.TempDir()
	if err := cniplugin.RecordAdd(state, cniplugin.AddRedirected, 20*time.Millisecond, false); err != nil {
		t.Fatal(err)
	}
	stats := filepath.Join(state, cniplugin.StatsFileName)
	reg := prometheus.NewPedanticRegistry()
	if err := e.agent(t).Register(reg, stats); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(stats, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	gathered := make(chan struct{})
	go func() {
		defer close(gathered)
		reg.Gather() //nolint:errcheck // what it returns is read below, once the lock is free
	}()
	select {
	case <-gathered:
	case <-time.After(time.Minute):
		syscall.Flock(int(f.Fd()), syscall.LOCK_UN) //nolint:errcheck // let the scrape end
		<-gathered
		t.Fatal("a scrape waited for the stats file's lock for a minute; want it bounded")
	}
	wantMetric(t, reg, "detour_cni_add_stats_read_errors_total", nil, 2) // the scrape above, and this one
	if v, ok := metricValue(t, reg, "detour_cni_add_duration_seconds", nil); ok {
		t.Errorf("detour_cni_add_duration_seconds = %v while the plugin held the lock; want no series", v)
	}
	wantMetric(t, reg, "detour_node_ready", nil, 0)
}

// The repair controller's detour_* metrics are served by the agent too; its runtime metrics are
// not (the agent has its own), and an endpoint that is down leaves the agent's.
func TestRemoteGatherer(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprint(w, "# TYPE detour_repair_pods_deleted_total counter\ndetour_repair_pods_deleted_total 3\n# TYPE go_goroutines gauge\ngo_goroutines 7\n")
	}))
	defer srv.Close()
	reg := prometheus.NewRegistry()
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "go_goroutines", Help: "the agent's"})
	g.Set(11)
	reg.MustRegister(g)
	merged := prometheus.Gatherers{reg, nodeagent.RemoteGatherer(srv.URL)}
	wantMetric(t, merged, "detour_repair_pods_deleted_total", nil, 3)
	wantMetric(t, merged, "go_goroutines", nil, 11)

	down := prometheus.Gatherers{reg, nodeagent.RemoteGatherer("http://127.0.0.1:1/metrics")}
	families, err := down.Gather()
	if err == nil {
		t.Error("a merged endpoint that is down gave no error")
	}
	if len(families) != 1 || families[0].GetName() != "go_goroutines" {
		t.Errorf("with the merged endpoint down, gathered %v; want the agent's own", families)
	}
}
