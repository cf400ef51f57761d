package webhook

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	utilversion "k8s.io/apimachinery/pkg/util/version"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/healthz"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	ctrlmetrics "sigs.k8s.io/controller-runtime/pkg/metrics"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	crwebhook "sigs.k8s.io/controller-runtime/pkg/webhook"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/inject"
	"github.com/detourmesh/detour/internal/ctxtime"
	"github.com/detourmesh/detour/webhook/certs"
	"github.com/detourmesh/detour/webhook/internal/fastpath"
)

// Options configure [Run]. Zero values take the defaults noted on each field.
type Options struct {
	// Config is the injection configuration (required).
	Config *inject.Config
	// RESTConfig reaches the API server (required).
	RESTConfig *rest.Config
	// Host and Port are where the webhook serves TLS (default all addresses, port 9443).
	Host string
	Port int
	// CertDir holds the serving certificate and key (CertName, KeyName; default tls.crt and
	// tls.key). The files are watched: a rotated certificate is served without a restart.
	CertDir, CertName, KeyName string
	// CertSecret, when set, makes the webhook keep its own CA and serving certificate in this
	// Secret of OwnNamespace, valid for ServiceName, and keep the caBundle of the
	// MutatingWebhookConfiguration WebhookConfiguration current (see [certs.Certificates]). Without
	// it, the certificate in CertDir comes from elsewhere (cert-manager, a mounted Secret).
	CertSecret, ServiceName, WebhookConfiguration string
	// MetricsAddr serves /metrics over HTTP (default ":8080"; "0" disables it).
	MetricsAddr string
	// Registry is where the webhook's metrics are registered (default controller-runtime's
	// registry, the one the metrics endpoint serves).
	Registry prometheus.Registerer
	// HealthAddr serves /healthz and /readyz over HTTP (default ":8081").
	HealthAddr string
	// PprofAddr serves Go's net/http/pprof profiles; empty (the default) disables them.
	PprofAddr string
	// EnableHTTP2 offers HTTP/2 on the webhook port. It is off by default, as controller-runtime
	// advises, against HTTP/2 stream-reset attacks.
	EnableHTTP2 bool
	// OwnNamespace is detour's namespace; its pods are never injected.
	OwnNamespace string
	// ShutdownDelay is how long the webhook keeps serving once ctx ends, with /readyz failing,
	// before it closes its listener: time for the endpoints to drop it, so that the API server
	// sends no admission to a closed port during a rollout (0: close at once).
	ShutdownDelay time.Duration
	// Logger receives the webhook's structured logs and its manager's (default discard).
	// controller-runtime's and client-go's global loggers are the process's to set (`detour
	// webhook` bridges them to the same logger).
	Logger *slog.Logger
}

// NativeSidecarVersion is the first Kubernetes version that runs native sidecars by default.
var NativeSidecarVersion = utilversion.MajorMinor(1, 29)

// ServerVersion reads the API server's version through discovery and reports whether it runs
// native sidecars.
func ServerVersion(cfg *rest.Config) (string, bool, error) {
	dc, err := discovery.NewDiscoveryClientForConfig(cfg)
	if err != nil {
		return "", false, fmt.Errorf("create discovery client: %w", err)
	}
	info, err := dc.ServerVersion()
	if err != nil {
		return "", false, fmt.Errorf("read the API server version: %w", err)
	}
	v, err := utilversion.ParseGeneric(info.GitVersion)
	if err != nil {
		// Some distributions report odd git versions; the major and minor fields still hold
		// the release ("1", "29+").
		v, err = utilversion.ParseGeneric(info.Major + "." + strings.TrimSuffix(info.Minor, "+"))
		if err != nil {
			return info.GitVersion, false, fmt.Errorf("parse the API server version %q: %w", info.GitVersion, err)
		}
	}
	return info.GitVersion, v.AtLeast(NativeSidecarVersion), nil
}

// namespaceMeta is the metadata-only Namespace object the cache holds: the webhook needs only
// annotations, and metadata is a fraction of the memory.
func namespaceMeta() *metav1.PartialObjectMetadata {
	m := &metav1.PartialObjectMetadata{}
	m.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("Namespace"))
	return m
}

// namespaceCache reads namespaces from the informer cache, and from the API server only for a
// namespace the cache has not seen yet (created a moment before its first pod).
type namespaceCache struct {
	cached, live client.Reader
	misses       func()
}

func (n *namespaceCache) NamespaceAnnotations(ctx context.Context, name string) (map[string]string, error) {
	m := namespaceMeta()
	// No copy of the cached object: only its annotations are read, and never modified.
	err := n.cached.Get(ctx, client.ObjectKey{Name: name}, m, client.UnsafeDisableDeepCopy)
	if apierrors.IsNotFound(err) {
		n.misses()
		ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		m = namespaceMeta()
		err = n.live.Get(ctx, client.ObjectKey{Name: name}, m)
	}
	if err != nil {
		return nil, err
	}
	return m.Annotations, nil
}

// Run serves the webhook until ctx ends: the mutation at [MutatePath] over TLS, metrics,
// health and readiness (ready once the namespace cache has synced and the TLS server answers).
// It reads the API server's version once, for sidecar mode auto.
func Run(ctx context.Context, o Options) error {
	if o.Config == nil || o.RESTConfig == nil {
		return errors.New("run webhook: a configuration and a REST config are required")
	}
	log := o.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	logger := logr.FromSlogHandler(log.Handler())

	serverVersion, native, err := ServerVersion(o.RESTConfig)
	if err != nil {
		return fmt.Errorf("run webhook: %w (is the API server reachable?)", err)
	}
	cfg := *o.Config
	if o.OwnNamespace != "" && !slices.Contains(cfg.ExcludeNamespaces, o.OwnNamespace) {
		cfg.ExcludeNamespaces = append(slices.Clone(cfg.ExcludeNamespaces), o.OwnNamespace)
	}
	log.Info("starting the detour webhook", "apiServer", serverVersion, "nativeSidecars", native,
		"sidecarMode", cfg.SidecarMode, "conflictPolicy", cfg.ConflictPolicy, "initEgress", cfg.InitEgress.String(),
		"gidRange", cfg.GIDRange.String(), "excludeNamespaces", cfg.ExcludeNamespaces)
	if cfg.Proxy.StartupProbe == nil && (cfg.SidecarMode == inject.SidecarNative || cfg.SidecarMode == inject.SidecarAuto && native) {
		log.Warn("proxy.startupProbe is not set: in native sidecar mode the init containers may start before the proxy listens")
	}
	// With one node that mounts image volumes: what auto can never pick with this configuration
	// or API server, whatever the nodes.
	if d := inject.ResolveValidatorMode(&cfg, inject.Cluster{APIServerVersion: serverVersion, APIServerImageVolumes: inject.GateOn, Nodes: 1}); cfg.Validator.Mode == annotations.ValidatorAuto && d.Mode == annotations.ValidatorInitContainer {
		log.Info("validator mode auto: the validator runs as an init container", "reason", d.Reason)
	}

	ca, err := o.certificates(ctx, log)
	if err != nil {
		return fmt.Errorf("run webhook: %w", err)
	}
	mgr, err := o.newManager(logger)
	if err != nil {
		return fmt.Errorf("run webhook: %w", err)
	}
	informer, err := mgr.GetCache().GetInformer(ctx, namespaceMeta())
	if err != nil {
		return fmt.Errorf("run webhook: watch namespaces: %w", err)
	}
	reg := o.Registry
	if reg == nil {
		reg = ctrlmetrics.Registry
	}
	m, err := NewMetrics(reg)
	if err != nil {
		return fmt.Errorf("run webhook: %w", err)
	}
	if _, err := register(reg, CertificateExpiry(filepath.Join(o.CertDir, cmp.Or(o.CertName, "tls.crt")))); err != nil {
		return fmt.Errorf("run webhook: %w", err)
	}
	modes := NewValidatorModes(&cfg, serverVersion, log.With("component", "validator-mode"), m.validatorMode)
	// The API server's gate and the nodes matter only where the check may run in the proxy's
	// start: with validator.mode init-container the webhook neither reads nor watches them, and
	// needs no RBAC for them.
	// nodesSynced reports whether the node cache has synced, or that the webhook needs none; nil
	// until the webhook knows whether it may watch nodes.
	var nodesSynced atomic.Pointer[func() bool]
	always := func() bool { return true }
	if cfg.Validator.Mode != annotations.ValidatorInitContainer {
		cs, err := kubernetes.NewForConfig(o.RESTConfig)
		if err != nil {
			return fmt.Errorf("run webhook: %w", err)
		}
		read, err := newGateReader(o.RESTConfig)
		if err != nil {
			return fmt.Errorf("run webhook: %w", err)
		}
		gate := &gateWatch{read: read, set: modes.SetAPIServerGate, log: log, sleep: ctxtime.Sleep}
		if err := mgr.Add(manager.RunnableFunc(func(ctx context.Context) error {
			gate.run(ctx)
			return nil
		})); err != nil {
			return fmt.Errorf("run webhook: %w", err)
		}
		// Without RBAC on nodes (custom RBAC, or this image running under an older chart's
		// ClusterRole) the node cache would never sync, and the webhook never become Ready:
		// ask first, and run with the init container instead. Asked once the manager runs, not
		// before: while the API server does not answer, the webhook keeps asking, unready, and
		// its /healthz answers, so that the kubelet does not restart it.
		if err := mgr.Add(manager.RunnableFunc(func(ctx context.Context) error {
			may, why, err := mayWatchNodes(ctx, cs, log, ctxtime.Sleep)
			switch {
			case ctx.Err() != nil:
				return nil // stopping
			case err != nil:
				return err
			case !may:
				log.Warn("the validator's check runs as an init container in every pod", "reason", why)
				modes.SetNodesUnknown(why)
				nodesSynced.Store(&always)
				return nil
			}
			nodes, err := mgr.GetCache().GetInformer(ctx, &corev1.Node{})
			if ctx.Err() != nil {
				return nil
			}
			if err != nil {
				return fmt.Errorf("watch nodes: %w", err)
			}
			if _, err := nodes.AddEventHandler(modes.Handler()); err != nil {
				return fmt.Errorf("watch nodes: %w", err)
			}
			synced := nodes.HasSynced
			nodesSynced.Store(&synced)
			return nil
		})); err != nil {
			return fmt.Errorf("run webhook: %w", err)
		}
	} else {
		nodesSynced.Store(&always)
	}
	lookup := &namespaceCache{cached: mgr.GetClient(), live: mgr.GetAPIReader(), misses: m.nsMisses.Inc}
	handler := NewHandler(&cfg, lookup, native, WithLogger(log.With("component", "admission")), WithMetrics(m), WithValidatorModes(modes))
	mgr.GetWebhookServer().Register(MutatePath, &fastpath.ReviewHandler{Webhook: &admission.Webhook{
		Handler: handler,
		// The handler logs each admission itself; controller-runtime's per-request logger
		// would only cost allocations.
		LogConstructor: func(base logr.Logger, _ *admission.Request) logr.Logger { return base },
	}})

	if ca != nil {
		if err := mgr.Add(manager.RunnableFunc(ca.Run)); err != nil {
			return fmt.Errorf("run webhook: %w", err)
		}
	}
	if err := mgr.AddHealthzCheck("ping", healthz.Ping); err != nil {
		return fmt.Errorf("run webhook: %w", err)
	}
	if err := mgr.AddReadyzCheck("webhook", mgr.GetWebhookServer().StartedChecker()); err != nil {
		return fmt.Errorf("run webhook: %w", err)
	}
	var draining atomic.Bool
	if err := mgr.AddReadyzCheck("namespaces", func(*http.Request) error {
		switch {
		case draining.Load():
			return errors.New("shutting down: waiting for the endpoints to drop this replica before closing")
		case !informer.HasSynced():
			return errors.New("the namespace cache has not synced yet")
		case nodesSynced.Load() == nil:
			return errors.New("the webhook has not learned yet whether it may watch nodes (the validator mode depends on the nodes): its log says why")
		case !(*nodesSynced.Load())():
			return errors.New("the node cache has not synced yet (the validator mode depends on the nodes)")
		case cfg.Validator.Mode != annotations.ValidatorInitContainer && !modes.GateRead():
			return errors.New("the API server's ImageVolume gate has not been read yet (the validator mode depends on it)")
		}
		return nil
	}); err != nil {
		return fmt.Errorf("run webhook: %w", err)
	}
	// Drain: when ctx ends the replica first turns unready and keeps serving for ShutdownDelay,
	// so that the endpoints drop it while it still answers; then the manager stops, and the
	// server finishes the admissions in flight.
	mgrCtx, stop := context.WithCancel(context.WithoutCancel(ctx))
	defer stop()
	go func() {
		select {
		case <-ctx.Done():
		case <-mgrCtx.Done():
			return
		}
		draining.Store(true)
		if o.ShutdownDelay > 0 {
			log.Info("draining: unready, still serving", "for", o.ShutdownDelay)
			select {
			case <-time.After(o.ShutdownDelay):
			case <-mgrCtx.Done():
			}
		}
		stop()
	}()
	if err := mgr.Start(mgrCtx); err != nil {
		return fmt.Errorf("run webhook: %w", err)
	}
	return nil
}

// certificates sets up the self-managed certificates when o asks for them (else nil), and
// writes the serving files: the server reads them when it starts, so they must be there first.
func (o Options) certificates(ctx context.Context, log *slog.Logger) (*certs.Certificates, error) {
	if o.CertSecret == "" {
		return nil, nil
	}
	if o.OwnNamespace == "" || o.ServiceName == "" {
		return nil, errors.New("a certificate secret needs the webhook's namespace and service name (--namespace, --service-name)")
	}
	if err := os.MkdirAll(o.CertDir, 0o700); err != nil {
		return nil, err
	}
	cs, err := kubernetes.NewForConfig(o.RESTConfig)
	if err != nil {
		return nil, err
	}
	ca := &certs.Certificates{
		Client: cs, Namespace: o.OwnNamespace, SecretName: o.CertSecret, ServiceName: o.ServiceName,
		WebhookConfiguration: o.WebhookConfiguration,
		CertDir:              o.CertDir, CertName: cmp.Or(o.CertName, "tls.crt"), KeyName: cmp.Or(o.KeyName, "tls.key"),
		Log: log.With("component", "certificates"),
	}
	// The server reads the files when it starts, so they must be there first.
	if err := ca.Ensure(ctx); err != nil {
		return nil, fmt.Errorf("%w (check the webhook's RBAC on secrets and mutatingwebhookconfigurations)", err)
	}
	return ca, nil
}

// newManager is the controller-runtime manager of the webhook server: TLS 1.2 or later,
// HTTP/1.1 unless o enables HTTP/2, metrics, probes, and a cache without managed fields.
func (o Options) newManager(logger logr.Logger) (manager.Manager, error) {
	metricsAddr := o.MetricsAddr
	if metricsAddr == "" {
		metricsAddr = ":8080"
	}
	healthAddr := o.HealthAddr
	if healthAddr == "" {
		healthAddr = ":8081"
	}
	tlsOpts := []func(*tls.Config){func(c *tls.Config) {
		c.MinVersion = tls.VersionTLS12
		if !o.EnableHTTP2 {
			c.NextProtos = []string{"http/1.1"}
		}
	}}
	scheme := runtime.NewScheme()
	if err := corev1.AddToScheme(scheme); err != nil {
		return nil, err
	}
	mgr, err := manager.New(o.RESTConfig, manager.Options{
		Scheme:                 scheme,
		Logger:                 logger,
		Metrics:                metricsserver.Options{BindAddress: metricsAddr},
		HealthProbeBindAddress: healthAddr,
		PprofBindAddress:       o.PprofAddr,
		WebhookServer: crwebhook.NewServer(crwebhook.Options{
			Host: o.Host, Port: o.Port, CertDir: o.CertDir, CertName: o.CertName, KeyName: o.KeyName, TLSOpts: tlsOpts,
		}),
		Cache: cache.Options{
			DefaultTransform: cache.TransformStripManagedFields(),
			ByObject:         map[client.Object]cache.ByObject{&corev1.Node{}: {Transform: nodeImageVolumes}},
		},
	})
	if err != nil {
		return nil, fmt.Errorf("create the manager: %w", err)
	}
	return mgr, nil
}
