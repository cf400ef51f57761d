package inject

import (
	"fmt"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/detourmesh/detour/annotations"
)

// startGate decides what holds the pod's next containers until its proxy has started: the
// pod's (or its namespace's) detour.dev/proxy-start-gate, else the configuration's
// proxy.startGate. The hook needs the check at the proxy's start (detour's binary comes from its
// image volume) and a startup probe it can ask; where either is missing the proxy's startup
// probe stays the gate, and an error is the pod's request for the hook that cannot be granted
// (a warning). "" means no gate: the proxy is a regular container, or a native sidecar without a
// startup probe.
func startGate(res Result, cfg *Config, s settings) (annotations.StartGateValue, error) {
	if res.Mode != annotations.SidecarNative || cfg.Proxy.StartupProbe == nil {
		return "", nil
	}
	gate := cfg.Proxy.StartGate
	if s.startGate != "" && s.startGate != annotations.StartGateAuto {
		gate = s.startGate
	}
	if gate == annotations.StartGateAuto {
		gate = autoStartGate
		if cfg.hookBlocker() != "" {
			gate = annotations.StartGateProbe
		}
	}
	if gate != annotations.StartGateHook {
		return annotations.StartGateProbe, nil
	}
	// Only a pod's own request is answered with a warning: the configuration's hook where the
	// cluster decided for the init container is the webhook's decision, which it logs.
	asked, from := s.startGate == annotations.StartGateHook, s.startGateFrom
	switch {
	case res.Validator != annotations.ValidatorImageVolume && !asked, cfg.hookBlocker() != "" && !asked:
		return annotations.StartGateProbe, nil
	case res.Validator != annotations.ValidatorImageVolume:
		return annotations.StartGateProbe, fmt.Errorf(
			"detour: %s hook (from %s) needs the redirect check at the proxy's start, whose image volume holds detour's binary, and this pod has the %s init container; the proxy's startup probe holds the pod's next containers instead",
			annotations.ProxyStartGate, from, annotations.ValidatorContainer)
	case cfg.hookBlocker() != "":
		return annotations.StartGateProbe, fmt.Errorf(
			"detour: %s hook (from %s) cannot be granted: the webhook configuration's %s; the proxy's startup probe holds the pod's next containers instead",
			annotations.ProxyStartGate, from, cfg.hookBlocker())
	}
	return annotations.StartGateHook, nil
}

// HookWait is how long a check at the proxy's start that failed waits for the start gate's hook
// to join and take its message (the folded check's --hook-wait). The kubelet runs the hook right
// after starting the container: tens of milliseconds on an idle node, but seconds on a loaded
// one (the hook-gate story saw 15 of 20 hooks join after a 1 s wait with two busy cores). While
// the check waits, the kubelet starts nothing after the proxy: it is still running the hook.
const HookWait = 10 * time.Second

// autoStartGate is the gate proxy.startGate auto chooses where the hook can be had: the hook
// beside the startup probe, which says in kubectl why a failed check held the pod
// (docs/webhook.md, "The proxy's start gate").
var autoStartGate = annotations.StartGateHook

// hookGate adds detour's start gate hook to the proxy: a postStart exec of detour's binary from
// the image volume, `detour wait-proxy`, which asks what the startup probe would, within the
// probe's budget, and reports a failed check's message as the hook's error. The startup probe
// stays: the kubelet counts a running native sidecar without one as started, and on a loaded
// node it has acted on a status that still showed a proxy running after its hook failed and it
// killed it, starting the pod's next containers behind the failed check (2 of 20 pods in the
// hook-gate story with two busy cores). A probe result belongs to one container and a failed
// check's container never answers it, so no stale status opens the gate; what it costs is the
// probe's next tick after the hook (docs/benchmarks.md, "The proxy's start gate").
func hookGate(proxy *corev1.Container, cfg *Config) {
	// A check that finds no redirect can fail before the hook's exec has begun: it waits that
	// long for the hook, which then reports the check's message.
	dash := slices.Index(proxy.Command, "--")
	proxy.Command = slices.Insert(proxy.Command, dash, "--hook-wait="+HookWait.String())
	if proxy.Lifecycle == nil { // the proxy's own preStop stays
		proxy.Lifecycle = &corev1.Lifecycle{}
	}
	proxy.Lifecycle.PostStart = &corev1.LifecycleHandler{
		Exec: &corev1.ExecAction{Command: WaitProxyCommand(cfg)},
	}
}

// WaitProxyCommand is the start gate's hook for cfg: `detour wait-proxy` from the image volume,
// asking the startup probe's question (its port resolved to a number) within its budget —
// initialDelaySeconds + periodSeconds × failureThreshold, after which the kubelet would have
// restarted the proxy — each attempt within its timeoutSeconds, and joining the check on the
// check port. cfg's startup probe must be a
// tcpSocket or httpGet probe ([Config.hookBlocker]).
func WaitProxyCommand(cfg *Config) []string {
	p := cfg.Proxy.StartupProbe
	budget := p.InitialDelaySeconds + p.PeriodSeconds*p.FailureThreshold
	var target string
	var headers []string
	switch {
	case p.TCPSocket != nil:
		target = fmt.Sprintf("tcp://:%d", cfg.portNumber(p.TCPSocket.Port))
	case p.HTTPGet != nil:
		path := p.HTTPGet.Path
		if !strings.HasPrefix(path, "/") {
			path = "/" + path
		}
		target = fmt.Sprintf("%s://:%d%s", strings.ToLower(string(p.HTTPGet.Scheme)), cfg.portNumber(p.HTTPGet.Port), path)
		for _, h := range p.HTTPGet.HTTPHeaders {
			headers = append(headers, "--header="+h.Name+": "+h.Value)
		}
	}
	cmd := []string{ValidatorBinary, "wait-proxy", "--probe=" + target}
	cmd = append(cmd, headers...)
	return append(cmd, fmt.Sprintf("--timeout=%ds", budget), fmt.Sprintf("--attempt-timeout=%ds", p.TimeoutSeconds), fmt.Sprintf("--check-port=%d", cfg.Validator.CheckPort))
}

// portNumber resolves a probe's port: a number, or the name of one of the proxy's admin ports
// ([Config.isProxyPort] holds).
func (c *Config) portNumber(port intstr.IntOrString) uint16 {
	if port.Type == intstr.String {
		for _, a := range c.Proxy.AdminPorts {
			if AdminPortName(a) == port.StrVal {
				return a
			}
		}
		return 0
	}
	return uint16(port.IntValue())
}
