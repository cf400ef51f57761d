package nodeagent

import (
	"log/slog"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// Agent installs and keeps detour's CNI configuration on one node.
type Agent struct {
	cfg      Config
	log      *slog.Logger
	client   kubernetes.Interface
	node     *nodeReadiness
	tokens   *pluginTokens // nil: the plugin gets a copy of the agent's token
	binary   binaryInstaller
	debounce time.Duration
	now      func() time.Time
	fraction float64

	// labelRemoved: the ready label is known to be off the node (set by the reconcile only).
	labelRemoved bool
	// nodeGone: the node's Node object is deleted, and detour is kept off the node (Run only).
	nodeGone bool
	// nodeUnconfirmed: the watch said the Node object is deleted, and the read that confirms it
	// failed; the next reconcile reads again (Run only). The watch will not say it twice.
	nodeUnconfirmed bool
	// nodeChanged: the Node object changed in what the agent's marks depend on (the kubelet's or
	// runtime's version, a new object under the same name, the marks themselves); the next
	// reconcile marks the node again (Run only).
	nodeChanged bool
	// beforeReplace runs right before the agent replaces the primary's file (tests race it).
	beforeReplace func()
	// owner is the agent's DaemonSet, when WithOwnPod names the agent's pod.
	owner *ownDaemonSet
	// tokenClient builds a client that authenticates with the plugin's token (WithTokenClient).
	tokenClient func(token string) (kubernetes.Interface, error)
	// lastErr and lastErrAt are the reconcile error last logged, and when (Run only).
	lastErr   string
	lastErrAt time.Time
	// runtime is the node's containerRuntimeVersion as last read, at runtimeAt; modeLogged is
	// the mode decision last logged.
	runtime    string
	runtimeAt  time.Time
	modeLogged string
	// passes counts the reconcile passes Run has finished (tests wait on it).
	passes atomic.Int64

	// war follows the primary's file and detour's entry in it (entrywar.go): the reconcile and
	// the agent's own writes of configuration files (writeConfig, uninstalls included), all on
	// Run's goroutine.
	war entryWar

	// metrics are the agent's counters (Register exposes them).
	metrics *metrics

	mu     sync.Mutex
	status Status
}

// Option configures an Agent.
type Option func(*Agent)

// WithNodeClient sets the agent's API client: it marks the node ready through it (when
// Config.NodeName is set) and requests the plugin's token with it (when
// Config.PluginServiceAccount is set).
func WithNodeClient(client kubernetes.Interface) Option {
	return func(a *Agent) { a.client = client }
}

// WithClock sets the agent's clock (default time.Now), which decides when the plugin's token
// is due for refresh and whether it has expired.
func WithClock(now func() time.Time) Option { return func(a *Agent) { a.now = now } }

// WithTokenRefreshFraction sets the part of the plugin token's lifetime after which the agent
// requests the next one (default [DefaultTokenRefreshFraction]; tests shorten it).
func WithTokenRefreshFraction(f float64) Option { return func(a *Agent) { a.fraction = f } }

// WithOwnPod names the agent's own pod (downward API). At SIGTERM the agent then looks at the
// DaemonSet that runs it, and uninstalls detour from the node when that is being deleted (helm
// uninstall); a rollout or a drain leaves everything in place. It needs WithNodeClient.
func WithOwnPod(namespace, name string) Option {
	return func(a *Agent) {
		if namespace != "" && name != "" {
			a.owner = &ownDaemonSet{namespace: namespace, pod: name}
		}
	}
}

// WithTokenClient sets how the agent builds an API client that authenticates with a given
// token. At SIGTERM, when the API server refuses the agent's own token, the agent asks with the
// plugin's token whether detour's service accounts are being deleted (an uninstall) or only its
// pod (whose token ends with it); without this option it takes every refusal as an uninstall.
func WithTokenClient(newClient func(token string) (kubernetes.Interface, error)) Option {
	return func(a *Agent) { a.tokenClient = newClient }
}

// TokenClients is the constructor [WithTokenClient] wants for the API server rc reaches: each
// client authenticates with the token given and with nothing of rc's own credentials.
func TokenClients(rc *rest.Config) func(token string) (kubernetes.Interface, error) {
	return func(token string) (kubernetes.Interface, error) {
		c := rest.AnonymousClientConfig(rc)
		c.BearerToken = token
		return kubernetes.NewForConfig(c)
	}
}

// WithLogger sets the logger (default slog.Default()).
func WithLogger(l *slog.Logger) Option { return func(a *Agent) { a.log = l } }

// WithDebounce sets how long the agent waits after a file event for more before it reconciles
// (default 100ms).
func WithDebounce(d time.Duration) Option { return func(a *Agent) { a.debounce = d } }

// New returns an Agent for cfg.
func New(cfg Config, opts ...Option) *Agent {
	a := &Agent{
		cfg:      cfg,
		log:      slog.Default(),
		binary:   binaryInstaller{source: cfg.PluginSource, dest: filepath.Join(cfg.BinDir, PluginType)},
		debounce: 100 * time.Millisecond,
		now:      time.Now,
		fraction: DefaultTokenRefreshFraction,
		status:   Status{Reason: "starting"},
		metrics:  newMetrics(),

		beforeReplace: func() {},
	}
	for _, o := range opts {
		o(a)
	}
	if a.client != nil && cfg.NodeName != "" {
		a.node = &nodeReadiness{client: a.client, name: cfg.NodeName, taint: cfg.StartupTaint}
	}
	if a.fraction <= 0 || a.fraction >= 1 {
		a.fraction = DefaultTokenRefreshFraction
	}
	if cfg.PluginServiceAccount != "" {
		a.tokens = &pluginTokens{
			client: a.client, namespace: cfg.PluginServiceAccountNamespace, name: cfg.PluginServiceAccount,
			ttl: cfg.PluginTokenTTL, fraction: a.fraction, now: a.now, log: a.log,
			failures: a.metrics.tokenFailures,
		}
	}
	return a
}
