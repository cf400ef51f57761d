package nodeagent

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/cniplugin"
)

// Defaults of the agent's flags.
const (
	DefaultConfDir           = "/host/etc/cni/net.d"
	DefaultHostConfDir       = "/etc/cni/net.d"
	DefaultBinDir            = "/host/opt/cni/bin"
	DefaultKubeconfigName    = "detour-cni.kubeconfig"
	DefaultTokenName         = "detour-cni.token"
	DefaultServiceAccountDir = "/var/run/secrets/kubernetes.io/serviceaccount"
	DefaultResync            = 10 * time.Second
	DefaultAPITimeout        = cniplugin.DefaultAPITimeout
	// DefaultPluginTokenTTL is the lifetime requested for the plugin's token (TokenRequest
	// expirationSeconds); MinPluginTokenTTL is the API server's minimum and MaxPluginTokenTTL
	// the longest the agent asks for.
	DefaultPluginTokenTTL = time.Hour
	MinPluginTokenTTL     = 10 * time.Minute
	MaxPluginTokenTTL     = 24 * time.Hour
)

// Flags are the raw settings of `detour install-cni`; [Flags.Parse] validates them.
type Flags struct {
	// ConfDir is the CNI config directory as the agent sees it (the host's, mounted).
	ConfDir string
	// HostConfDir is the same directory as the host sees it: paths written into files the
	// plugin reads on the host start with it.
	HostConfDir string
	// BinDir is the CNI bin directory as the agent sees it.
	BinDir string
	// PluginSource is the detour-cni binary to install; empty means next to the running
	// executable.
	PluginSource      string
	KubeconfigName    string
	TokenName         string
	ServiceAccountDir string
	// APIServer is the URL the plugin reaches the API server at; empty means
	// https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT.
	APIServer string

	// PluginServiceAccount is the service account whose token the plugin uses, requested
	// through the TokenRequest API; empty means a copy of the agent's own token.
	PluginServiceAccount string
	// PluginServiceAccountNamespace is its namespace; empty means the agent's own (the
	// namespace file in ServiceAccountDir).
	PluginServiceAccountNamespace string
	// PluginTokenTTL is the lifetime requested for the plugin's token.
	PluginTokenTTL time.Duration

	// The plugin's settings, written into its conflist entry.
	APITimeout        time.Duration
	IPTablesBackend   string
	LogLevel          string
	LogFile           string
	ExcludeNamespaces []string
	// IPv6 is the plugin's ipv6 setting: "auto" (IPv6 rules when the pod has an IPv6 address)
	// or "always".
	IPv6 string

	// NodeName is the node the agent runs on; empty disables node readiness.
	NodeName     string
	StartupTaint string
	Resync       time.Duration

	// CNIConfigMode is how the plugin's configuration reaches the runtime: "auto", "drop-in"
	// or "chained-entry" (see [Mode]).
	CNIConfigMode string
}

// DefaultFlags returns the defaults, with NodeName from $NODE_NAME.
func DefaultFlags() Flags {
	return Flags{
		ConfDir:           DefaultConfDir,
		HostConfDir:       DefaultHostConfDir,
		BinDir:            DefaultBinDir,
		KubeconfigName:    DefaultKubeconfigName,
		TokenName:         DefaultTokenName,
		ServiceAccountDir: DefaultServiceAccountDir,
		PluginTokenTTL:    DefaultPluginTokenTTL,
		APITimeout:        DefaultAPITimeout,
		IPTablesBackend:   "auto",
		LogLevel:          "info",
		ExcludeNamespaces: slices.Clone(cniplugin.DefaultExcludeNamespaces),
		IPv6:              cniplugin.IPv6Auto,
		NodeName:          os.Getenv("NODE_NAME"),
		StartupTaint:      annotations.CNINotReadyTaint,
		Resync:            DefaultResync,
		CNIConfigMode:     string(ModeAuto),
	}
}

// Config is the agent's validated configuration; only [Flags.Parse] makes one.
type Config struct {
	ConfDir, HostConfDir, BinDir string
	PluginSource                 string
	ServiceAccountDir            string
	APIServer                    string
	// KubeconfigPath and TokenPath are where the agent writes the plugin's kubeconfig and
	// token copy; HostKubeconfigPath and HostTokenPath are the same files as the host sees them.
	KubeconfigPath, HostKubeconfigPath string
	TokenPath, HostTokenPath           string
	// PluginServiceAccount and PluginServiceAccountNamespace name the service account whose
	// token the agent requests for the plugin (TokenRequest API, PluginTokenTTL); an empty name
	// means the plugin gets a copy of the agent's own token.
	PluginServiceAccount, PluginServiceAccountNamespace string
	PluginTokenTTL                                      time.Duration
	// Entry is detour's plugin configuration, the JSON object appended to the conflist.
	Entry        []byte
	NodeName     string
	StartupTaint string
	Resync       time.Duration
	// Mode is the --cni-config-mode setting; the agent decides ModeAuto on the node.
	Mode Mode
}

// PodAnnotationsCapability is the capability through which the runtime passes a pod's
// annotations to the plugin.
const PodAnnotationsCapability = cniplugin.PodAnnotationsCapability

// Parse validates the flags and returns the Config. Errors name the flag, the value and what
// a valid one looks like.
func (f Flags) Parse() (Config, error) {
	c := Config{
		ConfDir:           filepath.Clean(f.ConfDir),
		HostConfDir:       filepath.Clean(f.HostConfDir),
		BinDir:            filepath.Clean(f.BinDir),
		ServiceAccountDir: filepath.Clean(f.ServiceAccountDir),
		NodeName:          f.NodeName,
		StartupTaint:      f.StartupTaint,
		Resync:            f.Resync,
	}
	for _, d := range []struct{ flag, value string }{
		{"--cni-conf-dir", f.ConfDir}, {"--host-cni-conf-dir", f.HostConfDir}, {"--cni-bin-dir", f.BinDir},
		{"--service-account-dir", f.ServiceAccountDir},
	} {
		if !filepath.IsAbs(d.value) {
			return c, flagError(d.flag, d.value, "must be an absolute directory path")
		}
	}
	for _, n := range []struct{ flag, value string }{{"--kubeconfig-name", f.KubeconfigName}, {"--token-name", f.TokenName}} {
		if n.value == "" || n.value != filepath.Base(n.value) || strings.HasPrefix(n.value, ".") || isConfigFile(n.value) {
			return c, flagError(n.flag, n.value, "must be a plain file name, not hidden and without a .conf, .conflist or .json extension (the runtime would load it as a network)")
		}
	}
	for _, n := range []struct{ flag, value string }{{"--kubeconfig-name", f.KubeconfigName}, {"--token-name", f.TokenName}} {
		if n.value == ModeFileName {
			return c, flagError(n.flag, n.value, "must differ from "+ModeFileName+", where the agent records its mode")
		}
	}
	if f.KubeconfigName == f.TokenName {
		return c, flagError("--token-name", f.TokenName, "must differ from --kubeconfig-name")
	}
	c.KubeconfigPath, c.HostKubeconfigPath = filepath.Join(c.ConfDir, f.KubeconfigName), filepath.Join(c.HostConfDir, f.KubeconfigName)
	c.TokenPath, c.HostTokenPath = filepath.Join(c.ConfDir, f.TokenName), filepath.Join(c.HostConfDir, f.TokenName)

	c.PluginSource = f.PluginSource
	if c.PluginSource == "" {
		exe, err := os.Executable()
		if err != nil {
			return c, fmt.Errorf("find the running executable to locate %s next to it: %w; set --plugin-source", PluginType, err)
		}
		c.PluginSource = filepath.Join(filepath.Dir(exe), PluginType)
	}
	if !filepath.IsAbs(c.PluginSource) {
		return c, flagError("--plugin-source", c.PluginSource, "must be an absolute path to the detour-cni binary, such as /opt/detour/bin/detour-cni")
	}

	var err error
	if c.APIServer, err = apiServer(f.APIServer); err != nil {
		return c, err
	}
	if err := c.parsePluginServiceAccount(f); err != nil {
		return c, err
	}

	if c.Entry, err = f.entry(c.HostKubeconfigPath); err != nil {
		return c, err
	}

	if f.NodeName != "" {
		if errs := validation.IsDNS1123Subdomain(f.NodeName); len(errs) > 0 {
			return c, flagError("--node-name", f.NodeName, "must be a node name: "+strings.Join(errs, "; "))
		}
	}
	if errs := validation.IsQualifiedName(f.StartupTaint); len(errs) > 0 {
		return c, flagError("--startup-taint", f.StartupTaint, "must be a taint key such as "+annotations.CNINotReadyTaint+": "+strings.Join(errs, "; "))
	}
	if c.Mode, err = ParseMode(f.CNIConfigMode); err != nil {
		return c, err
	}
	if f.Resync < time.Second || f.Resync > time.Hour {
		return c, flagError("--resync-interval", f.Resync.String(), "must be from 1s to 1h0m0s, such as 10s")
	}
	return c, nil
}

// entryFlags are the flags that set each key of the plugin's entry, for errors.
var entryFlags = map[string]string{
	"apiTimeout": "--api-timeout", "iptablesBackend": "--iptables-backend", "logLevel": "--plugin-log-level",
	"logFile": "--plugin-log-file", "excludeNamespaces": "--exclude-namespaces", "ipv6": "--ipv6",
}

// entry is detour's conflist entry for the plugin's flags, checked by the plugin's own parser
// (cniplugin.Entry.Marshal). Its errors name the flag.
func (f Flags) entry(kubeconfig string) ([]byte, error) {
	exclude := append([]string{}, f.ExcludeNamespaces...) // [], not absent: none, not the default
	ipv6 := f.IPv6
	if ipv6 == cniplugin.IPv6Auto {
		ipv6 = "" // the plugin's default: the key is written only for "always"
	}
	b, err := cniplugin.Entry{
		Type:              PluginType,
		Name:              PluginType,
		Kubeconfig:        kubeconfig,
		APITimeout:        f.APITimeout.String(),
		IPTablesBackend:   f.IPTablesBackend,
		LogLevel:          f.LogLevel,
		LogFile:           f.LogFile,
		ExcludeNamespaces: &exclude,
		IPv6:              ipv6,
		Capabilities:      map[string]bool{PodAnnotationsCapability: true},
	}.Marshal()
	if ce, ok := errors.AsType[*cniplugin.ConfigError](err); ok && entryFlags[ce.Key] != "" {
		return nil, flagError(entryFlags[ce.Key], ce.Value, ce.Rule)
	}
	return b, err
}

// parsePluginServiceAccount sets the plugin's service account, its namespace (read from the
// agent's service-account directory unless given) and the token lifetime.
func (c *Config) parsePluginServiceAccount(f Flags) error {
	if f.PluginServiceAccount == "" {
		if f.PluginServiceAccountNamespace != "" {
			return flagError("--plugin-service-account-namespace", f.PluginServiceAccountNamespace, "only applies with --plugin-service-account")
		}
		return nil
	}
	if errs := validation.IsDNS1123Subdomain(f.PluginServiceAccount); len(errs) > 0 {
		return flagError("--plugin-service-account", f.PluginServiceAccount, "must be a service account name such as detour-cni: "+strings.Join(errs, "; "))
	}
	ns := f.PluginServiceAccountNamespace
	if ns == "" {
		path := filepath.Join(c.ServiceAccountDir, "namespace")
		b, err := os.ReadFile(path)
		if err == nil && len(bytes.TrimSpace(b)) == 0 {
			err = errors.New("it is empty")
		}
		if err != nil {
			return fmt.Errorf("read the agent's namespace %s for --plugin-service-account: %w (mount the service account token, or set --plugin-service-account-namespace)", path, err)
		}
		ns = string(bytes.TrimSpace(b))
	}
	if errs := validation.IsDNS1123Label(ns); len(errs) > 0 {
		return flagError("--plugin-service-account-namespace", ns, "must be a namespace name: "+strings.Join(errs, "; "))
	}
	if f.PluginTokenTTL < MinPluginTokenTTL || f.PluginTokenTTL > MaxPluginTokenTTL {
		return flagError("--plugin-token-ttl", f.PluginTokenTTL.String(), "must be from 10m0s (the API server's minimum) to 24h0m0s, such as 1h")
	}
	c.PluginServiceAccount, c.PluginServiceAccountNamespace = f.PluginServiceAccount, ns
	c.PluginTokenTTL = f.PluginTokenTTL.Truncate(time.Second)
	return nil
}

// apiServer returns the API server URL the plugin uses: the flag's, or the in-cluster one.
func apiServer(flag string) (string, error) {
	if flag == "" {
		host, port := os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT")
		if host == "" || port == "" {
			return "", fmt.Errorf("the API server address is unknown: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set (the agent runs outside a pod?); set --api-server")
		}
		return "https://" + net.JoinHostPort(host, port), nil
	}
	u, err := url.Parse(flag)
	if err != nil || u.Scheme != "https" || u.Host == "" || (u.Path != "" && u.Path != "/") {
		return "", flagError("--api-server", flag, "must be an https URL such as https://10.96.0.1:443")
	}
	return strings.TrimSuffix(flag, "/"), nil
}

func flagError(flag, value, rule string) error {
	return fmt.Errorf("invalid %s %q: it %s", flag, value, rule)
}
