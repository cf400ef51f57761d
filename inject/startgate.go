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
// one, and a check that gives up first exits on its own — for some milliseconds containerd then
// still lists the container running, a relist shows the kubelet a started sidecar, and it starts
// the pod's next containers behind the failed check (the hook-gate story saw it with 20 pods on
// two busy cores: HookWait was 1 s). While the check waits, the kubelet starts nothing after the
// proxy: it is still running the hook. What the longer wait costs: a kubelet that restarts
// within it finds the failed check's container running.
const HookWait = 10 * time.Second

// autoStartGate is the gate proxy.startGate auto chooses where the hook can be had: the hook,
// Ready 1.2 s sooner than with the probe on the real node (p50, 1.68 s against 2.83 s) and
// fail-closed wherever the kubelet runs on (docs/benchmarks.md, "The proxy's start gate") —
// except, as docs/webhook.md says, a kubelet that dies before the hook joins the check, and a
// heavily loaded node where the kubelet can act on a status that still shows a killed proxy
// running (2 of 20 pods on two busy cores); the startup probe is not fooled by either.
var autoStartGate = annotations.StartGateHook

// hookGate makes the proxy's postStart hook its start gate: detour's binary from the image
// volume runs `detour wait-proxy`, which asks what the startup probe would, within the probe's
// budget, and the startup probe goes. The kubelet starts the pod's next container only once the
// hook has returned with the proxy running; with the startup probe in place it would also wait
// for the probe's next tick (docs/benchmarks.md, "What holds the next container").
func hookGate(proxy *corev1.Container, cfg *Config) {
	proxy.StartupProbe = nil
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
