package cli

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/detourmesh/detour/internal/clustercheck"
)

// clusterFlags are the flags of detour check --cluster.
type clusterFlags struct {
	enabled     bool
	kubeconfig  string
	context     string
	namespace   string
	since       time.Duration
	output      string
	webhookDial string
}

func (f *clusterFlags) addFlags(fl *pflag.FlagSet) {
	fl.BoolVar(&f.enabled, "cluster", false, "check the installation through the API server instead of this node")
	fl.StringVar(&f.kubeconfig, "kubeconfig", "", "the kubeconfig (default: $KUBECONFIG, else ~/.kube/config, as kubectl)")
	fl.StringVar(&f.context, "context", "", "the kubeconfig context (default: its current context)")
	fl.StringVarP(&f.namespace, "namespace", "n", clustercheck.DefaultNamespace, "detour's namespace (the chart's release namespace)")
	fl.DurationVar(&f.since, "since", time.Hour, "how far back the repair controller's Events count")
	fl.StringVarP(&f.output, "output", "o", "text", "text or json")
	fl.StringVar(&f.webhookDial, "webhook-dial", "port-forward", "how to reach a webhook pod to see its certificate: port-forward (through the API server, as kubectl port-forward) or direct (the pod's address, from inside the cluster network)")
}

func (f *clusterFlags) run(cmd *cobra.Command) error {
	if f.output != "text" && f.output != "json" {
		return fmt.Errorf("-o %q: use text or json", f.output)
	}
	if f.since <= 0 {
		return fmt.Errorf("--since %s: use a positive duration such as 1h or 30m", f.since)
	}
	if f.webhookDial != "port-forward" && f.webhookDial != "direct" {
		return fmt.Errorf("--webhook-dial %q: use port-forward or direct", f.webhookDial)
	}
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = f.kubeconfig
	loader := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{CurrentContext: f.context})
	cfg, err := loader.ClientConfig()
	if err != nil {
		return fmt.Errorf("load the kubeconfig: %w (set --kubeconfig or $KUBECONFIG, and --context, as for kubectl)", err)
	}
	cfg.UserAgent = userAgent("check")
	// The admission probe's warnings are about a pod that is never stored.
	cfg.WarningHandler = rest.NoWarnings{}
	cfg.Timeout = 30 * time.Second
	// The clientset speaks protobuf, which every type the check reads has: on a cluster of tens
	// of thousands of pods it decodes them with a fraction of JSON's work and garbage.
	pb := rest.CopyConfig(cfg)
	pb.ContentType = runtime.ContentTypeProtobuf
	pb.AcceptContentTypes = runtime.ContentTypeProtobuf + "," + runtime.ContentTypeJSON
	client, err := kubernetes.NewForConfig(pb)
	if err != nil {
		return fmt.Errorf("client for %s: %w", cfg.Host, err)
	}
	dial := clustercheck.DialDirect
	if f.webhookDial == "port-forward" {
		dial = clustercheck.PortForward(cfg, client)
	}
	report := clustercheck.New(client,
		clustercheck.WithNamespace(f.namespace), clustercheck.WithSince(f.since),
		clustercheck.WithHost(cfg.Host), clustercheck.WithDialer(dial),
	).Run(cmd.Context())
	if f.output == "json" {
		err = report.WriteJSON(cmd.OutOrStdout())
	} else {
		err = report.WriteText(cmd.OutOrStdout())
	}
	if err != nil {
		return err
	}
	if report.Failed() {
		return fmt.Errorf("%d check(s) failed; see %s", report.Errors, clustercheck.DocsURL)
	}
	return nil
}
