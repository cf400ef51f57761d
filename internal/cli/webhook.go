package cli

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/detourmesh/detour/inject"
	"github.com/detourmesh/detour/webhook"
)

// newWebhookCommand returns `detour webhook`, the injection webhook server.
func newWebhookCommand() *cobra.Command {
	o := webhook.Options{}
	var configPath, kubeconfig string
	var logs logFlags
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
			log, err := logs.setUp(cmd.Context(), cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			cfg, err := inject.LoadConfig(configPath)
			if err != nil {
				return fmt.Errorf("%w; the webhook does not start with an invalid configuration", err)
			}
			rc, err := restConfig(cmd.Context(), kubeconfig, "webhook")
			if err != nil {
				return err
			}
			o.Config, o.RESTConfig, o.Logger = cfg, rc, log
			gcPercent, memLimit := setGCDefaults(os.Getenv, "/sys/fs/cgroup")
			log.Info("garbage collector", "gcPercent", gcPercent, "memoryLimitBytes", memLimit)
			return webhook.Run(cmd.Context(), o)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&configPath, "config", inject.DefaultConfigPath, "configuration file (YAML); see docs/webhook.md")
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
	fl.StringVar(&kubeconfig, "kubeconfig", "", "kubeconfig file (default $KUBECONFIG, else in-cluster)")
	fl.DurationVar(&o.ShutdownDelay, "shutdown-delay", 5*time.Second, "at SIGTERM, keep serving this long with /readyz failing before closing, so that the endpoints drop the replica first (0: close at once)")
	logs.add(fl, "json") // debug logs every admission
	return cmd
}

// webhookGCPercent is the webhook's GOGC unless the environment sets one. Its live heap is a
// few MiB (the namespace cache, the requests in flight) and each admission allocates about
// 75 KiB, so at Go's default of 100 it collected garbage every hundred admissions or so and
// spent about a sixth of its CPU on it; at 300, a few percent, for about 10 MiB more RSS, which
// stays under the chart's 64 MiB memory request (docs/benchmarks-webhook.md).
const webhookGCPercent = 300

// setGCDefaults sets the webhook's garbage collector defaults, unless the environment sets its
// own (GOGC, GOMEMLIMIT): GOGC 300, and a soft memory limit of three quarters of the memory
// limit of the process's cgroup (v2 memory.max, or v1 memory/memory.limit_in_bytes under
// cgroupRoot), so that the larger heap never brings the container near its OOM kill; none
// without a cgroup limit. It returns the GOGC and memory limit in effect (math.MaxInt64: none).
func setGCDefaults(getenv func(string) string, cgroupRoot string) (gcPercent int, memLimit int64) {
	if getenv("GOGC") == "" {
		debug.SetGCPercent(webhookGCPercent)
	}
	gcPercent = debug.SetGCPercent(-1)
	debug.SetGCPercent(gcPercent)
	if getenv("GOMEMLIMIT") == "" {
		if limit, ok := cgroupMemoryLimit(cgroupRoot); ok {
			debug.SetMemoryLimit(limit / 4 * 3)
		}
	}
	return gcPercent, debug.SetMemoryLimit(-1)
}

// cgroupMemoryLimit reads the memory limit of the cgroup at root (a container's own, with
// cgroup namespaces): v2, else v1. Unlimited is no limit.
func cgroupMemoryLimit(root string) (int64, bool) {
	for _, f := range []string{"memory.max", "memory/memory.limit_in_bytes"} {
		b, err := os.ReadFile(filepath.Join(root, f))
		if err != nil {
			continue
		}
		n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		if err != nil || n <= 0 || n >= 1<<60 { // "max", or v1's unlimited (about 2^63)
			return 0, false
		}
		return n, true
	}
	return 0, false
}
