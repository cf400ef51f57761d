package cli

import (
	"fmt"
	"log/slog"
	"os"
	"strings"

	"github.com/spf13/cobra"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/detourmesh/detour/webhook"
)

// newWebhookCommand returns `detour webhook`, the injection webhook server.
func newWebhookCommand() *cobra.Command {
	o := webhook.Options{}
	var configPath, kubeconfig, logLevel, logFormat string
	cmd := &cobra.Command{
		Use:   "webhook",
		Short: "Serve the pod injection webhook (mutating admission, TLS)",
		Long: `webhook serves the mutating admission webhook that injects the detour validator and the proxy
into opted-in pods and writes the redirect annotations the detour CNI plugin reads. The mutation is
served over TLS at ` + webhook.MutatePath + ` from the certificate in --cert-dir (watched: a rotated
certificate is served without a restart); metrics, /healthz and /readyz over plain HTTP.

The configuration file is read once at start; the process refuses to start on an invalid one and
names the field. See docs/webhook.md.`,
		Example: `  # In the cluster (the Helm chart's Deployment):
  detour webhook --config=/etc/detour/webhook/config.yaml --cert-dir=/etc/detour/webhook/tls

  # Locally against a kind cluster, with debug logs:
  detour webhook --kubeconfig ~/.kube/config --config webhook.yaml --cert-dir ./certs --log-level=debug`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := newLogger(logLevel, logFormat)
			if err != nil {
				return err
			}
			cfg, err := webhook.LoadConfig(configPath)
			if err != nil {
				return fmt.Errorf("%w; the webhook does not start with an invalid configuration", err)
			}
			rules := clientcmd.NewDefaultClientConfigLoadingRules()
			rules.ExplicitPath = kubeconfig
			rc, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{}).ClientConfig()
			if err != nil {
				return fmt.Errorf("load the API server configuration (in-cluster, or --kubeconfig): %w", err)
			}
			rc.UserAgent = "detour-webhook"
			o.Config, o.RESTConfig, o.Logger = cfg, rc, log
			return webhook.Run(cmd.Context(), o)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&configPath, "config", webhook.DefaultConfigPath, "configuration file (YAML); see docs/webhook.md")
	fl.StringVar(&o.CertDir, "cert-dir", "/etc/detour/webhook/tls", "directory of the serving certificate and key (watched for rotation)")
	fl.StringVar(&o.CertName, "cert-name", "tls.crt", "certificate file name in --cert-dir")
	fl.StringVar(&o.KeyName, "key-name", "tls.key", "key file name in --cert-dir")
	fl.StringVar(&o.Host, "host", "", "address the webhook listens on (default all)")
	fl.IntVar(&o.Port, "port", 9443, "TLS port of the webhook")
	fl.StringVar(&o.MetricsAddr, "metrics-bind-address", ":8080", `address of the Prometheus /metrics endpoint ("0" disables it)`)
	fl.StringVar(&o.HealthAddr, "health-probe-bind-address", ":8081", "address of /healthz and /readyz")
	fl.StringVar(&o.PprofAddr, "pprof-bind-address", "", "address of Go's /debug/pprof profiles (default off; for diagnosing CPU or memory use)")
	fl.BoolVar(&o.EnableHTTP2, "enable-http2", false, "offer HTTP/2 on the webhook port (off: guards against HTTP/2 stream-reset attacks)")
	fl.StringVar(&o.OwnNamespace, "namespace", os.Getenv("POD_NAMESPACE"), "detour's namespace, whose pods are never injected (default $POD_NAMESPACE)")
	fl.StringVar(&o.CertSecret, "cert-secret", "", "keep the webhook's own CA and serving certificate in this Secret of --namespace, write them to --cert-dir and renew them (empty: the certificate comes from elsewhere, e.g. cert-manager)")
	fl.StringVar(&o.ServiceName, "service-name", "detour-webhook", "the webhook's Service, whose DNS names the self-managed certificate is for")
	fl.StringVar(&o.WebhookConfiguration, "webhook-configuration", "", "MutatingWebhookConfiguration whose caBundle the webhook keeps current (with --cert-secret)")
	fl.StringVar(&kubeconfig, "kubeconfig", "", "kubeconfig file (default in-cluster, or $KUBECONFIG)")
	fl.StringVar(&logLevel, "log-level", "info", "debug, info, warn or error (debug logs every admission)")
	fl.StringVar(&logFormat, "log-format", "json", "json or text")
	return cmd
}

// newLogger returns the structured logger of a long-running command, on stderr.
func newLogger(level, format string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: use debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: l}
	switch strings.ToLower(format) {
	case "json":
		return slog.New(slog.NewJSONHandler(os.Stderr, opts)), nil
	case "text":
		return slog.New(slog.NewTextHandler(os.Stderr, opts)), nil
	}
	return nil, fmt.Errorf("--log-format %q: use json or text", format)
}
