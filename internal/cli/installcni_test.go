package cli

import (
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/spf13/cobra"

	"github.com/detourmesh/detour/nodeagent"
)

// --hold without --uninstall is refused before anything else happens (no node name, no API
// client needed to say so).
func TestInstallCNIHoldNeedsUninstall(t *testing.T) {
	_, _, err := run(t, "", "install-cni", "--hold", "--node-name=n1", "--api-server=https://10.96.0.1:443")
	if err == nil || !strings.Contains(err.Error(), "--hold only applies with --uninstall") || !strings.Contains(err.Error(), "add --uninstall, or drop --hold") {
		t.Errorf("install-cni --hold = %v", err)
	}
	if code := ExitCode(err); code == 0 {
		t.Errorf("exit code %d", code)
	}
}

// The flags the chart passes exist.
func TestInstallCNIFlags(t *testing.T) {
	cmd := newInstallCNICommand()
	for name, def := range map[string]string{
		"plugin-service-account": "", "plugin-service-account-namespace": "", "plugin-token-ttl": "1h0m0s",
		"hold": "false", "uninstall": "false",
	} {
		f := cmd.Flags().Lookup(name)
		if f == nil || f.DefValue != def {
			t.Errorf("flag --%s = %+v, want default %q", name, f, def)
		}
	}
}

// The long-running commands take the same names for the same things, and the names they had
// before still work.
func TestOperationsFlags(t *testing.T) {
	for _, tc := range []struct {
		cmd       func() *cobra.Command
		args      []string
		want      map[string]string
		defaults  map[string]string
		noSuchOne []string
	}{
		{newWebhookCommand, nil, nil,
			map[string]string{"metrics-bind-address": ":8080", "health-probe-bind-address": ":8081", "log-level": "info", "log-format": "json"}, nil},
		{newInstallCNICommand, []string{"--health-addr=:1234", "--log-file=/var/log/cni.log"},
			map[string]string{"health-probe-bind-address": ":1234", "plugin-log-file": "/var/log/cni.log"},
			map[string]string{"health-probe-bind-address": ":9641", "metrics-bind-address": ":9641", "log-level": "info", "log-format": "text", "plugin-log-level": "info", "plugin-log-file": ""},
			nil},
		{newRepairCommand, []string{"--http-addr=:4321"},
			map[string]string{"metrics-bind-address": ":4321", "health-probe-bind-address": ":4321"},
			map[string]string{"metrics-bind-address": ":9642", "health-probe-bind-address": ":9642", "log-level": "info", "log-format": "text"}, nil},
	} {
		cmd := tc.cmd()
		for name, def := range tc.defaults {
			if f := cmd.Flags().Lookup(name); f == nil || f.DefValue != def {
				t.Errorf("%s --%s = %+v, want default %q", cmd.Name(), name, f, def)
			}
		}
		for _, name := range tc.noSuchOne {
			if cmd.Flags().Lookup(name) != nil {
				t.Errorf("%s has --%s", cmd.Name(), name)
			}
		}
		if err := cmd.ParseFlags(tc.args); err != nil {
			t.Fatalf("%s %v: %v", cmd.Name(), tc.args, err)
		}
		for name, v := range tc.want {
			if got := cmd.Flags().Lookup(name).Value.String(); got != v {
				t.Errorf("%s %v: --%s = %q, want %q", cmd.Name(), tc.args, name, got, v)
			}
		}
		for _, a := range tc.args {
			name := strings.TrimPrefix(strings.SplitN(a, "=", 2)[0], "--")
			if f := cmd.Flags().Lookup(name); f == nil || f.Deprecated == "" {
				t.Errorf("%s --%s is not marked deprecated", cmd.Name(), name)
			}
		}
	}
}

// On one address the agent serves its probes and /metrics; a --merge-metrics-from that is not
// a URL is refused with the flag's name.
func TestInstallCNIEndpoints(t *testing.T) {
	o := &installCNIOptions{f: nodeagent.DefaultFlags(), healthAddr: ":0", metricsAddr: ":0"}
	agent := nodeagent.New(nodeagent.Config{})
	eps, err := o.endpoints(agent, nil, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	if len(eps) != 1 {
		t.Fatalf("%d endpoints on one address, want 1", len(eps))
	}
	for path, want := range map[string]string{"/metrics": "detour_node_ready 0", "/readyz": "starting"} {
		rec := httptest.NewRecorder()
		eps[0].h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
		if !strings.Contains(rec.Body.String(), want) {
			t.Errorf("GET %s = %d %q, want %q in it", path, rec.Code, rec.Body.String(), want)
		}
	}
	o = &installCNIOptions{healthAddr: ":1", metricsAddr: ":2", mergeFrom: []string{"127.0.0.1:9642"}}
	if _, err := o.endpoints(nodeagent.New(nodeagent.Config{}), nil, slog.New(slog.DiscardHandler)); err == nil || !strings.Contains(err.Error(), "--merge-metrics-from") {
		t.Errorf("a merge address without a scheme: %v, want an error naming --merge-metrics-from", err)
	}
}
