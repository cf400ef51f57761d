package cli

import (
	"os"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/spf13/cobra"

	"github.com/detourmesh/detour/repair"
)

// newRepairCommand returns `detour repair`, the node's repair controller.
func newRepairCommand() *cobra.Command {
	f := repair.DefaultFlags()
	f.NodeName = os.Getenv("NODE_NAME")
	var metricsAddr, healthAddr, kubeconfig string
	var logs logFlags
	cmd := &cobra.Command{
		Use:   "repair",
		Short: "Recreate this node's injected pods whose validator found no redirect (DaemonSet)",
		Long: `repair watches the pods of its own node. An injected pod whose check (the detour-validator init
container, or the detour-proxy's start) exited with code 42 (no redirect: the pod started before
detour's CNI config was in place) is deleted when its controller is one known to recreate it
(--recreating-owners: ReplicaSet, StatefulSet, DaemonSet), so the controller recreates it with the
redirect. A Job's pod is deleted where the kubelet runs its check again in the same sandbox, where it
cannot pass (at the proxy's start, or under restartPolicy OnFailure): its Job replaces it, counting one
failure; a restartPolicy Never pod whose validator init container failed is failed by the kubelet and
replaced by its Job. Any other pod (bare, a workflow's) is never deleted: it gets an Event and the
annotation detour.dev/recreate-required. Terminal pods, and pods whose check is running again, are
left alone; the per-owner backoff is saved on the node
(detour.dev/repair-backoff) and survives a restart. Repairs wait until the node carries
detour.dev/cni-ready=true, are rate-limited, and each is recorded as an Event (reason DetourCNIRepair)
and in Prometheus metrics on /metrics. See docs/node-agent.md.`,
		Example: `  # In the DaemonSet, next to install-cni:
  detour repair --node-name=$(NODE_NAME)

  # At most one repair every 5 seconds, 2 at once:
  detour repair --node-name=$(NODE_NAME) --rate=0.2 --burst=2`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := f.Parse()
			if err != nil {
				return err
			}
			log, err := logs.setUp(cmd.Context(), cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			log = log.With("component", repair.Component, "node", cfg.NodeName)
			client, err := kubeClient(cmd.Context(), kubeconfig, "repair")
			if err != nil {
				return err
			}
			reg := prometheus.NewRegistry()
			reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
			ctrl, err := repair.New(client, cfg, repair.WithLogger(log), repair.WithMetrics(repair.NewMetrics(reg)))
			if err != nil {
				return err
			}
			reg.MustRegister(ctrl.Collector())
			endpoints := []endpoint{{metricsAddr, ctrl.Handler(reg)}}
			if healthAddr != metricsAddr {
				endpoints = []endpoint{{metricsAddr, repair.MetricsHandler(reg)}, {healthAddr, ctrl.HealthHandler()}}
			}
			stop, err := serveHTTP(log, endpoints...)
			if err != nil {
				return err
			}
			defer stop()
			return ctrl.Run(cmd.Context())
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.NodeName, "node-name", f.NodeName, "this node's name; only its pods are watched (default $NODE_NAME)")
	fl.Float64Var(&f.Rate, "rate", f.Rate, "sustained repairs (deletions and annotations) per second")
	fl.IntVar(&f.Burst, "burst", f.Burst, "repairs allowed at once")
	fl.StringSliceVar(&f.RecreatingOwners, "recreating-owners", f.RecreatingOwners, "owners (group/Kind) known to recreate a deleted pod: their failed pods are deleted; a Job's where its check runs again in the same sandbox; every other pod is annotated detour.dev/recreate-required instead")
	fl.StringVar(&f.DefaultInject, "default-inject", f.DefaultInject, "the webhook's defaultInject: enabled counts the pods of namespaces without detour.dev/inject as asking for injection (detour_repair_pods{state=\"uninjected\"})")
	fl.StringSliceVar(&f.ExcludeNamespaces, "exclude-namespaces", f.ExcludeNamespaces, "the webhook's excludeNamespaces: their pods never count as uninjected")
	fl.StringVar(&f.OwnNamespace, "namespace", os.Getenv("POD_NAMESPACE"), "detour's namespace, excluded like the webhook excludes it (default $POD_NAMESPACE)")
	fl.BoolVar(&f.RequireCNIReady, "require-cni-ready", f.RequireCNIReady, "repair only while the node carries detour.dev/cni-ready=true (a pod recreated earlier could fail again)")
	fl.StringVar(&metricsAddr, "metrics-bind-address", ":9642", `address of the Prometheus /metrics endpoint; "" disables it`)
	fl.StringVar(&healthAddr, "health-probe-bind-address", ":9642", `address of /healthz and /readyz (the same as --metrics-bind-address: one server); "" disables them`)
	fl.Var(&sameAddr{&metricsAddr, &healthAddr}, "http-addr", "address of /metrics, /healthz and /readyz")
	deprecate(fl, "http-addr", "metrics-bind-address and --health-probe-bind-address")
	fl.StringVar(&kubeconfig, "kubeconfig", "", "kubeconfig of the controller's API client (default $KUBECONFIG, else the pod's service account)")
	logs.add(fl, "text")
	return cmd
}

// sameAddr is a flag that sets two addresses to its value (the deprecated --http-addr, which
// served metrics and probes together).
type sameAddr struct{ a, b *string }

func (s *sameAddr) String() string {
	if s.a == nil {
		return ""
	}
	return *s.a
}

func (s *sameAddr) Set(v string) error {
	*s.a, *s.b = v, v
	return nil
}

func (s *sameAddr) Type() string { return "string" }
