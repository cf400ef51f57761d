package cniplugin

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/detourmesh/detour/iptables"
)

// PluginType is the "type" of detour's entry in a conflist, and the binary's name.
const PluginType = "detour-cni"

// PodAnnotationsCapability is the capability through which containerd and CRI-O pass a pod's
// annotations in runtimeConfig, saving the plugin an API call.
const PodAnnotationsCapability = "io.kubernetes.cri.pod-annotations"

// Defaults of the plugin configuration.
const (
	DefaultAPITimeout = 5 * time.Second
	minAPITimeout     = 100 * time.Millisecond
	maxAPITimeout     = 2 * time.Minute
)

// DefaultExcludeNamespaces are left alone unless the configuration says otherwise.
var DefaultExcludeNamespaces = []string{"kube-system"}

// IPv6 modes: "auto" installs IPv6 rules when the pod has an IPv6 address in prevResult;
// "always" installs them for every injected pod.
const (
	IPv6Auto   = "auto"
	IPv6Always = "always"
)

// Config is detour's entry in the conflist, parsed, defaulted and validated by ParseConfig;
// nothing else re-checks its fields.
type Config struct {
	types.PluginConf

	// Kubeconfig is the path of the kubeconfig used to GET pods when the runtime does not pass
	// their annotations; empty disables the API path.
	Kubeconfig        string
	APITimeout        time.Duration
	IPTablesBackend   iptables.Backend
	LogLevel          slog.Level
	LogFile           string
	ExcludeNamespaces []string
	IPv6              string

	// PodAnnotations are the pod's annotations from runtimeConfig; nil when the runtime did
	// not pass them.
	PodAnnotations map[string]string
}

// Entry is detour's entry in a conflist, in its JSON form: the keys [ParseConfig] reads. The
// node agent writes it with [Entry.Marshal], so the writer and the reader share one schema and
// one validation. Unset keys take the plugin's defaults.
type Entry struct {
	Type            string `json:"type"`
	Name            string `json:"name"`
	Kubeconfig      string `json:"kubeconfig"`
	APITimeout      string `json:"apiTimeout"`
	IPTablesBackend string `json:"iptablesBackend"`
	LogLevel        string `json:"logLevel"`
	LogFile         string `json:"logFile,omitempty"`
	// ExcludeNamespaces: nil (absent) means [DefaultExcludeNamespaces], an empty list none.
	ExcludeNamespaces *[]string `json:"excludeNamespaces"`
	// IPv6 is written only when it is not the default, [IPv6Auto].
	IPv6         string          `json:"ipv6,omitempty"`
	Capabilities map[string]bool `json:"capabilities,omitempty"`
}

// Marshal returns the entry as JSON, after checking that [ParseConfig] accepts it: an entry the
// plugin would refuse is never written. The error is a [*ConfigError].
func (e Entry) Marshal() ([]byte, error) {
	b, err := json.Marshal(e)
	if err != nil {
		return nil, fmt.Errorf("encode the %s entry: %w", PluginType, err)
	}
	if _, err := ParseConfig(b); err != nil {
		return nil, err
	}
	return b, nil
}

// rawConfig is the JSON form of the plugin's stdin: its entry and what the runtime adds.
// Unknown keys are ignored (runtimes add their own).
type rawConfig struct {
	Entry
	RuntimeConfig struct {
		PodAnnotations map[string]string `json:"io.kubernetes.cri.pod-annotations"`
	} `json:"runtimeConfig"`
}

// ParseConfig parses the plugin's stdin configuration. Errors name the key, the value and
// what a valid one looks like.
func ParseConfig(stdin []byte) (*Config, error) {
	c := &Config{}
	if err := json.Unmarshal(stdin, &c.PluginConf); err != nil {
		return nil, fmt.Errorf("parse the %s network configuration: %w", PluginType, err)
	}
	var raw rawConfig
	if err := json.Unmarshal(stdin, &raw); err != nil {
		return nil, fmt.Errorf("parse the %s network configuration: %w", PluginType, err)
	}

	c.Kubeconfig = raw.Kubeconfig
	if c.Kubeconfig != "" && !filepath.IsAbs(c.Kubeconfig) {
		return nil, configError("kubeconfig", c.Kubeconfig, "must be an absolute path such as /etc/cni/net.d/detour-cni.kubeconfig")
	}
	c.APITimeout = DefaultAPITimeout
	if raw.APITimeout != "" {
		d, err := time.ParseDuration(raw.APITimeout)
		if err != nil || d < minAPITimeout || d > maxAPITimeout {
			return nil, configError("apiTimeout", raw.APITimeout, fmt.Sprintf("must be a Go duration from %s to %s, such as \"5s\"", minAPITimeout, maxAPITimeout))
		}
		c.APITimeout = d
	}
	backend, err := iptables.ParseBackend(raw.IPTablesBackend)
	if err != nil {
		return nil, configError("iptablesBackend", raw.IPTablesBackend, `must be "auto", "legacy", "nft" or "nftables"`)
	}
	c.IPTablesBackend = backend
	if raw.LogLevel != "" {
		if err := c.LogLevel.UnmarshalText([]byte(raw.LogLevel)); err != nil {
			return nil, configError("logLevel", raw.LogLevel, `must be "debug", "info", "warn" or "error"`)
		}
	}
	c.LogFile = raw.LogFile
	if c.LogFile != "" && !filepath.IsAbs(c.LogFile) {
		return nil, configError("logFile", c.LogFile, "must be an absolute path")
	}
	c.ExcludeNamespaces = DefaultExcludeNamespaces
	if raw.ExcludeNamespaces != nil {
		c.ExcludeNamespaces = *raw.ExcludeNamespaces
		for _, ns := range c.ExcludeNamespaces {
			if !isNamespaceName(ns) {
				return nil, configError("excludeNamespaces", ns, "each entry must be a namespace name (a DNS label)")
			}
		}
	}
	switch raw.IPv6 {
	case "":
		c.IPv6 = IPv6Auto
	case IPv6Auto, IPv6Always:
		c.IPv6 = raw.IPv6
	default:
		return nil, configError("ipv6", raw.IPv6, `must be "auto" (IPv6 rules when the pod has an IPv6 address) or "always"`)
	}
	c.PodAnnotations = raw.RuntimeConfig.PodAnnotations
	return c, nil
}

// parsePrevResult parses prevResult, which ADD and CHECK require: detour-cni is chained only.
func (c *Config) parsePrevResult(cmd string) error {
	if c.RawPrevResult == nil {
		return fmt.Errorf("%s: no prevResult: %s is a chained plugin and must come after the primary CNI plugin (for example bridge, calico or cilium) in the same conflist", cmd, PluginType)
	}
	if err := version.ParsePrevResult(&c.PluginConf); err != nil {
		return fmt.Errorf("%s: parse prevResult: %w", cmd, err)
	}
	return nil
}

// ConfigError is an invalid key of detour's entry.
type ConfigError struct {
	// Key is the entry's key, Value the value found, and Rule what a valid one looks like.
	Key, Value, Rule string
}

func (e *ConfigError) Error() string {
	return fmt.Sprintf("%s network configuration: %s %q is not valid: it %s", PluginType, e.Key, e.Value, e.Rule)
}

func configError(key, value, rule string) error {
	return &ConfigError{Key: key, Value: value, Rule: rule}
}

func isNamespaceName(s string) bool {
	if s == "" || len(s) > 63 || strings.HasPrefix(s, "-") || strings.HasSuffix(s, "-") {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
			return false
		}
	}
	return true
}
