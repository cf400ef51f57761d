package nodeagent_test

import (
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"

	"github.com/detourmesh/detour/cniplugin"
	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/nodeagent"
)

func TestFlagsParse(t *testing.T) {
	base := func() nodeagent.Flags {
		f := nodeagent.DefaultFlags()
		f.APIServer, f.PluginSource = "https://10.96.0.1:443", "/opt/detour/bin/detour-cni"
		return f
	}
	cfg, err := base().Parse()
	if err != nil {
		t.Fatal(err)
	}
	if cfg.KubeconfigPath != "/host/etc/cni/net.d/detour-cni.kubeconfig" || cfg.HostKubeconfigPath != "/etc/cni/net.d/detour-cni.kubeconfig" || cfg.HostTokenPath != "/etc/cni/net.d/detour-cni.token" {
		t.Errorf("paths %+v", cfg)
	}
	f := base()
	f.ExcludeNamespaces, f.LogFile = nil, "/var/log/detour-cni.log"
	cfg, err = f.Parse()
	if err != nil || !strings.Contains(string(cfg.Entry), `"excludeNamespaces":[]`) || !strings.Contains(string(cfg.Entry), `"logFile":"/var/log/detour-cni.log"`) {
		t.Errorf("entry %s, %v: an empty exclusion list must be written as [] (absent means the plugin's default)", cfg.Entry, err)
	}
	f = base()
	f.IPv6 = "always"
	if cfg, err := f.Parse(); err != nil || !strings.Contains(string(cfg.Entry), `"ipv6":"always"`) {
		t.Errorf("ipv6 always: entry %s, %v", cfg.Entry, err)
	}
	t.Setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
	t.Setenv("KUBERNETES_SERVICE_PORT", "443")
	f = base()
	f.APIServer = ""
	if cfg, err := f.Parse(); err != nil || cfg.APIServer != "https://[fd00::1]:443" {
		t.Errorf("in-cluster API server %q, %v", cfg.APIServer, err)
	}

	for _, tc := range []struct {
		modify func(*nodeagent.Flags)
		want   string
	}{
		{func(f *nodeagent.Flags) { f.ConfDir = "etc/cni" }, `--cni-conf-dir "etc/cni"`},
		{func(f *nodeagent.Flags) { f.KubeconfigName = "x.conflist" }, `--kubeconfig-name "x.conflist"`},
		{func(f *nodeagent.Flags) { f.TokenName = "../token" }, `--token-name "../token"`},
		{func(f *nodeagent.Flags) { f.TokenName = f.KubeconfigName }, "must differ"},
		{func(f *nodeagent.Flags) { f.PluginSource = "detour-cni" }, `--plugin-source "detour-cni"`},
		{func(f *nodeagent.Flags) { f.APIServer = "http://10.96.0.1" }, `--api-server "http://10.96.0.1"`},
		{func(f *nodeagent.Flags) { f.APITimeout = time.Hour }, `--api-timeout "1h0m0s"`},
		{func(f *nodeagent.Flags) { f.IPTablesBackend = "nftable" }, `--iptables-backend "nftable"`},
		{func(f *nodeagent.Flags) { f.LogLevel = "trace" }, `--plugin-log-level "trace"`},
		{func(f *nodeagent.Flags) { f.LogFile = "cni.log" }, `--plugin-log-file "cni.log"`},
		{func(f *nodeagent.Flags) { f.ExcludeNamespaces = []string{"Kube_System"} }, `--exclude-namespaces "Kube_System"`},
		{func(f *nodeagent.Flags) { f.IPv6 = "on" }, `--ipv6 "on"`},
		{func(f *nodeagent.Flags) { f.NodeName = "Node 1" }, `--node-name "Node 1"`},
		{func(f *nodeagent.Flags) { f.StartupTaint = "bad key!" }, `--startup-taint "bad key!"`},
		{func(f *nodeagent.Flags) { f.Resync = 0 }, `--resync-interval "0s"`},
	} {
		f := base()
		tc.modify(&f)
		if _, err := f.Parse(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Parse error %v, want one containing %q", err, tc.want)
		}
	}
	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	f = base()
	f.APIServer = ""
	if _, err := f.Parse(); err == nil || !strings.Contains(err.Error(), "set --api-server") {
		t.Errorf("no API server: %v", err)
	}
}

// The entry the agent writes is what the plugin parses: every flag arrives as the plugin's
// setting (the contract test between install-cni and detour-cni).
func TestEntryParsedByPlugin(t *testing.T) {
	f := nodeagent.DefaultFlags()
	f.APIServer, f.PluginSource = "https://10.96.0.1:443", "/opt/detour/bin/detour-cni"
	f.APITimeout, f.IPTablesBackend, f.LogLevel, f.LogFile = 3*time.Second, "nft", "debug", "/var/log/detour-cni.log"
	f.ExcludeNamespaces, f.IPv6 = []string{"kube-system", "istio-system"}, "always"
	cfg, err := f.Parse()
	if err != nil {
		t.Fatal(err)
	}
	list, _, err := nodeagent.InsertEntry([]byte(calico), cfg.Entry)
	if err != nil {
		t.Fatal(err)
	}
	// The runtime hands each plugin its configuration with the list's name and version.
	netList, err := libcni.ConfListFromBytes(list)
	if err != nil {
		t.Fatal(err)
	}
	stdin, err := libcni.InjectConf(netList.Plugins[2], map[string]any{"name": netList.Name, "cniVersion": netList.CNIVersion})
	if err != nil {
		t.Fatal(err)
	}
	pc, err := cniplugin.ParseConfig(stdin.Bytes)
	if err != nil {
		t.Fatalf("the plugin rejects the agent's entry: %v\n%s", err, stdin.Bytes)
	}
	if pc.Type != cniplugin.PluginType || pc.Kubeconfig != "/etc/cni/net.d/detour-cni.kubeconfig" || pc.APITimeout != 3*time.Second ||
		pc.IPTablesBackend != iptables.BackendNFT || pc.LogLevel != slog.LevelDebug || pc.LogFile != "/var/log/detour-cni.log" ||
		!slices.Equal(pc.ExcludeNamespaces, []string{"kube-system", "istio-system"}) || pc.IPv6 != cniplugin.IPv6Always ||
		!netList.Plugins[2].Network.Capabilities[cniplugin.PodAnnotationsCapability] {
		t.Errorf("the plugin reads %+v", pc)
	}
}
