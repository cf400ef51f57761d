package cli

import (
	"errors"
	"fmt"
	"os"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/detourmesh/detour/nodeagent"
)

// newInstallCNICommand returns `detour install-cni`, the node agent.
func newInstallCNICommand() *cobra.Command {
	f := nodeagent.DefaultFlags()
	var (
		uninstall  bool
		hold       bool
		healthAddr string
		kubeconfig string
		logs       logFlags
		podName    = os.Getenv("POD_NAME")
		podNS      = os.Getenv("POD_NAMESPACE")
	)
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
		RunE: func(cmd *cobra.Command, _ []string) error {
			if hold && !uninstall {
				return errors.New("--hold only applies with --uninstall: it keeps the agent running and ready after it removed detour from the node (the chart's uninstall mode); add --uninstall, or drop --hold")
			}
			cfg, err := f.Parse()
			if err != nil {
				return err
			}
			if cfg.NodeName == "" {
				return errors.New("the node name is unknown: set --node-name or NODE_NAME (from the downward API, fieldRef spec.nodeName)")
			}
			log, err := logs.setUp(cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			log = log.With("component", "install-cni", "node", cfg.NodeName)
			client, err := kubeClient(kubeconfig, "detour")
			if err != nil {
				return err
			}
			opts := []nodeagent.Option{nodeagent.WithNodeClient(client), nodeagent.WithLogger(log)}
			if !uninstall {
				opts = append(opts, nodeagent.WithOwnPod(podNS, podName))
			}
			agent := nodeagent.New(cfg, opts...)
			if uninstall && !hold {
				if err := agent.Uninstall(cmd.Context()); err != nil {
					return fmt.Errorf("uninstall: %w", err)
				}
				return nil
			}
			stop, err := serveHTTP(log, endpoint{healthAddr, agent.Handler()})
			if err != nil {
				return err
			}
			defer stop()
			if uninstall {
				if err := agent.UninstallAndHold(cmd.Context()); err != nil {
					return fmt.Errorf("uninstall: %w", err)
				}
				return nil
			}
			if cfg.PluginServiceAccount != "" {
				log.Info("the plugin uses its own service account; requesting its token through the TokenRequest API",
					"serviceAccount", cfg.PluginServiceAccountNamespace+"/"+cfg.PluginServiceAccount, "ttl", cfg.PluginTokenTTL)
			} else {
				log.Warn("the plugin uses a copy of the agent's own service-account token, with all of the agent's permissions; set --plugin-service-account to give it its own")
			}
			return agent.Run(cmd.Context())
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.ConfDir, "cni-conf-dir", f.ConfDir, "the host's CNI config directory, as mounted in the agent's container")
	fl.StringVar(&f.HostConfDir, "host-cni-conf-dir", f.HostConfDir, "the same directory as the host sees it (paths the plugin reads are written with it)")
	fl.StringVar(&f.BinDir, "cni-bin-dir", f.BinDir, "the host's CNI bin directory, as mounted in the agent's container")
	fl.StringVar(&f.PluginSource, "plugin-source", f.PluginSource, "the detour-cni binary to install (default: detour-cni next to this executable, /opt/detour/bin/detour-cni in the image)")
	fl.StringVar(&f.KubeconfigName, "kubeconfig-name", f.KubeconfigName, "file name of the plugin's kubeconfig in the CNI config directory")
	fl.StringVar(&f.TokenName, "token-name", f.TokenName, "file name of the plugin's token in the CNI config directory (its kubeconfig's tokenFile)")
	fl.StringVar(&f.ServiceAccountDir, "service-account-dir", f.ServiceAccountDir, "directory of the agent's service-account token and ca.crt")
	fl.StringVar(&f.PluginServiceAccount, "plugin-service-account", f.PluginServiceAccount, "service account whose token the plugin uses, requested through the TokenRequest API (needs create on serviceaccounts/token for it); empty: a copy of the agent's own token")
	fl.StringVar(&f.PluginServiceAccountNamespace, "plugin-service-account-namespace", f.PluginServiceAccountNamespace, "namespace of --plugin-service-account (default: the agent's own, from the namespace file in --service-account-dir)")
	fl.DurationVar(&f.PluginTokenTTL, "plugin-token-ttl", f.PluginTokenTTL, "lifetime requested for the plugin's token, 10m to 24h; it is renewed at 80% of it")
	fl.StringVar(&f.APIServer, "api-server", f.APIServer, "https URL the plugin reaches the API server at (default: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT)")
	fl.DurationVar(&f.APITimeout, "api-timeout", f.APITimeout, "the plugin's bound on a pod lookup (apiTimeout)")
	fl.StringVar(&f.IPTablesBackend, "iptables-backend", f.IPTablesBackend, `the plugin's backend: "auto", "legacy" or "nft" (iptables tools), or "nftables" (native, over netlink) (iptablesBackend)`)
	fl.StringVar(&f.LogLevel, "plugin-log-level", f.LogLevel, `the plugin's log level: "debug", "info", "warn" or "error" (logLevel)`)
	fl.StringVar(&f.LogFile, "plugin-log-file", f.LogFile, "the plugin's log file on the host; empty logs to the runtime only (logFile)")
	fl.StringVar(&f.LogFile, "log-file", f.LogFile, "the plugin's log file")
	deprecate(fl, "log-file", "plugin-log-file")
	fl.StringSliceVar(&f.ExcludeNamespaces, "exclude-namespaces", f.ExcludeNamespaces, "namespaces the plugin leaves alone; empty for none (excludeNamespaces)")
	fl.StringVar(&f.IPv6, "ipv6", f.IPv6, `the plugin's IPv6 rules: "auto" (when the pod has an IPv6 address) or "always" (ipv6, written only for "always")`)
	fl.StringVar(&f.NodeName, "node-name", f.NodeName, "this node's name (default $NODE_NAME)")
	fl.StringVar(&f.StartupTaint, "startup-taint", f.StartupTaint, "key of the startup taint removed once the config is in place (any effect)")
	fl.StringVar(&f.CNIConfigMode, "cni-config-mode", f.CNIConfigMode, `how the plugin's configuration reaches the runtime: "drop-in" (<conf dir>/<network>/`+nodeagent.DropInName+`, which survives the primary rewriting its conflist; runtimes that load drop-ins: containerd >= 2.1, CRI-O >= 1.33), "chained-entry" (an entry in the primary's conflist, put back after each rewrite) or "auto" (drop-in when the node's runtime loads them)`)
	fl.DurationVar(&f.Resync, "resync-interval", f.Resync, "how often the agent checks everything even without a file event")
	fl.StringVar(&healthAddr, "health-probe-bind-address", ":9641", `address of the /readyz and /healthz probes; "" disables them`)
	fl.StringVar(&healthAddr, "health-addr", ":9641", "address of the probes")
	deprecate(fl, "health-addr", "health-probe-bind-address")
	fl.StringVar(&kubeconfig, "kubeconfig", "", "kubeconfig of the agent's own API client (default $KUBECONFIG, else the pod's service account)")
	logs.add(fl, "text") // the agent's own logs; --plugin-log-level is the plugin's
	fl.StringVar(&podName, "pod-name", podName, "the agent's own pod (default $POD_NAME, downward API metadata.name): at SIGTERM it uninstalls when the DaemonSet running that pod is being deleted; empty: never")
	fl.StringVar(&podNS, "pod-namespace", podNS, "the namespace of --pod-name (default $POD_NAMESPACE)")
	fl.BoolVar(&uninstall, "uninstall", false, "remove detour's drop-in and conflist entries, the binary, the kubeconfig, the plugin's token and the node's ready label, then exit")
	fl.BoolVar(&hold, "hold", false, "with --uninstall: after removing everything, keep running and report ready on /readyz until SIGTERM (the chart's uninstall mode)")
	return cmd
}

// deprecate keeps the flag old working, with a message that names its replacement.
func deprecate(fl *pflag.FlagSet, old, replacement string) {
	if err := fl.MarkDeprecated(old, "use --"+replacement); err != nil {
		panic(err) // only for a flag that is not defined: a bug
	}
}
