package inject

import (
	"cmp"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/internal/version"
)

// PartOfLabel and PartOfValue mark detour's own pods, which are never injected.
const (
	PartOfLabel = "app.kubernetes.io/part-of"
	PartOfValue = "detour"
)

// Input is what [Mutate] needs besides the pod and the configuration.
type Input struct {
	// Namespace is the pod's namespace: the admission request's, since a pod being created
	// may not carry it yet. Empty means the pod's own.
	Namespace string
	// NamespaceAnnotations are the annotations of the pod's namespace; the pod's own values
	// win, key by key.
	NamespaceAnnotations map[string]string
	// NativeSidecars reports whether the cluster runs native sidecars (init containers with
	// restartPolicy Always, Kubernetes ≥ 1.29); sidecar mode "auto" picks native then.
	NativeSidecars bool
	// Validator is where the validator's check runs in native sidecar mode, as
	// [ResolveValidatorMode] decided for the cluster; empty means the init container.
	Validator annotations.ValidatorModeValue
	// ImageVolumesWhyNot says why a pod that asks for the check in the proxy's start cannot
	// have it on this cluster ([ValidatorDecision.WhyNot]); "" when it can.
	ImageVolumesWhyNot string
}

// Outcome is what [Mutate] did with a pod.
type Outcome string

const (
	Injected Outcome = "injected"
	Skipped  Outcome = "skipped"
)

// Skip reasons, the Reason of a skipped [Result].
const (
	SkipNotEnabled        = "not-enabled"
	SkipDisabled          = "disabled"
	SkipExcludedNamespace = "excluded-namespace"
	SkipDetourPod         = "detour-pod"
	SkipHostNetwork       = "host-network"
	SkipWindows           = "windows"
)

// Via is how an init container keeps egress before the proxy starts, or why it does not.
type Via string

const (
	// ViaUID: its UID is exempt.
	ViaUID Via = "uid"
	// ViaGID: it runs with a dedicated GID from the reserved range, and that GID is exempt.
	ViaGID Via = "gid"
	// ViaProxyUID: it runs as the proxy's UID, which is never redirected.
	ViaProxyUID Via = "proxy-uid"
	// ViaProxy: native sidecar mode; it starts after the proxy and goes through it.
	ViaProxy Via = "proxy"
	// NotSelected: detour.dev/init-egress does not select it; its connections are redirected.
	NotSelected Via = "not-selected"
	// Sidecar: a user sidecar (restartPolicy Always); its traffic is always redirected.
	Sidecar Via = "sidecar"
	// Refused: it was selected, but no exemption can be granted safely.
	Refused Via = "refused"
)

// Decision is what the webhook decided for one user init container.
type Decision struct {
	Container string
	Via       Via
	// ID is the exempt UID (ViaUID, ViaProxyUID) or GID (ViaGID).
	ID uint32
	// Why explains a GID or a refusal, e.g. "runs as root".
	Why string
}

// Result is what [Mutate] did.
type Result struct {
	Outcome Outcome
	// Reason says why a pod was skipped (one of the Skip* constants).
	Reason string
	// Mode is where the proxy went in an injected pod.
	Mode annotations.SidecarModeValue
	// Validator is where the validator's check runs in an injected pod.
	Validator annotations.ValidatorModeValue
	// StartGate is what holds the pod's next containers until its proxy (a native sidecar) has
	// started: its startup probe or detour's postStart hook; "" when nothing does (a regular
	// container, or a proxy without a startup probe).
	StartGate annotations.StartGateValue
	Decisions []Decision
	// Warnings are for the person who applies the pod (admission warnings, stderr in the CLI).
	Warnings []string
}

// DenialError is a pod the webhook refuses to admit; Error says how to fix the pod.
type DenialError struct{ Reasons []string }

func (e *DenialError) Error() string {
	return "detour: " + strings.Join(e.Reasons, "; ")
}

// IsDenial reports whether err from [Mutate] is a denial of the pod rather than an internal error.
func IsDenial(err error) bool {
	var d *DenialError
	return errors.As(err, &d)
}

func deny(format string, args ...any) *DenialError {
	return &DenialError{Reasons: []string{fmt.Sprintf(format, args...)}}
}

// Mutate injects pod in place: it adds the validator (first init container) and the proxy,
// makes each selected init container exemptible and writes the webhook's annotations. It is
// idempotent: a pod it injected before is stripped of the previous injection and injected
// again from scratch, so re-invocation after another webhook added an init container picks
// that container up, re-admission changes nothing, and values a pod author wrote into the
// webhook's annotations never survive.
//
// Mutate returns a [*DenialError] when the pod must be denied: malformed detour annotations,
// or, under conflictPolicy deny, an init container that cannot be given egress.
func Mutate(pod *corev1.Pod, in Input, cfg *Config) (Result, error) {
	if pod == nil {
		return Result{}, deny("the request holds no pod")
	}
	namespace := cmp.Or(in.Namespace, pod.Namespace)
	u := userSettings{pod: pod.Annotations, ns: in.NamespaceAnnotations, namespace: namespace}

	// The reasons that do not depend on detour.dev/inject come first, so that a malformed
	// value on a pod detour never injects (an excluded namespace, a hostNetwork pod) skips it
	// rather than denying it.
	reason := fixedSkipReason(pod, namespace, cfg)
	if reason == "" {
		mode, err := u.injectMode()
		if err != nil {
			return Result{}, err
		}
		if mode == "" && cfg.DefaultInject == annotations.InjectEnabled {
			mode = annotations.InjectEnabled // the mesh-wide default
		}
		reason = optInSkipReason(mode)
	}
	// A misspelt key is ignored like any annotation detour does not read; say so, or its
	// setting (or the opt-in itself) silently does not apply.
	var unknown []string
	if s := annotations.Unknown(pod.Annotations); s != "" {
		unknown = append(unknown, "detour: the pod's annotations "+s+" are not ones detour reads, so they have no effect; docs/annotations.md lists the keys")
	}
	if s := annotations.Unknown(in.NamespaceAnnotations); s != "" {
		unknown = append(unknown, fmt.Sprintf("detour: the annotations %s of namespace %q are not ones detour reads, so they have no effect; docs/annotations.md lists the keys", s, namespace))
	}
	if reason != "" {
		res := skip(pod, reason)
		res.Warnings = append(unknown, res.Warnings...)
		return res, nil
	}
	s, err := u.parse(cfg)
	if err != nil {
		return Result{}, err
	}

	wasInjected := annotations.IsInjected(pod.Annotations)
	removed := strip(pod)
	res := Result{Outcome: Injected, Mode: annotations.SidecarContainer, Warnings: unknown}
	if !wasInjected {
		for _, name := range removed.containers {
			res.Warnings = append(res.Warnings, fmt.Sprintf(
				"detour: the pod's container %q has a name detour reserves for its own containers, so it was replaced by detour's; rename it to keep it", name))
		}
		if removed.volume {
			res.Warnings = append(res.Warnings, fmt.Sprintf(
				"detour: the pod's volume %q has a name detour reserves for its own volume, so it was removed; rename it to keep it", annotations.ValidatorVolume))
		}
	}
	switch {
	case s.mode == SidecarNative && !in.NativeSidecars:
		res.Warnings = append(res.Warnings, fmt.Sprintf(
			"detour: sidecar mode native (from %s) needs native sidecars (Kubernetes 1.29 or later), which this cluster does not run; the proxy runs as a regular container instead", s.modeFrom))
	case s.mode == SidecarNative, s.mode == SidecarAuto && in.NativeSidecars:
		res.Mode = annotations.SidecarNative
	}

	if res.Mode == annotations.SidecarContainer {
		if w := runToCompletionWarning(pod, in.NativeSidecars); w != "" {
			res.Warnings = append(res.Warnings, w)
		}
	}

	var ex exemptions
	if res.Mode == annotations.SidecarNative {
		ex = behindProxy(pod, cfg)
	} else {
		ex = decide(pod, cfg, s)
	}
	ex.proxyUIDConflicts(pod, cfg)
	for _, d := range ex.decisions {
		res.Decisions = append(res.Decisions, d.Decision)
	}
	res.Warnings = append(res.Warnings, ex.warnings...)
	if len(ex.refusals) > 0 && cfg.ConflictPolicy == ConflictDeny {
		return res, &DenialError{Reasons: ex.refusals}
	}
	for _, d := range ex.decisions {
		if d.Via == ViaGID {
			c := &pod.Spec.InitContainers[d.index]
			if c.SecurityContext == nil {
				c.SecurityContext = &corev1.SecurityContext{}
			}
			c.SecurityContext.RunAsGroup = ptr(int64(d.ID))
		}
	}

	r := annotations.Redirect{
		Version:           version.Version,
		ProxyUID:          cfg.Proxy.UID,
		InboundPort:       cfg.Proxy.InboundPort,
		OutboundPort:      cfg.Proxy.OutboundPort,
		SkipInboundPorts:  mergePorts(append(slices.Clone(s.skipInbound), portRanges(cfg.Proxy.AdminPorts)...)),
		SkipOutboundPorts: mergePorts(s.skipOutbound),
		SkipOutboundCIDRs: dedupe(s.skipCIDRs),
		ExemptUIDs:        ex.ids(ViaUID),
		ExemptGIDs:        ex.ids(ViaGID),
		Sentinels:         slices.Clone(cfg.Validator.Probes),
		CheckPort:         cfg.Validator.CheckPort,
		InboundListening:  s.inboundCapture == annotations.InboundListening,
	}
	if n := len(r.SkipInboundPorts); n > annotations.MaxListItems {
		return res, deny("%s (%s) and the proxy's admin ports make %d port ranges, more than %d; merge ports into ranges",
			annotations.SkipInboundPorts, s.skipInboundFrom, n, annotations.MaxListItems)
	}
	a := r.Annotations()
	// The plugin must be able to read what the webhook writes; a failure here is a bug or a
	// build with an unusable version label, and denying beats a pod whose sandbox fails.
	if _, err := annotations.ParseRedirect(a); err != nil {
		return res, fmt.Errorf("detour webhook: the annotations it computed do not parse (%w); report this as a bug", err)
	}
	if pod.Annotations == nil {
		pod.Annotations = map[string]string{}
	}
	for k, v := range a {
		pod.Annotations[k] = v
	}
	pod.Annotations[annotations.InitEgressStatus] = status(res)

	res.Validator, err = validatorMode(res, in, cfg, s)
	if err != nil {
		res.Warnings = append(res.Warnings, err.Error())
	}
	pod.Annotations[annotations.Validator] = string(res.Validator)
	res.StartGate, err = startGate(res, cfg, s)
	if err != nil {
		res.Warnings = append(res.Warnings, err.Error())
	}

	proxy := proxyContainer(cfg)
	if err := addProxyVolumes(pod, &proxy, cfg); err != nil {
		return res, err
	}
	switch {
	case res.Validator == annotations.ValidatorImageVolume:
		// The check runs in the proxy's own start: no validator container.
		foldValidator(pod, &proxy, cfg)
		if res.StartGate == annotations.StartGateHook {
			hookGate(&proxy, cfg)
		}
		if w := checkPortWarning(pod, cfg); w != "" {
			res.Warnings = append(res.Warnings, w)
		}
		proxy.RestartPolicy = ptr(corev1.ContainerRestartPolicyAlways)
		pod.Spec.InitContainers = slices.Insert(pod.Spec.InitContainers, 0, proxy)
	case res.Mode == annotations.SidecarNative:
		proxy.RestartPolicy = ptr(corev1.ContainerRestartPolicyAlways)
		pod.Spec.InitContainers = slices.Insert(pod.Spec.InitContainers, 0, validatorContainer(cfg), proxy)
	default:
		pod.Spec.InitContainers = slices.Insert(pod.Spec.InitContainers, 0, validatorContainer(cfg))
		pod.Spec.Containers = append(pod.Spec.Containers, proxy)
	}
	return res, nil
}

// validatorMode decides where the pod's check runs: the cluster's decision (in.Validator), or
// the pod's (or its namespace's) detour.dev/validator-mode. The check runs in the proxy's start
// only when the proxy is a native sidecar — a regular container gates nothing — and the
// configuration allows it; an error is a request for that which cannot be granted (a warning:
// the pod gets the init container).
func validatorMode(res Result, in Input, cfg *Config, s settings) (annotations.ValidatorModeValue, error) {
	mode := in.Validator
	if s.validatorMode != "" && s.validatorMode != annotations.ValidatorAuto {
		mode = s.validatorMode
	}
	if mode != annotations.ValidatorImageVolume {
		return annotations.ValidatorInitContainer, nil
	}
	asked := s.validatorMode == annotations.ValidatorImageVolume
	switch {
	case res.Mode != annotations.SidecarNative && asked:
		return annotations.ValidatorInitContainer, fmt.Errorf(
			"detour: %s image-volume (from %s) needs the proxy as a native sidecar, and it runs as a regular container here; the validator runs as an init container instead", annotations.ValidatorMode, s.validatorModeFrom)
	case res.Mode != annotations.SidecarNative:
		return annotations.ValidatorInitContainer, nil
	case asked && in.ImageVolumesWhyNot != "":
		return annotations.ValidatorInitContainer, fmt.Errorf(
			"detour: %s image-volume (from %s) cannot be granted: %s; the validator runs as an init container instead", annotations.ValidatorMode, s.validatorModeFrom, in.ImageVolumesWhyNot)
	}
	if why := cfg.foldBlocker(); why != "" {
		return annotations.ValidatorInitContainer, fmt.Errorf(
			"detour: %s image-volume (from %s) cannot be granted: the webhook configuration's %s; the validator runs as an init container instead", annotations.ValidatorMode, s.validatorModeFrom, why)
	}
	return annotations.ValidatorImageVolume, nil
}

// checkPortWarning warns about a container of the pod that declares the check port: the check
// at the proxy's start listens there, so after a proxy restart it would find the port taken and
// fail (exit 43) while that container listens.
func checkPortWarning(pod *corev1.Pod, cfg *Config) string {
	for _, c := range slices.Concat(pod.Spec.InitContainers, pod.Spec.Containers) {
		for _, p := range c.Ports {
			if p.ContainerPort == int32(cfg.Validator.CheckPort) && (p.Protocol == "" || p.Protocol == corev1.ProtocolTCP) {
				return fmt.Sprintf("detour: container %q declares port %d, where the redirect check at the proxy's start listens (the webhook's validator.checkPort); "+
					"if it listens there, the check cannot run when the proxy restarts (exit 43): move the container's port, or ask the admin to move validator.checkPort", c.Name, p.ContainerPort)
			}
		}
	}
	return ""
}

// runToCompletionWarning warns about a pod that runs to completion (restartPolicy Never or
// OnFailure: a Job's or a CronJob's) when the proxy is a regular container: the proxy never
// exits, so the pod never completes. A native sidecar does not hold a pod back, which is why
// sidecar mode auto picks it wherever the cluster has it.
func runToCompletionWarning(pod *corev1.Pod, native bool) string {
	policy := pod.Spec.RestartPolicy
	if policy != corev1.RestartPolicyNever && policy != corev1.RestartPolicyOnFailure {
		return ""
	}
	fix := "annotate the pod " + annotations.SidecarMode + ": native, so that the proxy runs as a native sidecar, which the kubelet stops once the other containers finish"
	if !native {
		fix = "run it on Kubernetes 1.29 or later with " + annotations.SidecarMode + ": native (or sidecarMode auto), or make the proxy exit when the job's containers are done"
	}
	return fmt.Sprintf(
		"detour: the pod's restartPolicy is %s (a Job or CronJob runs such pods), and the proxy runs as a regular container that does not exit, so the pod never completes; %s",
		policy, fix)
}

// fixedSkipReason says why the pod is never injected whatever its detour.dev/inject says (one
// of the Skip* constants), or "".
func fixedSkipReason(pod *corev1.Pod, namespace string, cfg *Config) string {
	switch {
	case slices.Contains(cfg.ExcludeNamespaces, namespace):
		return SkipExcludedNamespace
	case pod.Labels[PartOfLabel] == PartOfValue:
		return SkipDetourPod
	case pod.Spec.HostNetwork:
		return SkipHostNetwork
	case pod.Spec.OS != nil && pod.Spec.OS.Name == corev1.Windows:
		return SkipWindows
	}
	return ""
}

// optInSkipReason says why a pod that could be injected is not, from its resolved
// detour.dev/inject, or "" when it is opted in.
func optInSkipReason(mode annotations.InjectMode) string {
	switch mode {
	case "":
		return SkipNotEnabled
	case annotations.InjectDisabled:
		return SkipDisabled
	}
	return ""
}

// skip leaves the pod uninjected. It must not carry the webhook's annotations (the plugin would
// act on a forged injected marker or exemption), nor detour's containers: a pod injected
// offline (detour inject) but created where detour does not inject it would keep a validator
// that fails for ever, since no rules are installed for it, and a proxy nothing sends to.
func skip(pod *corev1.Pod, reason string) Result {
	res := Result{Outcome: Skipped, Reason: reason}
	removed := strip(pod)
	if len(removed.containers) > 0 {
		quoted := make([]string, len(removed.containers))
		for i, n := range removed.containers {
			quoted[i] = strconv.Quote(n)
		}
		next := fmt.Sprintf("opt the namespace or the pod in with %s: enabled to inject it", annotations.Inject)
		if reason != SkipNotEnabled && reason != SkipDisabled {
			next = "detour never injects such a pod"
		}
		res.Warnings = append(res.Warnings, fmt.Sprintf(
			"detour: the pod is not injected (%s), so detour removed its containers %s: without detour's rules the validator would fail for ever; %s",
			reason, strings.Join(quoted, ", "), next))
	}
	return res
}

// stripped is what [strip] removed: containers with detour's reserved names, in pod order, and
// whether a volume with its reserved name.
type stripped struct {
	containers []string
	volume     bool
}

// strip removes a previous injection: the containers and the volume with detour's reserved
// names, the volumes only detour's proxy mounted where detour injected the pod (the proxy
// volumes of the configuration then, whatever it says now), the image volumes label the webhook
// selected, and every webhook-written annotation (including values a pod author forged).
func strip(pod *corev1.Pod) stripped {
	var removed stripped
	injected := annotations.IsInjected(pod.Annotations)
	proxyMounts := map[string]bool{}
	ours := func(c corev1.Container) bool {
		if c.Name == annotations.ProxyContainer || c.Name == annotations.ValidatorContainer {
			removed.containers = append(removed.containers, c.Name)
			for _, m := range c.VolumeMounts {
				proxyMounts[m.Name] = injected
			}
			return true
		}
		return false
	}
	pod.Spec.InitContainers = slices.DeleteFunc(pod.Spec.InitContainers, ours)
	pod.Spec.Containers = slices.DeleteFunc(pod.Spec.Containers, ours)
	for _, cs := range [][]corev1.Container{pod.Spec.InitContainers, pod.Spec.Containers} {
		for _, c := range cs {
			for _, m := range c.VolumeMounts {
				delete(proxyMounts, m.Name) // the pod's own containers use it too
			}
		}
	}
	for _, c := range pod.Spec.EphemeralContainers {
		for _, m := range c.VolumeMounts {
			delete(proxyMounts, m.Name)
		}
	}
	pod.Spec.Volumes = slices.DeleteFunc(pod.Spec.Volumes, func(v corev1.Volume) bool {
		removed.volume = removed.volume || v.Name == annotations.ValidatorVolume
		return v.Name == annotations.ValidatorVolume || proxyMounts[v.Name]
	})
	if len(pod.Spec.Volumes) == 0 {
		pod.Spec.Volumes = nil
	}
	if injected {
		// The webhook's own selector; a pod detour never injected keeps one its author wrote.
		delete(pod.Spec.NodeSelector, annotations.ImageVolumesLabel)
		if len(pod.Spec.NodeSelector) == 0 {
			pod.Spec.NodeSelector = nil
		}
	}
	stripAnnotations(pod)
	return removed
}

// stripAnnotations removes every webhook-written annotation, and the node agent's note of a
// sandbox's inbound fallback, which a new pod copied from an old one's YAML must not carry.
func stripAnnotations(pod *corev1.Pod) {
	for _, k := range annotations.WebhookKeys {
		delete(pod.Annotations, k)
	}
	delete(pod.Annotations, annotations.InboundFallback)
}

// userSettings resolves the user-written keys: the pod's value wins over the namespace's.
type userSettings struct {
	pod, ns   map[string]string
	namespace string
}

// lookup returns the value of key and where it came from, for messages.
func (u userSettings) lookup(key string) (value, from string, ok bool) {
	if v, ok := u.pod[key]; ok {
		return v, "the pod's annotation", true
	}
	if v, ok := u.ns[key]; ok {
		return v, fmt.Sprintf("namespace %q", u.namespace), true
	}
	return "", "", false
}

// wrapError turns a parser error into a denial that says where the bad value is.
func (u userSettings) wrapError(key string, err error) error {
	_, from, _ := u.lookup(key)
	if strings.HasPrefix(from, "namespace") {
		return deny("%s: %v (fix the annotation on the namespace)", from, err)
	}
	return deny("%v (fix the pod's annotation)", err)
}

func (u userSettings) injectMode() (annotations.InjectMode, error) {
	v, _, ok := u.lookup(annotations.Inject)
	if !ok {
		return "", nil
	}
	m, err := annotations.ParseInjectMode(v)
	if err != nil {
		return "", u.wrapError(annotations.Inject, err)
	}
	return m, nil
}

// settings are the parsed user settings of one pod.
type settings struct {
	initEgress      annotations.InitEgressSelection
	initEgressFrom  string
	skipInbound     []annotations.PortRange
	skipInboundFrom string
	skipOutbound    []annotations.PortRange
	skipCIDRs       []netip.Prefix
	mode            SidecarMode
	modeFrom        string
	// validatorMode is the pod's (or namespace's) detour.dev/validator-mode, if any.
	validatorMode     annotations.ValidatorModeValue
	validatorModeFrom string
	inboundCapture    annotations.InboundCaptureValue
	// startGate is the pod's (or namespace's) detour.dev/proxy-start-gate, if any.
	startGate     annotations.StartGateValue
	startGateFrom string
}

func (u userSettings) parse(cfg *Config) (settings, error) {
	s := settings{initEgress: cfg.InitEgress, initEgressFrom: "the webhook configuration", mode: cfg.SidecarMode, modeFrom: "the webhook configuration",
		inboundCapture: cfg.InboundCapture}
	var err error
	if v, from, ok := u.lookup(annotations.InitEgress); ok {
		if s.initEgress, err = annotations.ParseInitEgress(v); err != nil {
			return s, u.wrapError(annotations.InitEgress, err)
		}
		s.initEgressFrom = from
	}
	if v, from, ok := u.lookup(annotations.SkipInboundPorts); ok {
		if s.skipInbound, err = annotations.ParsePorts(annotations.SkipInboundPorts, v); err != nil {
			return s, u.wrapError(annotations.SkipInboundPorts, err)
		}
		s.skipInboundFrom = from
	}
	if v, _, ok := u.lookup(annotations.SkipOutboundPorts); ok {
		if s.skipOutbound, err = annotations.ParsePorts(annotations.SkipOutboundPorts, v); err != nil {
			return s, u.wrapError(annotations.SkipOutboundPorts, err)
		}
	}
	if v, _, ok := u.lookup(annotations.SkipOutboundCIDRs); ok {
		if s.skipCIDRs, err = annotations.ParseCIDRs(annotations.SkipOutboundCIDRs, v); err != nil {
			return s, u.wrapError(annotations.SkipOutboundCIDRs, err)
		}
	}
	if v, from, ok := u.lookup(annotations.SidecarMode); ok {
		m, err := annotations.ParseSidecarMode(v)
		if err != nil {
			return s, u.wrapError(annotations.SidecarMode, err)
		}
		s.mode, s.modeFrom = SidecarMode(m), from
	}
	if v, from, ok := u.lookup(annotations.ValidatorMode); ok {
		m, err := annotations.ParseValidatorMode(v)
		if err != nil {
			return s, u.wrapError(annotations.ValidatorMode, err)
		}
		s.validatorMode, s.validatorModeFrom = m, from
	}
	if v, _, ok := u.lookup(annotations.InboundCapture); ok {
		if s.inboundCapture, err = annotations.ParseInboundCapture(annotations.InboundCapture, v); err != nil {
			return s, u.wrapError(annotations.InboundCapture, err)
		}
	}
	if v, from, ok := u.lookup(annotations.ProxyStartGate); ok {
		if s.startGate, err = annotations.ParseStartGate(v); err != nil {
			return s, u.wrapError(annotations.ProxyStartGate, err)
		}
		s.startGateFrom = from
	}
	return s, nil
}

// mergePorts sorts ranges and merges the overlapping and adjacent ones.
func mergePorts(ranges []annotations.PortRange) []annotations.PortRange {
	if len(ranges) == 0 {
		return nil
	}
	r := slices.Clone(ranges)
	slices.SortFunc(r, func(a, b annotations.PortRange) int { return cmp.Compare(a.First, b.First) })
	out := r[:1]
	for _, x := range r[1:] {
		last := &out[len(out)-1]
		if uint32(x.First) <= uint32(last.Last)+1 {
			last.Last = max(last.Last, x.Last)
			continue
		}
		out = append(out, x)
	}
	return out
}

func portRanges(ports []uint16) []annotations.PortRange {
	out := make([]annotations.PortRange, len(ports))
	for i, p := range ports {
		out[i] = annotations.PortRange{First: p, Last: p}
	}
	return out
}

// dedupe drops repeated networks, keeping the first occurrence's place.
func dedupe(prefixes []netip.Prefix) []netip.Prefix {
	var out []netip.Prefix
	for _, p := range prefixes {
		if !slices.Contains(out, p) {
			out = append(out, p)
		}
	}
	return out
}

func ptr[T any](v T) *T { return &v }

// status is the human summary written to detour.dev/init-egress-status.
func status(r Result) string {
	if len(r.Decisions) == 0 {
		return string(r.Mode) + ": no init containers"
	}
	parts := make([]string, len(r.Decisions))
	for i, d := range r.Decisions {
		var s string
		switch d.Via {
		case ViaUID:
			s = fmt.Sprintf("uid %d", d.ID)
		case ViaGID:
			s = fmt.Sprintf("gid %d (%s)", d.ID, d.Why)
		case ViaProxyUID:
			s = fmt.Sprintf("proxy uid %d", d.ID)
		case ViaProxy:
			s = "after the proxy"
		case NotSelected:
			s = "not selected"
		case Sidecar:
			s = "sidecar, redirected"
		case Refused:
			s = "refused (" + d.Why + ")"
		}
		parts[i] = d.Container + " " + s
	}
	return string(r.Mode) + ": " + strings.Join(parts, "; ")
}
