package cli

import (
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/detourmesh/detour/inject"
	"github.com/detourmesh/detour/internal/manifest"
)

// injectFlags are the configuration settings `detour inject` can override on the command
// line; each maps onto the configuration file field of the same name.
type injectFlags struct {
	config         string
	proxyImage     string
	proxyUID       int64
	validatorImage string
	validatorUID   int64
	initEgress     string
	sidecarMode    string
	validatorMode  string
	startGate      string
	conflictPolicy string
	gidRange       string
}

// overrides turns the flags the user set into configuration overrides.
func (f *injectFlags) overrides(cmd *cobra.Command) (func(*inject.File), error) {
	changed := cmd.Flags().Changed
	var gids inject.GIDRangeFile
	if changed("gid-range") {
		var err error
		if gids, err = inject.ParseGIDRange(f.gidRange); err != nil {
			return nil, fmt.Errorf("--gid-range: %w", err)
		}
	}
	return func(c *inject.File) {
		if changed("proxy-image") {
			c.Proxy.Image = f.proxyImage
		}
		if changed("proxy-uid") {
			c.Proxy.UID = &f.proxyUID
		}
		if changed("validator-image") {
			c.Validator.Image = f.validatorImage
		}
		if changed("validator-uid") {
			c.Validator.UID = &f.validatorUID
		}
		if changed("init-egress") {
			c.InitEgress = f.initEgress
		}
		if changed("sidecar-mode") {
			c.SidecarMode = f.sidecarMode
		}
		if changed("validator-mode") {
			c.Validator.Mode = f.validatorMode
		}
		if changed("start-gate") {
			c.Proxy.StartGate = f.startGate
		}
		if changed("conflict-policy") {
			c.ConflictPolicy = f.conflictPolicy
		}
		if changed("gid-range") {
			c.GIDRange = gids
		}
	}, nil
}

func (f *injectFlags) load(cmd *cobra.Command) (*inject.Config, error) {
	o, err := f.overrides(cmd)
	if err != nil {
		return nil, err
	}
	if f.config == "" {
		cfg, err := inject.ParseConfig(nil, o)
		if err != nil {
			return nil, fmt.Errorf("configuration (from flags; --config reads a file): %w", err)
		}
		return cfg, nil
	}
	return inject.LoadConfig(f.config, o)
}

func (f *injectFlags) register(cmd *cobra.Command) {
	fl := cmd.Flags()
	fl.StringVar(&f.config, "config", "", "webhook configuration file (the webhook's ConfigMap data); flags override its fields")
	fl.StringVar(&f.proxyImage, "proxy-image", "", "proxy.image: the proxy container's image (required unless the config file sets it)")
	fl.Int64Var(&f.proxyUID, "proxy-uid", inject.DefaultProxyUID, "proxy.uid: the UID the proxy runs as")
	fl.StringVar(&f.validatorImage, "validator-image", "", "validator.image (default the detour image of this version)")
	fl.Int64Var(&f.validatorUID, "validator-uid", inject.DefaultValidatorUID, "validator.uid: the UID the validator runs as")
	fl.StringVar(&f.initEgress, "init-egress", "*", `initEgress: init containers that keep direct egress: "*", "none" or names`)
	fl.StringVar(&f.sidecarMode, "sidecar-mode", "auto", `sidecarMode: "auto", "container" or "native"`)
	fl.StringVar(&f.validatorMode, "validator-mode", "auto", `validator.mode: "auto", "init-container" or "image-volume" (the check in the proxy's start)`)
	fl.StringVar(&f.startGate, "start-gate", "auto", `proxy.startGate: "auto", "probe" (the proxy's startup probe holds the pod's next containers) or "hook" (detour's postStart hook, where the check runs in the proxy's start)`)
	fl.StringVar(&f.conflictPolicy, "conflict-policy", "warn", `conflictPolicy: "warn" or "deny" when an init container cannot keep egress`)
	fl.StringVar(&f.gidRange, "gid-range", fmt.Sprintf("%d-%d", inject.DefaultGIDFirst, inject.DefaultGIDLast), "gidRange: reserved range of dedicated GIDs, first-last")
}

// newInjectCommand returns `detour inject`, the webhook's mutation offline.
func newInjectCommand() *cobra.Command {
	var f injectFlags
	var file string
	var native, imageVolumes bool
	var nsAnnotations []string
	cmd := &cobra.Command{
		Use:   "inject -f FILE|-",
		Short: "Inject the proxy and validator into workload YAML offline, exactly as the webhook would",
		Long: `inject applies the detour webhook's own mutation to every pod and pod template in a YAML or JSON
stream: Pods, Deployments, StatefulSets, DaemonSets, ReplicaSets, Jobs, CronJobs, Lists, and any number
of documents. Other documents pass through unchanged (stderr says so for a kind it does not know
that holds a pod template, such as an Argo Rollout). The webhook's warnings go to stderr; a pod
the webhook would deny fails the command and nothing is written.

Each pod is treated as if its namespace were opted in (detour.dev/inject: enabled), unless
--namespace-annotation says otherwise; a pod annotated detour.dev/inject: disabled is left alone.
Without --namespace-annotation an injected pod gets detour.dev/inject: enabled itself, so that the
webhook injects it the same way in any namespace.`,
		Example: `  # Inject a Deployment and apply it:
  detour inject -f deploy.yaml --proxy-image=ghcr.io/example/proxy:v1 | kubectl apply -f -

  # Use the webhook's own configuration, in container mode, as on a cluster without native sidecars:
  detour inject -f app.yaml --config=webhook.yaml --native-sidecars=false

  # As on a cluster whose nodes cannot mount image volumes (the validator as an init container):
  detour inject -f app.yaml --config=webhook.yaml --image-volumes=false

  # Simulate namespace annotations (here: skip SMTP for every pod):
  kubectl get deploy web -o yaml | detour inject -f - --config=webhook.yaml \
      --namespace-annotation detour.dev/skip-outbound-ports=25`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := f.load(cmd)
			if err != nil {
				return err
			}
			var ns map[string]string
			if len(nsAnnotations) > 0 {
				ns = map[string]string{"detour.dev/inject": "enabled"}
				for _, kv := range nsAnnotations {
					k, v, ok := strings.Cut(kv, "=")
					if !ok || k == "" {
						return fmt.Errorf("--namespace-annotation %q: write it as key=value", kv)
					}
					ns[k] = v
				}
			}
			in, closeIn, err := openInput(cmd, file)
			if err != nil {
				return err
			}
			defer closeIn()
			validator := inject.ResolveValidatorMode(cfg, inject.OfflineCluster(imageVolumes))
			notices, err := manifest.InjectStream(in, cmd.OutOrStdout(), manifest.InjectOptions{
				Config: cfg, NamespaceAnnotations: ns, NativeSidecars: native, Validator: validator.Mode,
			})
			for _, n := range notices {
				fmt.Fprintln(cmd.ErrOrStderr(), "Warning:", n)
			}
			if err != nil {
				return fmt.Errorf("inject %s: %w", file, err)
			}
			return nil
		},
	}
	f.register(cmd)
	cmd.Flags().StringVarP(&file, "filename", "f", "", "the YAML or JSON to inject; - reads standard input")
	cmd.Flags().BoolVar(&native, "native-sidecars", true, "the target cluster runs native sidecars (Kubernetes 1.29 or later); sidecar mode auto then picks native")
	cmd.Flags().BoolVar(&imageVolumes, "image-volumes", true, "the target cluster's nodes mount image volumes (Kubernetes 1.35 or later, containerd 2.1 or later); validator mode auto then runs the check in the proxy's start")
	cmd.Flags().StringArrayVar(&nsAnnotations, "namespace-annotation", nil, "an annotation of the pods' namespace, key=value (repeatable)")
	_ = cmd.MarkFlagRequired("filename")
	return cmd
}

// openInput opens file, or standard input for "-".
func openInput(cmd *cobra.Command, file string) (io.Reader, func(), error) {
	if file == "-" {
		return cmd.InOrStdin(), func() {}, nil
	}
	fh, err := os.Open(file)
	if err != nil {
		return nil, nil, err
	}
	return fh, func() { fh.Close() }, nil
}
