package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"path/filepath"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"k8s.io/client-go/kubernetes"

	"github.com/detourmesh/detour/cniplugin"
	"github.com/detourmesh/detour/nodeagent"
)

// newInstallCNICommand returns `detour install-cni`, the node agent.
func newInstallCNICommand() *cobra.Command {
	o := &installCNIOptions{
		f:       nodeagent.DefaultFlags(),
		podName: os.Getenv("POD_NAME"),
		podNS:   os.Getenv("POD_NAMESPACE"),
	}
	cmd := &cobra.Command{
		Use:   "install-cni",
		Short: "Install detour-cni into the node's CNI configuration and keep it there (DaemonSet)",
		Long: `install-cni is detour's node agent. It waits for the primary CNI's configuration, then installs the
detour-cni binary, a kubeconfig for it, and detour's entry at the end of the configuration the runtime
uses; it puts the entry back whenever the primary rewrites its file, keeps the plugin's token fresh
(requested for --plugin-service-account through the TokenRequest API, or else a copy of the agent's
own), and once everything is in place removes the node's startup taint and labels the node
detour.dev/cni-ready=true (and removes the label whenever the entry is out of place later). On
SIGTERM it leaves everything in place — unless, with --pod-name and --pod-namespace, it finds
that the DaemonSet running it is being deleted (helm uninstall): then it removes detour from the
node first. --uninstall removes it, and with --hold stays up and ready afterwards. See
docs/node-agent.md.`,
		Example: `  # In the DaemonSet (host's /etc/cni/net.d and /opt/cni/bin mounted under /host), the plugin with
  # its own service account detour-cni in the agent's namespace:
  detour install-cni --node-name=$(NODE_NAME) --plugin-service-account=detour-cni

  # Remove detour from the node and exit:
  detour install-cni --uninstall --node-name=$(NODE_NAME)

  # The chart's uninstall mode: remove detour, then stay ready until SIGTERM so that
  # "kubectl rollout status" shows when every node is clean:
  detour install-cni --uninstall --hold --node-name=$(NODE_NAME)`,
		Args: cobra.NoArgs,
		RunE: o.run,
	}
	o.addFlags(cmd.Flags())
	return cmd
}

// installCNIOptions are install-cni's flags: the node agent's own and the command's.
type installCNIOptions struct {
	f          nodeagent.Flags
	uninstall  bool
	hold       bool
	healthAddr string
	// metricsAddr serves /metrics (with the probes when it equals healthAddr); mergeFrom are
	// other endpoints whose detour_* metrics it serves too; statsFile is the plugin's ADD counts.
	metricsAddr string
	mergeFrom   []string
	statsFile   string
	kubeconfig  string
	logs        logFlags
	podName     string
	podNS       string
}

func (o *installCNIOptions) addFlags(fl *pflag.FlagSet) {
	fl.StringVar(&o.f.ConfDir, "cni-conf-dir", o.f.ConfDir, "the host's CNI config directory, as mounted in the agent's container")
	fl.StringVar(&o.f.HostConfDir, "host-cni-conf-dir", o.f.HostConfDir, "the same directory as the host sees it (paths the plugin reads are written with it)")
	fl.StringVar(&o.f.BinDir, "cni-bin-dir", o.f.BinDir, "the host's CNI bin directory, as mounted in the agent's container")
	fl.StringVar(&o.f.PluginSource, "plugin-source", o.f.PluginSource, "the detour-cni binary to install (default: detour-cni next to this executable, /opt/detour/bin/detour-cni in the image)")
	fl.StringVar(&o.f.KubeconfigName, "kubeconfig-name", o.f.KubeconfigName, "file name of the plugin's kubeconfig in the CNI config directory")
	fl.StringVar(&o.f.TokenName, "token-name", o.f.TokenName, "file name of the plugin's token in the CNI config directory (its kubeconfig's tokenFile)")
	fl.StringVar(&o.f.ServiceAccountDir, "service-account-dir", o.f.ServiceAccountDir, "directory of the agent's service-account token and ca.crt")
	fl.StringVar(&o.f.PluginServiceAccount, "plugin-service-account", o.f.PluginServiceAccount, "service account whose token the plugin uses, requested through the TokenRequest API (needs create on serviceaccounts/token for it); empty: a copy of the agent's own token")
	fl.StringVar(&o.f.PluginServiceAccountNamespace, "plugin-service-account-namespace", o.f.PluginServiceAccountNamespace, "namespace of --plugin-service-account (default: the agent's own, from the namespace file in --service-account-dir)")
	fl.DurationVar(&o.f.PluginTokenTTL, "plugin-token-ttl", o.f.PluginTokenTTL, "lifetime requested for the plugin's token, 10m to 24h; it is renewed at 80% of it")
	fl.StringVar(&o.f.APIServer, "api-server", o.f.APIServer, "https URL the plugin reaches the API server at (default: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT)")
	fl.DurationVar(&o.f.APITimeout, "api-timeout", o.f.APITimeout, "the plugin's bound on a pod lookup (apiTimeout)")
	fl.StringVar(&o.f.IPTablesBackend, "iptables-backend", o.f.IPTablesBackend, `the plugin's backend: "auto", "legacy" or "nft" (iptables tools), or "nftables" (native, over netlink) (iptablesBackend)`)
	fl.StringVar(&o.f.LogLevel, "plugin-log-level", o.f.LogLevel, `the plugin's log level: "debug", "info", "warn" or "error" (logLevel)`)
	fl.StringVar(&o.f.LogFile, "plugin-log-file", o.f.LogFile, "the plugin's log file on the host; empty logs to the runtime only (logFile)")
	fl.StringVar(&o.f.LogFile, "log-file", o.f.LogFile, "the plugin's log file")
	deprecate(fl, "log-file", "plugin-log-file")
	fl.StringSliceVar(&o.f.ExcludeNamespaces, "exclude-namespaces", o.f.ExcludeNamespaces, "namespaces the plugin leaves alone; empty for none (excludeNamespaces)")
	fl.StringVar(&o.f.IPv6, "ipv6", o.f.IPv6, `the plugin's IPv6 rules: "auto" (when the pod has an IPv6 address) or "always" (ipv6, written only for "always")`)
	fl.StringVar(&o.f.NodeName, "node-name", o.f.NodeName, "this node's name (default $NODE_NAME)")
	fl.StringVar(&o.f.StartupTaint, "startup-taint", o.f.StartupTaint, "key of the startup taint removed once the config is in place (any effect)")
	fl.StringVar(&o.f.CNIConfigMode, "cni-config-mode", o.f.CNIConfigMode, `how the plugin's configuration reaches the runtime: "drop-in" (<conf dir>/<network>/`+nodeagent.DropInName+`, which survives the primary rewriting its conflist; runtimes that load drop-ins: containerd >= 2.1, CRI-O >= 1.33), "chained-entry" (an entry in the primary's conflist, put back after each rewrite) or "auto" (drop-in when the node's runtime loads them)`)
	fl.DurationVar(&o.f.Resync, "resync-interval", o.f.Resync, "how often the agent checks everything even without a file event")
	fl.StringVar(&o.healthAddr, "health-probe-bind-address", ":9641", `address of the /readyz and /healthz probes; "" disables them`)
	fl.StringVar(&o.healthAddr, "health-addr", ":9641", "address of the probes")
	fl.StringVar(&o.metricsAddr, "metrics-bind-address", ":9641", `address of the Prometheus /metrics endpoint; when not set, that of --health-probe-bind-address (one server for both); "" disables it`)
	fl.StringSliceVar(&o.mergeFrom, "merge-metrics-from", nil, "http URLs of other /metrics endpoints on the node whose detour_* metrics /metrics serves too (the chart: the repair controller's), so that one scrape covers the pod")
	fl.StringVar(&o.statsFile, "plugin-stats-file", defaultStatsFile, "the plugin's ADD counts ("+cniplugin.StatsFileName+" in its state directory "+cniplugin.DefaultStateDir+" on the host, as mounted in the agent's container), served as detour_cni_add_duration_seconds; \"\" serves none")
	deprecate(fl, "health-addr", "health-probe-bind-address")
	fl.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig of the agent's own API client (default $KUBECONFIG, else the pod's service account)")
	o.logs.add(fl, "text") // the agent's own logs; --plugin-log-level is the plugin's
	fl.StringVar(&o.podName, "pod-name", o.podName, "the agent's own pod (default $POD_NAME, downward API metadata.name): at SIGTERM it uninstalls when the DaemonSet running that pod is being deleted; empty: never")
	fl.StringVar(&o.podNS, "pod-namespace", o.podNS, "the namespace of --pod-name (default $POD_NAMESPACE)")
	fl.BoolVar(&o.uninstall, "uninstall", false, "remove detour's drop-in and conflist entries, the binary, the kubeconfig, the plugin's token and the node's ready label, then exit")
	fl.BoolVar(&o.hold, "hold", false, "with --uninstall: after removing everything, keep running and report ready on /readyz until SIGTERM (the chart's uninstall mode)")
}

// run parses the flags, builds the agent and runs it in the mode they ask for: uninstall and exit,
// uninstall and hold, or keep the node's configuration in place.
func (o *installCNIOptions) run(cmd *cobra.Command, _ []string) error {
	if o.hold && !o.uninstall {
		return errors.New("--hold only applies with --uninstall: it keeps the agent running and ready after it removed detour from the node (the chart's uninstall mode); add --uninstall, or drop --hold")
	}
	cfg, err := o.f.Parse()
	if err != nil {
		return err
	}
	if cfg.NodeName == "" {
		return errors.New("the node name is unknown: set --node-name or NODE_NAME (from the downward API, fieldRef spec.nodeName)")
	}
	log, err := o.logs.setUp(cmd.Context(), cmd.ErrOrStderr())
	if err != nil {
		return err
	}
	log = log.With("component", "install-cni", "node", cfg.NodeName)
	agent, client, err := o.newAgent(cmd.Context(), cfg, log)
	if err != nil {
		return err
	}
	// The sandboxes that got the inbound fallback, from the plugin's state directory: an Event
	// and an annotation on each pod, and a gauge.
	var fallbacks *nodeagent.FallbackReporter
	if o.statsFile != "" && !o.uninstall {
		fallbacks = nodeagent.NewFallbackReporter(client, filepath.Dir(o.statsFile), cfg.NodeName, log.With("component", "inbound-fallback"))
	}
	if o.uninstall && !o.hold {
		if err := agent.Uninstall(cmd.Context()); err != nil {
			return fmt.Errorf("uninstall: %w", err)
		}
		return nil
	}
	if !cmd.Flags().Changed("metrics-bind-address") {
		o.metricsAddr = o.healthAddr
	}
	endpoints, err := o.endpoints(agent, fallbacks, log)
	if err != nil {
		return err
	}
	stop, err := serveHTTP(log, endpoints...)
	if err != nil {
		return err
	}
	defer stop()
	if o.uninstall {
		if err := agent.UninstallAndHold(cmd.Context()); err != nil {
			return fmt.Errorf("uninstall: %w", err)
		}
		return nil
	}
	logTokenSource(log, cfg)
	if fallbacks != nil {
		go fallbacks.Run(cmd.Context(), cfg.Resync)
	}
	return agent.Run(cmd.Context())
}

// defaultStatsFile is the plugin's stats file as the chart mounts the host's /run/detour-cni.
var defaultStatsFile = filepath.Join("/host", cniplugin.DefaultStateDir, cniplugin.StatsFileName)

// endpoints are the agent's HTTP endpoints: the probes and /metrics, on one address or two.
func (o *installCNIOptions) endpoints(agent *nodeagent.Agent, fallbacks *nodeagent.FallbackReporter, log *slog.Logger) ([]endpoint, error) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if err := agent.Register(reg, o.statsFile); err != nil {
		return nil, err
	}
	if fallbacks != nil {
		if err := reg.Register(fallbacks); err != nil {
			return nil, err
		}
	}
	gatherers := prometheus.Gatherers{reg}
	for _, raw := range o.mergeFrom {
		u, err := url.Parse(raw)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return nil, fmt.Errorf("--merge-metrics-from %q is not an http(s) URL: give the other endpoint's full URL, such as http://127.0.0.1:9642/metrics", raw)
		}
		gatherers = append(gatherers, nodeagent.RemoteGatherer(raw))
	}
	// An endpoint that cannot be merged (the repair controller restarting) leaves the agent's own
	// metrics served, and is logged.
	metrics := promhttp.HandlerFor(gatherers, promhttp.HandlerOpts{
		ErrorHandling: promhttp.ContinueOnError,
		ErrorLog:      slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	})
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", metrics)
	if o.metricsAddr == o.healthAddr {
		mux.Handle("/", agent.Handler())
		return []endpoint{{o.healthAddr, mux}}, nil
	}
	return []endpoint{{o.healthAddr, agent.Handler()}, {o.metricsAddr, mux}}, nil
}

// newAgent builds the node agent with its API client, which it returns too; only an agent
// that keeps the node's configuration watches its own DaemonSet.
func (o *installCNIOptions) newAgent(ctx context.Context, cfg nodeagent.Config, log *slog.Logger) (*nodeagent.Agent, kubernetes.Interface, error) {
	rc, err := restConfig(ctx, o.kubeconfig, "install-cni")
	if err != nil {
		return nil, nil, err
	}
	client, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, nil, err
	}
	opts := []nodeagent.Option{nodeagent.WithNodeClient(client), nodeagent.WithLogger(log)}
	if !o.uninstall {
		opts = append(opts, nodeagent.WithOwnPod(o.podNS, o.podName), nodeagent.WithTokenClient(nodeagent.TokenClients(rc)))
	}
	return nodeagent.New(cfg, opts...), client, nil
}

// logTokenSource says which token the plugin uses.
func logTokenSource(log *slog.Logger, cfg nodeagent.Config) {
	if cfg.PluginServiceAccount != "" {
		log.Info("the plugin uses its own service account; requesting its token through the TokenRequest API",
			"serviceAccount", cfg.PluginServiceAccountNamespace+"/"+cfg.PluginServiceAccount, "ttl", cfg.PluginTokenTTL)
	} else {
		log.Warn("the plugin uses a copy of the agent's own service-account token, with all of the agent's permissions; set --plugin-service-account to give it its own")
	}
}

// deprecate keeps the flag old working, with a message that names its replacement.
func deprecate(fl *pflag.FlagSet, old, replacement string) {
	if err := fl.MarkDeprecated(old, "use --"+replacement); err != nil {
		panic(err) // only for a flag that is not defined: a bug
	}
}
