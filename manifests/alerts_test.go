package manifests_test

import (
	"encoding/json"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/kubernetes/fake"
	"sigs.k8s.io/yaml"

	"github.com/detourmesh/detour/nodeagent"
	"github.com/detourmesh/detour/repair"
	"github.com/detourmesh/detour/test/testenv"
	"github.com/detourmesh/detour/webhook"
)

const alertsFile = "charts/detour/files/alerts.yaml"

// ruleFile is a Prometheus rule file, as much as the tests read of it.
type ruleFile struct {
	Groups []struct {
		Name  string           `json:"name"`
		Rules []map[string]any `json:"rules"`
	} `json:"groups"`
}

func readRules(t *testing.T, data []byte) ruleFile {
	t.Helper()
	var f ruleFile
	if err := yaml.Unmarshal(data, &f); err != nil {
		t.Fatalf("parse the alert rules: %v", err)
	}
	return f
}

// promtool runs promtool in dir and fails the test with its output when it fails.
func promtool(t *testing.T, dir string, args ...string) {
	t.Helper()
	cmd := exec.Command(testenv.Binary(t, "promtool"), args...)
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// The rules load (promtool check rules), and promtool's unit tests pass: every alert fires
// when it should and not when it should not (testdata/alerts_test.yaml, against the rules
// without their annotations), and the annotations render as written
// (testdata/alerts_annotations_test.yaml, against the rules as shipped).
func TestAlertRules(t *testing.T) {
	data, err := os.ReadFile(alertsFile)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	write := func(name string, b []byte) {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("alerts.yaml", data)
	promtool(t, dir, "check", "rules", "alerts.yaml")
	annotationsTest, err := os.ReadFile("testdata/alerts_annotations_test.yaml")
	if err != nil {
		t.Fatal(err)
	}
	write("alerts_annotations_test.yaml", annotationsTest)
	promtool(t, dir, "test", "rules", "alerts_annotations_test.yaml")

	rules := readRules(t, data)
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			delete(r, "annotations")
		}
	}
	stripped, err := yaml.Marshal(rules)
	if err != nil {
		t.Fatal(err)
	}
	write("alerts.yaml", stripped)
	unitTests, err := os.ReadFile("testdata/alerts_test.yaml")
	if err != nil {
		t.Fatal(err)
	}
	write("alerts_test.yaml", unitTests)
	promtool(t, dir, "test", "rules", "alerts_test.yaml")

	// Every alert has a case where it fires and one where it does not.
	var tests struct {
		Tests []struct {
			AlertRuleTest []struct {
				Alertname string `json:"alertname"`
				ExpAlerts []any  `json:"exp_alerts"`
			} `json:"alert_rule_test"`
		} `json:"tests"`
	}
	if err := yaml.Unmarshal(unitTests, &tests); err != nil {
		t.Fatal(err)
	}
	fires, quiet := map[string]bool{}, map[string]bool{}
	for _, tc := range tests.Tests {
		for _, a := range tc.AlertRuleTest {
			if len(a.ExpAlerts) > 0 {
				fires[a.Alertname] = true
			} else {
				quiet[a.Alertname] = true
			}
		}
	}
	for _, name := range alertNames(t, readRules(t, data)) {
		if !fires[name] || !quiet[name] {
			t.Errorf("alert %s: testdata/alerts_test.yaml has a case where it fires: %v, where it does not: %v; want both", name, fires[name], quiet[name])
		}
	}
}

func alertNames(t *testing.T, f ruleFile) []string {
	t.Helper()
	var names []string
	for _, g := range f.Groups {
		for _, r := range g.Rules {
			name, _ := r["alert"].(string)
			if name == "" {
				t.Errorf("group %s has a rule that is not an alert: %v", g.Name, r)
				continue
			}
			names = append(names, name)
		}
	}
	return names
}

// Every alert tells people what happened, what to do, and where the runbook is: a section of
// docs/troubleshooting.md that exists.
func TestAlertAnnotations(t *testing.T) {
	data, err := os.ReadFile(alertsFile)
	if err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile("../docs/troubleshooting.md")
	if err != nil {
		t.Fatal(err)
	}
	anchors := map[string]bool{}
	for _, line := range strings.Split(string(doc), "\n") {
		if strings.HasPrefix(line, "#") {
			anchors[githubAnchor(strings.TrimLeft(line, "# "))] = true
		}
	}
	const runbooks = "https://github.com/detourmesh/detour/blob/main/docs/troubleshooting.md#"
	for _, g := range readRules(t, data).Groups {
		for _, r := range g.Rules {
			a, _ := r["annotations"].(map[string]any)
			name := r["alert"]
			for _, key := range []string{"summary", "description", "runbook_url"} {
				if s, _ := a[key].(string); strings.TrimSpace(s) == "" {
					t.Errorf("alert %s has no %s", name, key)
				}
			}
			url, _ := a["runbook_url"].(string)
			anchor, ok := strings.CutPrefix(url, runbooks)
			if !ok || !anchors[anchor] {
				t.Errorf("alert %s: runbook_url %q is not a section of docs/troubleshooting.md", name, url)
			}
			if labels, _ := r["labels"].(map[string]any); !slices.Contains([]any{"critical", "warning", "info"}, labels["severity"]) {
				t.Errorf("alert %s: severity %v, want critical, warning or info", name, labels["severity"])
			}
		}
	}
}

// githubAnchor is the anchor GitHub gives a Markdown heading.
func githubAnchor(heading string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(heading) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9':
			b.WriteRune(r)
		}
	}
	return b.String()
}

// The chart's PrometheusRule holds the same rules, with the overrides of its values, and loads
// in Prometheus.
func TestChartPrometheusRule(t *testing.T) {
	objs := objects(t, render(t, []string{
		"metrics.prometheusRule.enabled=true",
		"metrics.prometheusRule.additionalRuleLabels.team=platform",
		"metrics.prometheusRule.additionalRuleLabels.severity=page", // an alert's own wins
		"metrics.prometheusRule.alerts.DetourNodeNotReady.for=30m",
		"metrics.prometheusRule.alerts.DetourNodeNotReady.severity=critical",
		"metrics.prometheusRule.alerts.DetourWebhookFailOpen.enabled=false",
	}))
	var pr struct {
		Spec ruleFile `json:"spec"`
	}
	find(t, objs, "PrometheusRule", "detour", &pr)
	data, err := os.ReadFile(alertsFile)
	if err != nil {
		t.Fatal(err)
	}
	want := slices.DeleteFunc(alertNames(t, readRules(t, data)), func(n string) bool { return n == "DetourWebhookFailOpen" })
	if got := alertNames(t, pr.Spec); !slices.Equal(got, want) {
		t.Errorf("the PrometheusRule's alerts are %v, want %v", got, want)
	}
	for _, r := range pr.Spec.Groups[0].Rules {
		labels, _ := r["labels"].(map[string]any)
		if labels["team"] != "platform" {
			t.Errorf("alert %s lacks the additional label team=platform: %v", r["alert"], labels)
		}
		if r["alert"] == "DetourNodeNotReady" && (r["for"] != "30m" || labels["severity"] != "critical") {
			t.Errorf("DetourNodeNotReady: for %v, severity %v; want the overrides 30m and critical", r["for"], labels["severity"])
		}
		if labels["severity"] == "page" {
			t.Errorf("alert %s: additionalRuleLabels replaced its severity", r["alert"])
		}
	}
	spec, err := yaml.Marshal(pr.Spec)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "rules.yaml"), spec, 0o644); err != nil {
		t.Fatal(err)
	}
	promtool(t, dir, "check", "rules", "rules.yaml")

	for sets, want := range map[[2]string]string{
		{"metrics.prometheusRule.enabled=true", "metrics.prometheusRule.alerts.DetourNodeNotRedy.for=1m"}: "metrics.prometheusRule.alerts.DetourNodeNotRedy: detour has no such alert; the alerts are DetourCNIAddFailures, ",
		{"metrics.serviceMonitor.enabled=true", "metrics.podMonitor.enabled=true"}:                        "metrics.serviceMonitor.enabled and metrics.podMonitor.enabled are both true",
	} {
		cmd := exec.Command(testenv.Binary(t, "helm"), "template", "detour", chart, "--namespace", namespace, "--set", proxyImage, "--set", sets[0], "--set", sets[1])
		if out, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(out), want) {
			t.Errorf("helm template --set %s --set %s: %v\n%s", sets[0], sets[1], err, out)
		}
	}
}

// collectors is a prometheus.Registerer that keeps what is registered with it.
type collectors []prometheus.Collector

func (c *collectors) Register(m prometheus.Collector) error   { *c = append(*c, m); return nil }
func (c *collectors) MustRegister(ms ...prometheus.Collector) { *c = append(*c, ms...) }
func (c *collectors) Unregister(prometheus.Collector) bool    { return false }

// exposedMetrics are the names of the series detour's components expose (a histogram's
// _bucket, _sum and _count too), from their collectors' descriptions.
func exposedMetrics(t *testing.T) map[string]bool {
	t.Helper()
	var reg collectors
	if _, err := webhook.NewMetrics(&reg); err != nil {
		t.Fatal(err)
	}
	reg.MustRegister(webhook.CertificateExpiry("tls.crt"))
	repair.NewMetrics(&reg)
	flags := repair.DefaultFlags()
	flags.NodeName = "node-1"
	cfg, err := flags.Parse()
	if err != nil {
		t.Fatal(err)
	}
	ctrl, err := repair.New(fake.NewClientset(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	reg.MustRegister(ctrl.Collector())
	if err := nodeagent.New(nodeagent.Config{}).Register(&reg, "stats.json"); err != nil {
		t.Fatal(err)
	}
	reg.MustRegister(nodeagent.NewFallbackReporter(fake.NewClientset(), t.TempDir(), "node-1", slog.New(slog.DiscardHandler)))
	fqName := regexp.MustCompile(`fqName: "([^"]+)"`)
	names := map[string]bool{}
	descs := make(chan *prometheus.Desc)
	go func() {
		for _, c := range reg {
			c.Describe(descs)
		}
		close(descs)
	}()
	for d := range descs {
		if m := fqName.FindStringSubmatch(d.String()); m != nil {
			for _, suffix := range []string{"", "_bucket", "_sum", "_count"} {
				names[m[1]+suffix] = true
			}
		}
	}
	if len(names) < 20 {
		t.Fatalf("only %d metric names found: %v", len(names), names)
	}
	return names
}

// metricName matches the identifiers of a PromQL expression.
var metricName = regexp.MustCompile(`\b[a-zA-Z_:][a-zA-Z0-9_:]*\b`)

// detourMetrics are the detour_* names in a PromQL expression.
func detourMetrics(expr string) []string {
	var names []string
	for _, n := range metricName.FindAllString(expr, -1) {
		if strings.HasPrefix(n, "detour_") {
			names = append(names, n)
		}
	}
	return names
}

// The alert rules name only series detour exposes (and the API server's webhook fail-open
// count).
func TestAlertMetricsExist(t *testing.T) {
	exposed := exposedMetrics(t)
	data, err := os.ReadFile(alertsFile)
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range readRules(t, data).Groups {
		for _, r := range g.Rules {
			expr, _ := r["expr"].(string)
			for _, n := range detourMetrics(expr) {
				if !exposed[n] {
					t.Errorf("alert %s names %s, which no detour component exposes", r["alert"], n)
				}
			}
		}
	}
}

// The dashboard is a Grafana dashboard whose every query names only series detour exposes.
func TestDashboard(t *testing.T) {
	exposed := exposedMetrics(t)
	data, err := os.ReadFile("charts/detour/files/dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		UID    string `json:"uid"`
		Title  string `json:"title"`
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(data, &d); err != nil {
		t.Fatalf("the dashboard is not JSON: %v", err)
	}
	if d.UID == "" || d.Title == "" || len(d.Panels) == 0 {
		t.Fatalf("the dashboard has uid %q, title %q and %d panels", d.UID, d.Title, len(d.Panels))
	}
	seen := map[string]bool{}
	for _, p := range d.Panels {
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, q := range p.Targets {
			names := detourMetrics(q.Expr)
			if len(names) == 0 {
				t.Errorf("panel %q: query %q names no detour metric", p.Title, q.Expr)
			}
			for _, n := range names {
				seen[n] = true
				if !exposed[n] {
					t.Errorf("panel %q: query %q names %s, which no detour component exposes", p.Title, q.Expr, n)
				}
			}
		}
	}
	// What the issue asks the dashboard to show.
	for _, n := range []string{"detour_webhook_admissions_total", "detour_webhook_admission_duration_seconds_bucket",
		"detour_cni_add_duration_seconds_bucket", "detour_node_ready", "detour_repair_pods_seen_total", "detour_repair_pods_deleted_total"} {
		if !seen[n] {
			t.Errorf("no panel shows %s", n)
		}
	}
	objs := objects(t, render(t, []string{"metrics.dashboard.enabled=true"}))
	var cm struct {
		Metadata struct {
			Labels map[string]string `json:"labels"`
		} `json:"metadata"`
		Data map[string]string `json:"data"`
	}
	find(t, objs, "ConfigMap", "detour-dashboard", &cm)
	if cm.Data["detour.json"] != string(data) || cm.Metadata.Labels["grafana_dashboard"] != "1" {
		t.Errorf("the dashboard ConfigMap has labels %v and %d bytes of detour.json; want grafana_dashboard=1 and the dashboard", cm.Metadata.Labels, len(cm.Data["detour.json"]))
	}
}
