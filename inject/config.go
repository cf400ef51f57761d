package inject

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/yaml"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/internal/version"
	"github.com/detourmesh/detour/validator"
)

// DefaultConfigPath is where `detour webhook` reads its configuration (a mounted ConfigMap).
const DefaultConfigPath = "/etc/detour/webhook/config.yaml"

// Defaults of the configuration; docs/webhook.md lists them with every field.
const (
	DefaultProxyUID          = 2102
	DefaultProxyInboundPort  = 4143
	DefaultProxyOutboundPort = 4140
	DefaultProxyAdminPort    = 4191
	DefaultValidatorUID      = 2103
	DefaultValidatorTimeout  = 5 * time.Second
	// DefaultValidatorCheckPort is where the check at the proxy's start listens: the plugin
	// redirects the proxy UID's connections to a sentinel there (detour.dev/validator-check-port).
	DefaultValidatorCheckPort = 4142
	DefaultGIDFirst           = 2600
	DefaultGIDLast            = 2699
	// DefaultValidatorImageRepository is the detour image; the validator is `detour validate`.
	DefaultValidatorImageRepository = "ghcr.io/detourmesh/detour"
	// maxGIDRange bounds the reserved range so a typo cannot reserve most of the GID space.
	maxGIDRange = 65536
)

// ConflictPolicy says what happens to a pod whose init container cannot be given egress.
type ConflictPolicy string

const (
	// ConflictWarn admits the pod with a warning (the init container's connections are
	// redirected to a proxy that is not running yet).
	ConflictWarn ConflictPolicy = "warn"
	// ConflictDeny denies the pod with a message that says how to fix it.
	ConflictDeny ConflictPolicy = "deny"
)

// SidecarMode is where the proxy goes: a regular container, a native sidecar (an init
// container with restartPolicy Always), or native when the cluster supports it.
type SidecarMode string

const (
	SidecarAuto      SidecarMode = "auto"
	SidecarContainer SidecarMode = "container"
	SidecarNative    SidecarMode = "native"
)

// Config is the webhook's configuration, defaulted and validated by [ParseConfig]: every field
// holds a usable value, so callers never check them again.
type Config struct {
	Proxy     Proxy
	Validator Validator
	// InitEgress is the default init-container selection when neither the pod nor its
	// namespace sets detour.dev/init-egress.
	InitEgress annotations.InitEgressSelection
	// GIDRange is the reserved range of dedicated GIDs for init containers whose UID cannot
	// be exempted; it holds neither the proxy's nor the validator's GID.
	GIDRange       GIDRange
	ConflictPolicy ConflictPolicy
	SidecarMode    SidecarMode
	// ExcludeNamespaces are never injected, whatever their annotations say.
	ExcludeNamespaces []string
	// DefaultInject is what a pod whose detour.dev/inject is set neither on it nor on its
	// namespace gets: disabled (opt-in per namespace or pod), or enabled (the whole mesh, with
	// opt-out per namespace or pod).
	DefaultInject annotations.InjectMode
	// InboundCapture is which inbound connections go to the proxy when neither the pod nor its
	// namespace sets detour.dev/inbound-capture: only where the app listens, or all.
	InboundCapture annotations.InboundCaptureValue
}

// DefaultExcludeNamespaces are the namespaces never injected when the configuration sets no
// excludeNamespaces.
var DefaultExcludeNamespaces = []string{"kube-system", "kube-public", "kube-node-lease"}

// Proxy is the template of the injected proxy container.
type Proxy struct {
	Image           string
	ImagePullPolicy corev1.PullPolicy
	UID, GID        uint32
	InboundPort     uint16
	OutboundPort    uint16
	// AdminPorts are the proxy's own listeners (metrics, health); inbound connections to them
	// are never redirected.
	AdminPorts     []uint16
	Command, Args  []string
	Env            []corev1.EnvVar
	Resources      corev1.ResourceRequirements
	ReadinessProbe *corev1.Probe
	LivenessProbe  *corev1.Probe
	StartupProbe   *corev1.Probe
	// SeccompProfile is the proxy container's own seccomp profile (RuntimeDefault unless the
	// configuration says otherwise), so that it passes the restricted Pod Security Standard
	// whatever the pod sets.
	SeccompProfile corev1.SeccompProfile
	// Volumes are added to every injected pod and VolumeMounts mount them in the proxy: its
	// configuration, identity token, state directory ([File.completeProxyVolumes]).
	Volumes      []corev1.Volume
	VolumeMounts []corev1.VolumeMount
	// Lifecycle is the proxy's own hooks; a postStart hook leaves the start gate to the
	// startup probe (detour's gate is a postStart hook).
	Lifecycle *corev1.Lifecycle
	// StartGate is what holds a pod's next containers until the proxy (a native sidecar whose
	// check runs at its start) has started: its startup probe, or a postStart hook of detour's
	// binary that asks the same; auto decides per pod ([Config.startGate]).
	StartGate annotations.StartGateValue
}

// Validator is the template of the injected validator init container.
type Validator struct {
	// Mode is where the check runs: in an init container, in the proxy's start (image-volume),
	// or auto: see [ResolveValidatorMode].
	Mode            annotations.ValidatorModeValue
	Image           string
	ImagePullPolicy corev1.PullPolicy
	UID, GID        uint32
	Timeout         time.Duration
	// Sentinel and Sentinel6 are the addresses (IPv4 and IPv6 literal with a port) the validator
	// dials; empty leaves the validator's default.
	Sentinel, Sentinel6 string
	// CheckPort is where the check at the proxy's start listens, on loopback: the plugin
	// redirects the proxy UID's connections to the sentinels there, and nothing listens there
	// outside a check. No container of an injected pod may listen on it.
	CheckPort uint16
	// Probes are the destinations the validator dials, defaults included: the webhook writes them
	// into detour.dev/validator-sentinels so that the plugin redirects them whatever the pod's
	// skip lists say.
	Probes    []netip.AddrPort
	Resources corev1.ResourceRequirements
	// SeccompProfile is the validator container's own seccomp profile, as the proxy's.
	SeccompProfile corev1.SeccompProfile
}

// GIDRange is an inclusive range of GIDs.
type GIDRange struct{ First, Last uint32 }

// Contains reports whether gid is in r.
func (r GIDRange) Contains(gid uint32) bool { return gid >= r.First && gid <= r.Last }

func (r GIDRange) String() string { return fmt.Sprintf("%d-%d", r.First, r.Last) }

// ParseGIDRange parses "first-last" (the form of the --gid-range flag).
func ParseGIDRange(s string) (GIDRangeFile, error) {
	a, b, ok := strings.Cut(strings.TrimSpace(s), "-")
	first, err1 := strconv.ParseInt(strings.TrimSpace(a), 10, 64)
	last, err2 := strconv.ParseInt(strings.TrimSpace(b), 10, 64)
	if !ok || err1 != nil || err2 != nil {
		return GIDRangeFile{}, fmt.Errorf("gid range %q: write it as first-last, e.g. %d-%d", s, DefaultGIDFirst, DefaultGIDLast)
	}
	return GIDRangeFile{First: &first, Last: &last}, nil
}

// File is the configuration file as written (YAML or JSON); unset fields take their defaults.
// docs/webhook.md documents every field.
type File struct {
	Proxy     ProxyFile     `json:"proxy"`
	Validator ValidatorFile `json:"validator"`
	// InitEgress: "*", "none" or a comma-separated list of init container names.
	InitEgress string `json:"initEgress,omitempty"`
	// GIDRange is the reserved range of dedicated GIDs.
	GIDRange GIDRangeFile `json:"gidRange"`
	// ConflictPolicy: "warn" or "deny".
	ConflictPolicy string `json:"conflictPolicy,omitempty"`
	// SidecarMode: "auto", "container" or "native".
	SidecarMode string `json:"sidecarMode,omitempty"`
	// ExcludeNamespaces; unset means kube-system, kube-public and kube-node-lease, an empty
	// list means none.
	ExcludeNamespaces *[]string `json:"excludeNamespaces,omitempty"`
	// DefaultInject: "disabled" (the default) or "enabled".
	DefaultInject string `json:"defaultInject,omitempty"`
	// InboundCapture: "listening" (the default) or "all".
	InboundCapture string `json:"inboundCapture,omitempty"`
}

// ProxyFile is the proxy section of [File].
type ProxyFile struct {
	Image           string                       `json:"image,omitempty"`
	ImagePullPolicy corev1.PullPolicy            `json:"imagePullPolicy,omitempty"`
	UID             *int64                       `json:"uid,omitempty"`
	GID             *int64                       `json:"gid,omitempty"`
	InboundPort     *int64                       `json:"inboundPort,omitempty"`
	OutboundPort    *int64                       `json:"outboundPort,omitempty"`
	AdminPorts      *[]int64                     `json:"adminPorts,omitempty"`
	Command         []string                     `json:"command,omitempty"`
	Args            []string                     `json:"args,omitempty"`
	Env             []corev1.EnvVar              `json:"env,omitempty"`
	Resources       *corev1.ResourceRequirements `json:"resources,omitempty"`
	ReadinessProbe  *corev1.Probe                `json:"readinessProbe,omitempty"`
	LivenessProbe   *corev1.Probe                `json:"livenessProbe,omitempty"`
	StartupProbe    *corev1.Probe                `json:"startupProbe,omitempty"`
	// SeccompProfile: unset means {type: RuntimeDefault}.
	SeccompProfile *corev1.SeccompProfile `json:"seccompProfile,omitempty"`
	// StartGate: "auto" (the default), "probe" or "hook".
	StartGate string `json:"startGate,omitempty"`
	// Volumes: configMap, downwardAPI, emptyDir, projected or secret volumes added to every
	// injected pod; VolumeMounts mount them in the proxy.
	Volumes      []corev1.Volume      `json:"volumes,omitempty"`
	VolumeMounts []corev1.VolumeMount `json:"volumeMounts,omitempty"`
	// Lifecycle: the proxy's own postStart and preStop hooks.
	Lifecycle *corev1.Lifecycle `json:"lifecycle,omitempty"`
}

// ValidatorFile is the validator section of [File].
type ValidatorFile struct {
	Image           string                       `json:"image,omitempty"`
	ImagePullPolicy corev1.PullPolicy            `json:"imagePullPolicy,omitempty"`
	UID             *int64                       `json:"uid,omitempty"`
	GID             *int64                       `json:"gid,omitempty"`
	Timeout         *metav1.Duration             `json:"timeout,omitempty"`
	Sentinel        string                       `json:"sentinel,omitempty"`
	Sentinel6       string                       `json:"sentinel6,omitempty"`
	CheckPort       *int64                       `json:"checkPort,omitempty"`
	Resources       *corev1.ResourceRequirements `json:"resources,omitempty"`
	// Mode: "auto", "init-container" or "image-volume".
	Mode string `json:"mode,omitempty"`
	// SeccompProfile: unset means {type: RuntimeDefault}.
	SeccompProfile *corev1.SeccompProfile `json:"seccompProfile,omitempty"`
}

// GIDRangeFile is the gidRange section of [File].
type GIDRangeFile struct {
	First *int64 `json:"first,omitempty"`
	Last  *int64 `json:"last,omitempty"`
}

// LoadConfig reads and parses the configuration file at path; see [ParseConfig].
func LoadConfig(path string, overrides ...func(*File)) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read webhook config: %w", err)
	}
	cfg, err := ParseConfig(data, overrides...)
	if err != nil {
		return nil, fmt.Errorf("webhook config %s: %w", path, err)
	}
	return cfg, nil
}

// ParseConfig is the one configuration parser: it decodes data (YAML or JSON; empty means
// all defaults) strictly, applies overrides (command-line flags) in order, fills in the
// defaults and validates the result. Errors name the field, the bad value and what to write.
func ParseConfig(data []byte, overrides ...func(*File)) (*Config, error) {
	var f File
	if len(bytes.TrimSpace(data)) > 0 {
		if err := yaml.UnmarshalStrict(data, &f); err != nil {
			return nil, fmt.Errorf("decode: %w (see docs/webhook.md for the fields)", err)
		}
	}
	for _, o := range overrides {
		o(&f)
	}
	return f.complete()
}

// fieldError is an invalid configuration field.
type fieldError struct {
	field, value, rule string
}

func (e *fieldError) Error() string {
	if e.value == "" {
		return fmt.Sprintf("%s: %s", e.field, e.rule)
	}
	return fmt.Sprintf("%s: %s is not valid: %s", e.field, e.value, e.rule)
}

func invalid(field string, value any, rule string, args ...any) error {
	v := ""
	if value != nil {
		v = fmt.Sprint(value)
	}
	return &fieldError{field: field, value: v, rule: fmt.Sprintf(rule, args...)}
}

// id resolves a UID or GID field: def when unset, else 1..2^32-2.
func id(field string, p *int64, def uint32) (uint32, error) {
	if p == nil {
		return def, nil
	}
	if *p <= 0 || *p >= math.MaxUint32 {
		return 0, invalid(field, *p, "use a non-root ID from 1 to 4294967294 (0, root, would bypass the redirect)")
	}
	return uint32(*p), nil
}

func portValue(field string, p int64) (uint16, error) {
	if p < 1 || p > 65535 {
		return 0, invalid(field, p, "a port is a whole number from 1 to 65535")
	}
	return uint16(p), nil
}

func portField(field string, p *int64, def uint16) (uint16, error) {
	if p == nil {
		return def, nil
	}
	return portValue(field, *p)
}

func pullPolicy(field string, p corev1.PullPolicy) (corev1.PullPolicy, error) {
	switch p {
	case "":
		return corev1.PullIfNotPresent, nil
	case corev1.PullAlways, corev1.PullIfNotPresent, corev1.PullNever:
		return p, nil
	}
	return "", invalid(field, p, "use Always, IfNotPresent or Never")
}

func (f *File) complete() (*Config, error) {
	var errs []error
	check := func(err error) {
		if err != nil {
			errs = append(errs, err)
		}
	}
	c := &Config{}
	f.completeProxy(c, check)
	f.completeProxyVolumes(c, check)
	f.completeValidator(c, check)
	f.completeStartGate(c, check)
	f.completeInitEgress(c, check)
	f.completeGIDRange(c, check)
	f.completePolicies(c, check)
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return c, nil
}

// completeProxy fills in c.Proxy from the proxy section; check collects the errors.
func (f *File) completeProxy(c *Config, check func(error)) {
	var err error
	p := f.Proxy
	c.Proxy.Image = strings.TrimSpace(p.Image)
	if c.Proxy.Image == "" {
		check(invalid("proxy.image", nil, "is required: set the image of your mesh's proxy"))
	}
	c.Proxy.ImagePullPolicy, err = pullPolicy("proxy.imagePullPolicy", p.ImagePullPolicy)
	check(err)
	c.Proxy.UID, err = id("proxy.uid", p.UID, DefaultProxyUID)
	check(err)
	c.Proxy.GID, err = id("proxy.gid", p.GID, c.Proxy.UID)
	check(err)
	c.Proxy.InboundPort, err = portField("proxy.inboundPort", p.InboundPort, DefaultProxyInboundPort)
	check(err)
	c.Proxy.OutboundPort, err = portField("proxy.outboundPort", p.OutboundPort, DefaultProxyOutboundPort)
	check(err)
	if c.Proxy.InboundPort != 0 && c.Proxy.InboundPort == c.Proxy.OutboundPort {
		check(invalid("proxy.outboundPort", c.Proxy.OutboundPort, "the inbound and outbound ports must differ"))
	}
	admin := []int64{DefaultProxyAdminPort}
	if p.AdminPorts != nil {
		admin = *p.AdminPorts
	}
	for i, a := range admin {
		field := fmt.Sprintf("proxy.adminPorts[%d]", i)
		port, err := portValue(field, a)
		switch {
		case err != nil:
			check(err)
		case port == c.Proxy.InboundPort || port == c.Proxy.OutboundPort:
			check(invalid(field, a, "an admin port must differ from the inbound and outbound ports"))
		case slices.Contains(c.Proxy.AdminPorts, port):
			check(invalid(field, a, "the port is listed twice"))
		default:
			c.Proxy.AdminPorts = append(c.Proxy.AdminPorts, port)
		}
	}
	if len(c.Proxy.AdminPorts) > annotations.MaxListItems/2 {
		check(invalid("proxy.adminPorts", len(c.Proxy.AdminPorts), "list at most %d ports", annotations.MaxListItems/2))
	}
	c.Proxy.Command, c.Proxy.Args = slices.Clone(p.Command), slices.Clone(p.Args)
	for i, e := range p.Env {
		if e.Name == "" {
			check(invalid(fmt.Sprintf("proxy.env[%d].name", i), nil, "is required"))
		}
	}
	c.Proxy.Env = slices.Clone(p.Env)
	c.Proxy.Resources = resources(p.Resources, defaultProxyResources())
	check(checkResources("proxy.resources", c.Proxy.Resources))
	for _, pr := range []struct {
		field string
		from  *corev1.Probe
		to    **corev1.Probe
	}{
		{"proxy.readinessProbe", p.ReadinessProbe, &c.Proxy.ReadinessProbe},
		{"proxy.livenessProbe", p.LivenessProbe, &c.Proxy.LivenessProbe},
		{"proxy.startupProbe", p.StartupProbe, &c.Proxy.StartupProbe},
	} {
		check(checkProbeHost(pr.field, pr.from))
		*pr.to = probe(pr.from)
	}
	c.Proxy.SeccompProfile, err = seccompProfile("proxy.seccompProfile", p.SeccompProfile)
	check(err)
}

// completeValidator fills in c.Validator from the validator section (after the proxy, whose
// UID the validator must not share).
func (f *File) completeValidator(c *Config, check func(error)) {
	var err error
	v := f.Validator
	c.Validator.Image = strings.TrimSpace(v.Image)
	if c.Validator.Image == "" {
		c.Validator.Image = DefaultValidatorImageRepository + ":" + version.Version
	}
	c.Validator.ImagePullPolicy, err = pullPolicy("validator.imagePullPolicy", v.ImagePullPolicy)
	check(err)
	c.Validator.UID, err = id("validator.uid", v.UID, DefaultValidatorUID)
	check(err)
	c.Validator.GID, err = id("validator.gid", v.GID, c.Validator.UID)
	check(err)
	if c.Validator.UID != 0 && c.Validator.UID == c.Proxy.UID {
		check(invalid("validator.uid", c.Validator.UID, "the validator must not run as the proxy's UID (the proxy's traffic is never redirected, so the validator could not see the redirect)"))
	}
	c.Validator.Timeout = DefaultValidatorTimeout
	if v.Timeout != nil {
		c.Validator.Timeout = v.Timeout.Duration
		if c.Validator.Timeout <= 0 {
			check(invalid("validator.timeout", v.Timeout.Duration, "use a positive duration such as 5s"))
		}
	}
	for _, s := range []struct {
		field, value string
		six          bool
		to           *string
	}{
		{"validator.sentinel", v.Sentinel, false, &c.Validator.Sentinel},
		{"validator.sentinel6", v.Sentinel6, true, &c.Validator.Sentinel6},
	} {
		value := s.value
		if value == "" {
			value = validator.DefaultSentinel
			if s.six {
				value = validator.DefaultSentinel6
			}
		}
		ap, rule := validator.ParseSentinel(value, s.six)
		if rule != "" {
			check(invalid(s.field, strconv.Quote(s.value), "it %s", rule))
			continue
		}
		c.Validator.Probes = append(c.Validator.Probes, ap)
		*s.to = s.value
	}
	c.Validator.CheckPort, err = portField("validator.checkPort", v.CheckPort, DefaultValidatorCheckPort)
	check(err)
	if p := c.Validator.CheckPort; p != 0 && (p == c.Proxy.InboundPort || p == c.Proxy.OutboundPort || slices.Contains(c.Proxy.AdminPorts, p)) {
		check(invalid("validator.checkPort", p, "the check's port must differ from the proxy's inbound, outbound and admin ports (the plugin sends the proxy's own connections to a sentinel there, so a proxy listening there would reach itself again)"))
	}
	c.Validator.Resources = resources(v.Resources, defaultValidatorResources())
	check(checkResources("validator.resources", c.Validator.Resources))
	c.Validator.SeccompProfile, err = seccompProfile("validator.seccompProfile", v.SeccompProfile)
	check(err)
	switch m := annotations.ValidatorModeValue(v.Mode); m {
	case "":
		c.Validator.Mode = annotations.ValidatorAuto
	case annotations.ValidatorAuto, annotations.ValidatorInitContainer:
		c.Validator.Mode = m
	case annotations.ValidatorImageVolume:
		c.Validator.Mode = m
		if why := c.foldBlocker(); why != "" {
			check(invalid("validator.mode", strconv.Quote(v.Mode), "%s, or use \"auto\" or \"init-container\"", why))
		}
	default:
		check(invalid("validator.mode", strconv.Quote(v.Mode), "use \"auto\", \"init-container\" or \"image-volume\""))
	}
}

// completeStartGate fills in the proxy's start gate (after the validator: the hook needs the
// check at the proxy's start, whose image volume holds detour's binary).
func (f *File) completeStartGate(c *Config, check func(error)) {
	switch g := annotations.StartGateValue(f.Proxy.StartGate); g {
	case "":
		c.Proxy.StartGate = annotations.StartGateAuto
	case annotations.StartGateAuto, annotations.StartGateProbe:
		c.Proxy.StartGate = g
	case annotations.StartGateHook:
		c.Proxy.StartGate = g
		switch {
		case c.Validator.Mode == annotations.ValidatorInitContainer:
			check(invalid("proxy.startGate", strconv.Quote(f.Proxy.StartGate), "the hook runs detour's binary from the image volume of the check at the proxy's start, which validator.mode init-container rules out: set validator.mode to auto or image-volume, or use \"probe\" or \"auto\""))
		case c.Validator.Mode == annotations.ValidatorImageVolume && c.foldBlocker() != "":
			// validator.mode's error says it already.
		case c.hookBlocker() != "":
			check(invalid("proxy.startGate", strconv.Quote(f.Proxy.StartGate), "%s; or use \"probe\" or \"auto\"", c.hookBlocker()))
		}
	default:
		check(invalid("proxy.startGate", strconv.Quote(f.Proxy.StartGate), "use \"auto\", \"probe\" (the proxy's startup probe holds the pod's next containers) or \"hook\" (a postStart hook of detour's binary that asks what the startup probe would)"))
	}
}

// hookBlocker says why the start gate cannot be the postStart hook with this configuration, or
// "" when it can: the hook asks what the startup probe would (a TCP connection, or an HTTP GET)
// and needs the check at the proxy's start, whose image volume holds detour's binary.
func (c *Config) hookBlocker() string {
	if why := c.foldBlocker(); why != "" {
		return why
	}
	if c.Proxy.StartupProbe.GRPC != nil {
		return "proxy.startupProbe is a grpc probe, which the start gate's hook does not ask (it asks tcpSocket and httpGet probes)"
	}
	if c.Proxy.Lifecycle != nil && c.Proxy.Lifecycle.PostStart != nil {
		return "proxy.lifecycle.postStart is the proxy's own hook, and a container has one (the start gate's hook is a postStart hook)"
	}
	return ""
}

// foldBlocker says why the validator's check cannot run in the proxy's start with this
// configuration, or "" when it can: the check execs the proxy's command, which the webhook must
// know, and only a startup probe that reaches the proxy holds the pod's next containers back
// until the proxy — and so the check — has started (without one the kubelet starts them as
// soon as the proxy's process runs; with one that does not depend on the proxy, such as an
// exec probe, as soon as that passes; either way an app could start before a failing check
// ends).
func (c *Config) foldBlocker() string {
	switch {
	case len(c.Proxy.Command) == 0:
		return "proxy.command is not set (the check runs first and then execs the proxy's command, which the webhook must know): set it"
	case c.Proxy.StartupProbe == nil:
		return "proxy.startupProbe is not set (without one the kubelet starts the app as soon as the proxy's process runs, before a failing check could stop it): set one that probes one of the proxy's ports"
	}
	return c.startupProbeBlocker()
}

// startupProbeBlocker says why the proxy's startup probe does not prove that the proxy (and so
// the check before it) has started, or "": it must be a tcpSocket, httpGet or grpc probe on one
// of the proxy's own ports, which nothing answers until the proxy listens.
func (c *Config) startupProbeBlocker() string {
	p := c.Proxy.StartupProbe
	var kind string
	var port intstr.IntOrString
	switch {
	case p.TCPSocket != nil:
		kind, port = "tcpSocket", p.TCPSocket.Port
	case p.HTTPGet != nil:
		kind, port = "httpGet", p.HTTPGet.Port
	case p.GRPC != nil:
		kind, port = "grpc", intstr.FromInt32(p.GRPC.Port)
	case p.Exec != nil:
		return fmt.Sprintf("proxy.startupProbe is an exec probe, which need not depend on the proxy (it can pass while a failing check still runs, and the app then starts before the check ended): use a tcpSocket, httpGet or grpc probe on one of the proxy's ports (%s)", c.proxyPortList())
	default:
		return fmt.Sprintf("proxy.startupProbe has no tcpSocket, httpGet or grpc action: probe one of the proxy's ports (%s)", c.proxyPortList())
	}
	if c.isProxyPort(port) {
		return ""
	}
	return fmt.Sprintf("proxy.startupProbe.%s.port %s is none of the proxy's ports (%s), so the probe need not wait for the proxy, nor for the check before it: probe one of them", kind, port.String(), c.proxyPortList())
}

// isProxyPort reports whether port (a number, or the name of a port of the proxy container) is
// one the proxy listens on: its inbound, outbound or an admin port.
func (c *Config) isProxyPort(port intstr.IntOrString) bool {
	if port.Type == intstr.String {
		return slices.ContainsFunc(c.Proxy.AdminPorts, func(a uint16) bool { return AdminPortName(a) == port.StrVal })
	}
	n := port.IntValue()
	return n == int(c.Proxy.InboundPort) || n == int(c.Proxy.OutboundPort) ||
		slices.ContainsFunc(c.Proxy.AdminPorts, func(a uint16) bool { return int(a) == n })
}

// proxyPortList names the proxy's ports for messages.
func (c *Config) proxyPortList() string {
	s := fmt.Sprintf("inbound %d, outbound %d", c.Proxy.InboundPort, c.Proxy.OutboundPort)
	for _, a := range c.Proxy.AdminPorts {
		s += fmt.Sprintf(", admin %d (%s)", a, AdminPortName(a))
	}
	return s
}

// AdminPortName is the name of the proxy container's port for admin port p.
func AdminPortName(p uint16) string { return fmt.Sprintf("admin-%d", p) }

// checkProbeHost refuses a proxy probe that names a host: the kubelet would probe that host
// instead of the pod, and the baseline and restricted Pod Security Standards refuse the pod.
func checkProbeHost(field string, p *corev1.Probe) error {
	if p == nil {
		return nil
	}
	switch {
	case p.HTTPGet != nil && p.HTTPGet.Host != "":
		return invalid(field+".httpGet.host", strconv.Quote(p.HTTPGet.Host), "remove it: the kubelet then probes the pod's own IP, and the Pod Security Standards (baseline and restricted) refuse a probe with a host")
	case p.TCPSocket != nil && p.TCPSocket.Host != "":
		return invalid(field+".tcpSocket.host", strconv.Quote(p.TCPSocket.Host), "remove it: the kubelet then probes the pod's own IP, and the Pod Security Standards (baseline and restricted) refuse a probe with a host")
	}
	return nil
}

// seccompProfile resolves a seccompProfile field: {type: RuntimeDefault} when unset, else a
// profile the API server accepts (Localhost with a relative localhostProfile, RuntimeDefault
// or Unconfined without one).
func seccompProfile(field string, p *corev1.SeccompProfile) (corev1.SeccompProfile, error) {
	if p == nil {
		return corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault}, nil
	}
	local := ""
	if p.LocalhostProfile != nil {
		local = *p.LocalhostProfile
	}
	switch p.Type {
	case corev1.SeccompProfileTypeRuntimeDefault, corev1.SeccompProfileTypeUnconfined:
		if p.LocalhostProfile != nil {
			return corev1.SeccompProfile{}, invalid(field+".localhostProfile", strconv.Quote(local), "only type Localhost takes a localhostProfile: remove it, or set type: Localhost")
		}
		return corev1.SeccompProfile{Type: p.Type}, nil
	case corev1.SeccompProfileTypeLocalhost:
		if local == "" || strings.HasPrefix(local, "/") || slices.Contains(strings.Split(local, "/"), "..") {
			return corev1.SeccompProfile{}, invalid(field+".localhostProfile", strconv.Quote(local), "type Localhost needs the profile's path relative to the kubelet's seccomp directory, without \"..\", such as profiles/proxy.json")
		}
		return corev1.SeccompProfile{Type: p.Type, LocalhostProfile: ptr(local)}, nil
	case "":
		return corev1.SeccompProfile{}, invalid(field+".type", nil, "is required: use RuntimeDefault (the default, which the restricted Pod Security Standard accepts), Localhost or Unconfined")
	}
	return corev1.SeccompProfile{}, invalid(field+".type", strconv.Quote(string(p.Type)), "use RuntimeDefault (the default, which the restricted Pod Security Standard accepts), Localhost (with localhostProfile) or Unconfined (which restricted refuses)")
}

// completeInitEgress fills in the default init-container selection.
func (f *File) completeInitEgress(c *Config, check func(error)) {
	c.InitEgress = annotations.InitEgressSelection{All: true}
	if f.InitEgress != "" {
		sel, err := annotations.ParseInitEgress(f.InitEgress)
		if err != nil {
			var ae *annotations.Error
			if errors.As(err, &ae) {
				err = invalid("initEgress", strconv.Quote(ae.Value), "%s", ae.Rule)
			}
			check(err)
		}
		c.InitEgress = sel
	}
}

// completeGIDRange fills in the reserved GID range (after the proxy and the validator, whose
// GIDs it must not hold).
func (f *File) completeGIDRange(c *Config, check func(error)) {
	first, last := int64(DefaultGIDFirst), int64(DefaultGIDLast)
	if f.GIDRange.First != nil {
		first = *f.GIDRange.First
	}
	if f.GIDRange.Last != nil {
		last = *f.GIDRange.Last
	}
	switch {
	case first <= 0 || first >= math.MaxUint32:
		check(invalid("gidRange.first", first, "use a GID from 1 to 4294967294 (0, root, is never exempt)"))
	case last <= 0 || last >= math.MaxUint32:
		check(invalid("gidRange.last", last, "use a GID from 1 to 4294967294"))
	case first > last:
		check(invalid("gidRange", fmt.Sprintf("%d-%d", first, last), "first must not be above last"))
	case last-first+1 > maxGIDRange:
		check(invalid("gidRange", fmt.Sprintf("%d-%d", first, last), "reserve at most %d GIDs", maxGIDRange))
	default:
		c.GIDRange = GIDRange{First: uint32(first), Last: uint32(last)}
		if c.Proxy.GID != 0 && c.GIDRange.Contains(c.Proxy.GID) {
			check(invalid("gidRange", c.GIDRange, "the range holds the proxy's GID %d; move one of them", c.Proxy.GID))
		}
		if c.Validator.GID != 0 && c.GIDRange.Contains(c.Validator.GID) {
			check(invalid("gidRange", c.GIDRange, "the range holds the validator's GID %d, which must never be exempt; move one of them", c.Validator.GID))
		}
	}
}

// completePolicies fills in the conflict policy, the sidecar mode, the excluded namespaces and
// the default of detour.dev/inject.
func (f *File) completePolicies(c *Config, check func(error)) {
	c.DefaultInject = annotations.InjectDisabled
	if f.DefaultInject != "" {
		if m, err := annotations.ParseInjectMode(f.DefaultInject); err != nil {
			check(invalid("defaultInject", strconv.Quote(f.DefaultInject), "use \"disabled\" (namespaces and pods opt in with %s: enabled) or \"enabled\" (every pod but the excluded namespaces', which opt out with %s: disabled)", annotations.Inject, annotations.Inject))
		} else {
			c.DefaultInject = m
		}
	}
	c.InboundCapture = annotations.InboundListening
	if f.InboundCapture != "" {
		m, err := annotations.ParseInboundCapture("inboundCapture", f.InboundCapture)
		if err != nil {
			check(invalid("inboundCapture", strconv.Quote(f.InboundCapture), "use \"listening\" (inbound connections go to the proxy only where the app listens) or \"all\" (every inbound connection, for a proxy that serves ports itself)"))
		}
		c.InboundCapture = m
	}
	switch ConflictPolicy(f.ConflictPolicy) {
	case "":
		c.ConflictPolicy = ConflictWarn
	case ConflictWarn, ConflictDeny:
		c.ConflictPolicy = ConflictPolicy(f.ConflictPolicy)
	default:
		check(invalid("conflictPolicy", strconv.Quote(f.ConflictPolicy), "use \"warn\" or \"deny\""))
	}
	switch SidecarMode(f.SidecarMode) {
	case "":
		c.SidecarMode = SidecarAuto
	case SidecarAuto, SidecarContainer, SidecarNative:
		c.SidecarMode = SidecarMode(f.SidecarMode)
	default:
		check(invalid("sidecarMode", strconv.Quote(f.SidecarMode), "use \"auto\", \"container\" or \"native\""))
	}
	c.ExcludeNamespaces = slices.Clone(DefaultExcludeNamespaces)
	if f.ExcludeNamespaces != nil {
		c.ExcludeNamespaces = nil
		for i, ns := range *f.ExcludeNamespaces {
			if msgs := validation.IsDNS1123Label(ns); len(msgs) > 0 {
				check(invalid(fmt.Sprintf("excludeNamespaces[%d]", i), strconv.Quote(ns), "%s", strings.Join(msgs, "; ")))
				continue
			}
			c.ExcludeNamespaces = append(c.ExcludeNamespaces, ns)
		}
	}
}

func defaultProxyResources() corev1.ResourceRequirements {
	return corev1.ResourceRequirements{
		Requests: corev1.ResourceList{
			corev1.ResourceCPU:    resource.MustParse("100m"),
			corev1.ResourceMemory: resource.MustParse("64Mi"),
		},
		Limits: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("256Mi")},
	}
}

func defaultValidatorResources() corev1.ResourceRequirements {
	return corev1.ResourceRequirements{
		Requests: corev1.ResourceList{
			corev1.ResourceCPU:    resource.MustParse("10m"),
			corev1.ResourceMemory: resource.MustParse("16Mi"),
		},
		Limits: corev1.ResourceList{
			corev1.ResourceCPU:    resource.MustParse("100m"),
			corev1.ResourceMemory: resource.MustParse("32Mi"),
		},
	}
}

// resources is the configured requirements, or def when the field is unset. An explicit
// empty `resources: {}` means none.
func resources(set *corev1.ResourceRequirements, def corev1.ResourceRequirements) corev1.ResourceRequirements {
	if set == nil {
		return def
	}
	return *set.DeepCopy()
}

func checkResources(field string, r corev1.ResourceRequirements) error {
	for name, req := range r.Requests {
		if lim, ok := r.Limits[name]; ok && req.Cmp(lim) > 0 {
			return invalid(field+".requests."+string(name), req.String(), "the request is above the limit %s", lim.String())
		}
	}
	if len(r.Claims) > 0 {
		return invalid(field+".claims", nil, "resource claims cannot be set on an injected container")
	}
	return nil
}

// probe returns a copy of p with the API server's defaults filled in, so an injected pod is
// stored exactly as the webhook wrote it and re-admission changes nothing.
func probe(p *corev1.Probe) *corev1.Probe {
	if p == nil {
		return nil
	}
	p = p.DeepCopy()
	if p.TimeoutSeconds == 0 {
		p.TimeoutSeconds = 1
	}
	if p.PeriodSeconds == 0 {
		p.PeriodSeconds = 10
	}
	if p.SuccessThreshold == 0 {
		p.SuccessThreshold = 1
	}
	if p.FailureThreshold == 0 {
		p.FailureThreshold = 3
	}
	if h := p.HTTPGet; h != nil && h.Scheme == "" {
		h.Scheme = corev1.URISchemeHTTP
	}
	return p
}
