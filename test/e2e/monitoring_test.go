package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/detourmesh/detour/test/e2e/framework"
)

// alertsFireAndResolve (issue 24): a Prometheus server built from the Prometheus module scrapes
// detour on the real node through the chart's own scrape annotations (the usual kubernetes-pods
// job) and evaluates the chart's PrometheusRule, rendered with shorter `for:` durations and
// rate window. The primary CNI is replaced by one detour refuses (CNI 0.2.0), so detour's
// configuration leaves the node, and an opted-in Deployment gets pods:
// DetourNodeWithoutConfiguration and DetourValidatorsCatchingPods go firing in Prometheus' own
// API; once the primary is fixed they resolve.
func alertsFireAndResolve(t *testing.T, ctx context.Context, e *framework.Env) {
	const (
		withoutConfig = "DetourNodeWithoutConfiguration"
		catching      = "DetourValidatorsCatchingPods"
		forTime       = 10 * time.Second
	)
	// The catching alert's rate window shrinks too, so that it resolves a minute after the last
	// catch rather than five (the shipped window is manifests/testdata/alerts_test.yaml's).
	prom := startPrometheus(t, ctx, e, map[string]string{withoutConfig: "10s", catching: "10s"}, map[string]string{"rate(detour_repair_pods_seen_total[5m])": "rate(detour_repair_pods_seen_total[1m])"})

	// Scraped through the annotations: the node agent (with repair's metrics merged in) and
	// the webhook, each series with the node it runs on.
	framework.WaitFor(t, ctx, "Prometheus to scrape the node agent, repair and the webhook", 2*time.Minute, func() (bool, error) {
		var missing []string
		for _, q := range []string{
			`detour_node_cni_entry_in_place{node="` + framework.NodeName + `"} == 1`,
			`detour_repair_pods{node="` + framework.NodeName + `", state="injected"}`,
			`detour_cni_add_duration_seconds_count{node="` + framework.NodeName + `", result="redirected"} > 0`,
			`detour_webhook_admissions_total{outcome="injected"} > 0`,
			`detour_webhook_certificate_expiry_timestamp_seconds > time()`,
			// DetourNodeAgentNotScraped's selector finds the agent's target (issue 32.5).
			`up{pod=~"detour-node-agent-.+", node="` + framework.NodeName + `"} == 1`,
		} {
			if res, err := prom.query(ctx, q); err != nil || len(res) == 0 {
				missing = append(missing, fmt.Sprintf("%s (%v)", q, err))
			}
		}
		return len(missing) == 0, framework.Seen("no result yet for %v", missing)
	})
	if firing := prom.firing(t, ctx, withoutConfig, catching); len(firing) > 0 {
		t.Fatalf("alerts firing on a healthy node: %v", firing)
	}
	dashboardQueriesRun(t, ctx, e, prom)

	// The primary writes a configuration detour will not chain into: its configuration leaves
	// the node, and pods start without their redirect.
	broke := time.Now()
	if err := e.Node.WritePrimaryConfigVersion("0.2.0"); err != nil {
		t.Fatal(err)
	}
	fixed := false
	defer func() {
		if !fixed {
			e.Node.WritePrimaryConfig()
		}
	}()
	e.Namespace(t, ctx, "watched", true)
	defer e.Node.Client.CoreV1().Namespaces().Delete(context.WithoutCancel(ctx), "watched", metav1.DeleteOptions{})
	if _, err := e.Node.Client.AppsV1().Deployments("watched").Create(ctx, e.Deployment("watched", "watched", 2), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	firedAt := map[string]time.Duration{}
	framework.WaitFor(t, ctx, withoutConfig+" and "+catching+" to fire", 4*time.Minute, func() (bool, error) {
		for _, name := range prom.firing(t, ctx, withoutConfig, catching) {
			if _, ok := firedAt[name]; !ok {
				firedAt[name] = time.Since(broke)
			}
		}
		return len(firedAt) == 2, framework.Seen("firing so far: %v", firedAt)
	})
	t.Logf("firing after the primary was broken: %v (for: %v each, scrape and evaluation every 2s)", firedAt, forTime)
	if firedAt[withoutConfig] < forTime {
		t.Errorf("%s fired %v after the break, before its for: %v", withoutConfig, firedAt[withoutConfig], forTime)
	}

	// The primary is fixed: detour's configuration comes back, the pods are repaired, and the
	// alerts resolve (DetourValidatorsCatchingPods once no pod was caught for its window).
	if err := e.Node.WritePrimaryConfig(); err != nil {
		t.Fatal(err)
	}
	fixed = true
	fixedAt := time.Now()
	e.WaitReady(t, ctx, "watched", "app=watched", 2)
	resolvedAt := map[string]time.Duration{}
	framework.WaitFor(t, ctx, "both alerts to resolve", 8*time.Minute, func() (bool, error) {
		firing := prom.firing(t, ctx, withoutConfig, catching)
		for _, name := range []string{withoutConfig, catching} {
			if _, ok := resolvedAt[name]; !ok && !slices.Contains(firing, name) {
				resolvedAt[name] = time.Since(fixedAt)
			}
		}
		return len(firing) == 0, framework.Seen("still firing: %v", firing)
	})
	t.Logf("resolved after the primary was fixed: %v", resolvedAt)
}

// dashboardQueriesRun runs every query of the chart's Grafana dashboard on the live server, with
// Grafana's variables set as a user would leave them: each must be valid PromQL, and those of
// the panels that show a healthy node's state must return data.
func dashboardQueriesRun(t *testing.T, ctx context.Context, e *framework.Env, prom *prometheus) {
	t.Helper()
	var dashboard struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal([]byte(framework.ReadFile(filepath.Join(e.Root, "manifests", "charts", "detour", "files", "dashboard.json"))), &dashboard); err != nil {
		t.Fatal(err)
	}
	grafana := strings.NewReplacer("$__rate_interval", "1m", "$node", ".*", "${datasource}", "")
	mustHaveData := []string{"Nodes ready", "Admissions per second by outcome", "detour-cni ADDs per second by result", "Pods by state", "Webhook certificate: time left"}
	for _, p := range dashboard.Panels {
		for _, q := range p.Targets {
			expr := grafana.Replace(q.Expr)
			if _, err := prom.query(ctx, expr); err != nil {
				t.Errorf("panel %q: query %q: %v", p.Title, q.Expr, err)
				continue
			}
			if !slices.Contains(mustHaveData, p.Title) {
				continue
			}
			// A rate needs two samples in its window: the server may have just started.
			framework.WaitFor(t, ctx, fmt.Sprintf("panel %q's query %q to return data", p.Title, q.Expr), time.Minute, func() (bool, error) {
				res, err := prom.query(ctx, expr)
				return err == nil && len(res) > 0, framework.Seen("%d series, %v", len(res), err)
			})
		}
	}
}

// prometheus is the story's Prometheus server, reached in the node's network namespace.
type prometheus struct {
	client *http.Client
}

// startPrometheus writes the Prometheus configuration — the kubernetes-pods job that scrapes
// pods by their prometheus.io annotations, with the node label the alerts name — and the rules
// of the chart's PrometheusRule rendered with the for: overrides given and each exprRewrites
// key replaced by its value (the test fails if one is missing), starts the server and stops it
// when the test ends.
func startPrometheus(t *testing.T, ctx context.Context, e *framework.Env, forOverrides, exprRewrites map[string]string) *prometheus {
	t.Helper()
	dir := e.Node.PrometheusDir()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	args := []string{"template", "detour", filepath.Join(e.Root, "manifests", "charts", "detour"), "--namespace", framework.DetourNamespace,
		"--values", filepath.Join(e.Node.Dir, "values.yaml"), "--set", "metrics.prometheusRule.enabled=true", "--show-only", "templates/monitoring.yaml"}
	for alert, d := range forOverrides {
		args = append(args, "--set", fmt.Sprintf("metrics.prometheusRule.alerts.%s.for=%s", alert, d))
	}
	out, err := e.Node.Helm(ctx, args...)
	if err != nil {
		t.Fatalf("render the chart's PrometheusRule: %v", err)
	}
	var rule struct {
		Kind string          `json:"kind"`
		Spec json.RawMessage `json:"spec"`
	}
	if err := yaml.Unmarshal([]byte(out), &rule); err != nil || rule.Kind != "PrometheusRule" {
		t.Fatalf("the chart rendered no PrometheusRule (%v):\n%s", err, out)
	}
	rules, err := yaml.JSONToYAML(rule.Spec)
	if err != nil {
		t.Fatal(err)
	}
	for old, new := range exprRewrites {
		if !strings.Contains(string(rules), old) {
			t.Fatalf("the chart's rules no longer contain %q to shorten:\n%s", old, rules)
		}
		rules = []byte(strings.ReplaceAll(string(rules), old, new))
	}
	config := fmt.Sprintf(`global:
  scrape_interval: 2s
  scrape_timeout: 2s
  evaluation_interval: 2s
rule_files: [rules.yaml]
scrape_configs:
  - job_name: kubernetes-pods
    kubernetes_sd_configs:
      - role: pod
        kubeconfig_file: %s
    relabel_configs:
      - source_labels: [__meta_kubernetes_pod_annotation_prometheus_io_scrape]
        action: keep
        regex: "true"
      - source_labels: [__address__, __meta_kubernetes_pod_annotation_prometheus_io_port]
        regex: '([^:]+)(?::\d+)?;(\d+)'
        replacement: $1:$2
        target_label: __address__
      - source_labels: [__meta_kubernetes_pod_annotation_prometheus_io_path]
        regex: (.+)
        target_label: __metrics_path__
      - source_labels: [__meta_kubernetes_namespace]
        target_label: namespace
      - source_labels: [__meta_kubernetes_pod_name]
        target_label: pod
      - source_labels: [__meta_kubernetes_pod_node_name]
        target_label: node
`, e.Node.Kubeconfig)
	for name, content := range map[string][]byte{"prometheus.yml": []byte(config), "rules.yaml": rules} {
		if err := os.WriteFile(filepath.Join(dir, name), content, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := e.Node.StartComponent(ctx, "prometheus"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := e.Node.StopComponent("prometheus"); err != nil {
			t.Errorf("stop Prometheus: %v", err)
		}
		os.RemoveAll(filepath.Join(dir, "data"))
	})
	return &prometheus{client: &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		DialContext: e.Node.Dial,
	}}}
}

// get GETs path from Prometheus' HTTP API and decodes its data into out.
func (p *prometheus) get(ctx context.Context, path string, out any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+framework.PrometheusAddr+path, nil)
	if err != nil {
		return err
	}
	resp, err := p.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	var r struct {
		Status string          `json:"status"`
		Error  string          `json:"error"`
		Data   json.RawMessage `json:"data"`
	}
	if err := json.Unmarshal(body, &r); err != nil {
		return fmt.Errorf("GET %s: %s: %s", path, resp.Status, body)
	}
	if r.Status != "success" {
		return fmt.Errorf("GET %s: %s", path, r.Error)
	}
	return json.Unmarshal(r.Data, out)
}

// query returns the series of an instant query.
func (p *prometheus) query(ctx context.Context, q string) ([]map[string]any, error) {
	var data struct {
		Result []map[string]any `json:"result"`
	}
	err := p.get(ctx, "/api/v1/query?query="+url.QueryEscape(q), &data)
	return data.Result, err
}

// firing returns which of names Prometheus reports firing for this node (each once).
func (p *prometheus) firing(t *testing.T, ctx context.Context, names ...string) []string {
	t.Helper()
	var data struct {
		Alerts []struct {
			Labels map[string]string `json:"labels"`
			State  string            `json:"state"`
		} `json:"alerts"`
	}
	if err := p.get(ctx, "/api/v1/alerts", &data); err != nil {
		t.Logf("read Prometheus' alerts: %v", err)
		return nil
	}
	var firing []string
	for _, a := range data.Alerts {
		name := a.Labels["alertname"]
		if a.State == "firing" && slices.Contains(names, name) && !slices.Contains(firing, name) {
			if node, ok := a.Labels["node"]; ok && node != framework.NodeName {
				continue
			}
			firing = append(firing, name)
		}
	}
	slices.Sort(firing)
	return firing
}
