package inject

import (
	"fmt"
	"math"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/detourmesh/detour/annotations"
)

// decision is a Decision with the index of its init container.
type decision struct {
	Decision
	index int
	note  string // the warning for the person applying the pod
}

// exemptions is what decide found for a pod's init containers.
type exemptions struct {
	decisions []decision
	warnings  []string
	// refusals are the denial reasons under conflictPolicy deny, each saying how to fix it.
	refusals []string
}

// ids returns the exempt IDs granted via v (ViaUID or ViaGID), sorted and unique.
func (e exemptions) ids(v Via) []uint32 {
	var ids []uint32
	for _, d := range e.decisions {
		if d.Via == v {
			ids = append(ids, d.ID)
		}
	}
	slices.Sort(ids)
	return slices.Compact(ids)
}

// EffectiveUID is the user a container runs as: its own runAsUser, else the pod's. nil means
// the image decides (unknown at admission). The demo resolves identities with it too.
func EffectiveUID(pod *corev1.Pod, c *corev1.Container) *int64 {
	if c.SecurityContext != nil && c.SecurityContext.RunAsUser != nil {
		return c.SecurityContext.RunAsUser
	}
	if pod.Spec.SecurityContext != nil {
		return pod.Spec.SecurityContext.RunAsUser
	}
	return nil
}

// EffectiveGID is the group a container runs as: its own runAsGroup, else the pod's. nil means
// the image decides.
func EffectiveGID(pod *corev1.Pod, c *corev1.Container) *int64 {
	if c.SecurityContext != nil && c.SecurityContext.RunAsGroup != nil {
		return c.SecurityContext.RunAsGroup
	}
	if pod.Spec.SecurityContext != nil {
		return pod.Spec.SecurityContext.RunAsGroup
	}
	return nil
}

// isSidecar reports whether an init container is a native sidecar: it runs for the pod's whole
// life, like an app container, and is never exempt.
func isSidecar(c *corev1.Container) bool {
	return c.RestartPolicy != nil && *c.RestartPolicy == corev1.ContainerRestartPolicyAlways
}

// other is a container whose traffic must stay redirected, for the collision checks.
type other struct {
	what string // e.g. `app container "web"`
	uid  *int64
}

// behindProxy is the native-mode outcome: the proxy starts before the user's init containers,
// which therefore need no exemption.
func behindProxy(pod *corev1.Pod, cfg *Config) exemptions {
	var e exemptions
	var names []string
	for i := range pod.Spec.InitContainers {
		c := &pod.Spec.InitContainers[i]
		if isSidecar(c) {
			e.decisions = append(e.decisions, decision{Decision: Decision{Container: c.Name, Via: Sidecar}, index: i})
			continue
		}
		e.decisions = append(e.decisions, decision{Decision: Decision{Container: c.Name, Via: ViaProxy}, index: i})
		if !runsAsProxy(pod, c, cfg) { // proxyUIDConflicts speaks of those
			names = append(names, fmt.Sprintf("%q", c.Name))
		}
	}
	switch len(names) {
	case 0:
	case 1:
		e.warnings = append(e.warnings, fmt.Sprintf(
			"detour: the proxy runs as a native sidecar, so init container %s starts after it and reaches the network through it", names[0]))
	default:
		e.warnings = append(e.warnings, fmt.Sprintf(
			"detour: the proxy runs as a native sidecar, so init containers %s start after it and reach the network through it", strings.Join(names, ", ")))
	}
	return e
}

// decide makes, in container mode, each init container selected by detour.dev/init-egress
// exemptible by these rules:
//   - a non-root UID set on the container itself, that no container which must stay
//     redirected uses, that is not the pod's default runAsUser and not the validator's, is
//     exempt by UID;
//   - every other init container gets a dedicated GID from the reserved range as runAsGroup, and
//     that GID is exempt: root; the validator's UID; a UID that a container which must stay
//     redirected uses (or possibly uses, because it runs as its image's user); a UID that comes
//     only from the pod's runAsUser or equals it (containers added later, such as kubectl debug
//     ephemeral containers, inherit the pod's default, so it is never exempt by UID); and the
//     image's default user (the kubelet resolves the image's user and hands it to the runtime
//     with runAsGroup, so a runAsGroup alone keeps that user and changes its primary group).
//
// It never exempts 0 or the validator, and a dedicated GID never equals a GID that any other
// container of the pod runs with (runAsGroup, fsGroup, supplementalGroups) nor an explicit UID
// of any container of the pod (images commonly map uid N to group N).
func decide(pod *corev1.Pod, cfg *Config, s settings) exemptions {
	var e exemptions
	e.warnUnknownInitEgress(pod.Spec.InitContainers, s)
	needGID, why := e.decideUIDs(pod, cfg, s, redirected(pod, s))
	e.assignGIDs(pod, cfg, needGID, why)
	slices.SortFunc(e.decisions, func(a, b decision) int { return a.index - b.index })
	for _, d := range e.decisions {
		if d.note != "" {
			e.warnings = append(e.warnings, d.note)
		}
	}
	return e
}

// redirected are the containers that must stay redirected: app containers, user sidecars, init
// containers the selection leaves out, and the validator (never exempt).
func redirected(pod *corev1.Pod, s settings) []other {
	var others []other
	for i := range pod.Spec.Containers {
		c := &pod.Spec.Containers[i]
		others = append(others, other{fmt.Sprintf("app container %q", c.Name), EffectiveUID(pod, c)})
	}
	for i := range pod.Spec.InitContainers {
		c := &pod.Spec.InitContainers[i]
		switch {
		case isSidecar(c):
			others = append(others, other{fmt.Sprintf("sidecar %q", c.Name), EffectiveUID(pod, c)})
		case !s.initEgress.Selects(c.Name):
			others = append(others, other{fmt.Sprintf("init container %q (not selected)", c.Name), EffectiveUID(pod, c)})
		}
	}
	return others
}

// warnUnknownInitEgress warns of names in the init-egress selection that are no init container
// of the pod.
func (e *exemptions) warnUnknownInitEgress(inits []corev1.Container, s settings) {
	for _, name := range s.initEgress.Names {
		if !slices.ContainsFunc(inits, func(c corev1.Container) bool { return c.Name == name }) {
			e.warnings = append(e.warnings, fmt.Sprintf(
				"detour: %s (from %s) names %q, which is not an init container of the pod", annotations.InitEgress, s.initEgressFrom, name))
		}
	}
}

// decideUIDs is the first pass: every init container's decision except the dedicated GIDs,
// and which init containers (by index) need one, with why.
func (e *exemptions) decideUIDs(pod *corev1.Pod, cfg *Config, s settings, others []other) (needGID []int, why map[int]string) {
	inits := pod.Spec.InitContainers
	why = map[int]string{}
	for i := range inits {
		c := &inits[i]
		d := decision{Decision: Decision{Container: c.Name}, index: i}
		uid := EffectiveUID(pod, c)
		switch {
		case isSidecar(c):
			d.Via = Sidecar
			d.note = fmt.Sprintf(
				"detour: init container %q is a sidecar (restartPolicy: Always); like the app containers, its traffic always goes through the proxy", c.Name)
		case !s.initEgress.Selects(c.Name):
			d.Via = NotSelected
			if runsAsProxy(pod, c, cfg) {
				break // proxyUIDConflicts speaks of it
			}
			d.note = fmt.Sprintf(
				"detour: init container %q is not selected by %s=%q (from %s); its outbound TCP connections go to the proxy, which starts after it, so they fail",
				c.Name, annotations.InitEgress, s.initEgress.String(), s.initEgressFrom)
		case uid == nil:
			needGID = append(needGID, i)
			why[i] = "runs as its image's default user"
			continue
		case *uid < 0 || *uid >= math.MaxUint32:
			d.Via, d.Why = Refused, fmt.Sprintf("runs as UID %d, which is not a valid UID", *uid)
			d.note = e.refuse(c.Name, d.Why, "set securityContext.runAsUser to a UID from 1 to 4294967294")
		case uint32(*uid) == cfg.Proxy.UID:
			d.Via, d.ID = ViaProxyUID, cfg.Proxy.UID
			d.note = fmt.Sprintf(
				"detour: init container %q runs as the proxy's UID %d, whose traffic is never redirected; it keeps egress", c.Name, *uid)
		default:
			reason := uidConflict(*uid, inherited(c), podDefaultUID(pod), cfg, others)
			if exempt := e.ids(ViaUID); reason == "" && len(exempt) >= annotations.MaxListItems && !slices.Contains(exempt, uint32(*uid)) {
				reason = fmt.Sprintf("runs as UID %d, and %d other UIDs are exempt already", *uid, annotations.MaxListItems)
			}
			if reason != "" {
				needGID = append(needGID, i)
				why[i] = reason
				continue
			}
			d.Via, d.ID = ViaUID, uint32(*uid)
			d.note = fmt.Sprintf("detour: init container %q runs as UID %d; it keeps egress as UID %d", c.Name, *uid, *uid)
		}
		e.decisions = append(e.decisions, d)
	}
	return needGID, why
}

// assignGIDs is the second pass: dedicated GIDs, lowest free first in init-container order, so
// the same pod always gets the same GIDs.
func (e *exemptions) assignGIDs(pod *corev1.Pod, cfg *Config, needGID []int, why map[int]string) {
	used := usedGIDs(pod, cfg, needGID)
	next := cfg.GIDRange.First
	for _, i := range needGID {
		c := &pod.Spec.InitContainers[i]
		d := decision{Decision: Decision{Container: c.Name, Why: why[i]}, index: i}
		for next <= cfg.GIDRange.Last && used[next] {
			next++
		}
		if next > cfg.GIDRange.Last || len(e.ids(ViaGID)) >= annotations.MaxListItems {
			d.Via = Refused
			d.Why = fmt.Sprintf("%s, and no dedicated GID is left in the reserved range %s", why[i], cfg.GIDRange)
			d.note = e.refuse(c.Name, d.Why, "give the init container a non-root UID that no app container uses, or ask the cluster admin to widen gidRange")
		} else {
			d.Via, d.ID = ViaGID, next
			used[next] = true
			d.note = fmt.Sprintf("detour: init container %q %s; it keeps egress through GID %d", c.Name, why[i], next)
		}
		e.decisions = append(e.decisions, d)
	}
}

// refuse records the denial reason (used under conflictPolicy deny) for an init container that
// cannot keep egress, and returns the warning (used under warn).
func (e *exemptions) refuse(name, why, fix string) string {
	w := fmt.Sprintf(
		"detour: init container %q %s, so detour cannot let it reach the network before the proxy starts and its outbound TCP connections will fail; to fix it, %s",
		name, why, fix)
	e.refusals = append(e.refusals, fmt.Sprintf(
		"init container %q needs network access before the proxy starts, but it %s; to fix the pod, %s, or leave it out of %s",
		name, why, fix, annotations.InitEgress))
	return w
}

// inherited reports whether an init container's UID comes only from the pod's default.
func inherited(c *corev1.Container) bool {
	return c.SecurityContext == nil || c.SecurityContext.RunAsUser == nil
}

// podDefaultUID is the pod's securityContext.runAsUser, nil when unset: what containers added
// later (kubectl debug ephemeral containers) run as.
func podDefaultUID(pod *corev1.Pod) *int64 {
	if pod.Spec.SecurityContext == nil {
		return nil
	}
	return pod.Spec.SecurityContext.RunAsUser
}

// uidConflict says why uid cannot be exempt, or "" when it can. fromPod says the UID comes
// only from the pod's default, podUID is that default.
func uidConflict(uid int64, fromPod bool, podUID *int64, cfg *Config, others []other) string {
	if uid == 0 {
		return "runs as root"
	}
	if fromPod {
		return fmt.Sprintf("inherits UID %d from the pod's securityContext.runAsUser, which containers added later (kubectl debug) inherit too", uid)
	}
	if podUID != nil && *podUID == uid {
		return fmt.Sprintf("runs as UID %d, the pod's securityContext.runAsUser, which containers added later (kubectl debug) inherit", uid)
	}
	if uint32(uid) == cfg.Validator.UID {
		return fmt.Sprintf("runs as UID %d, the validator's UID, which is never exempt", uid)
	}
	for _, o := range others {
		if o.uid != nil && *o.uid == uid {
			return fmt.Sprintf("runs as UID %d, which %s also uses", uid, o.what)
		}
	}
	for _, o := range others {
		if o.uid == nil {
			return fmt.Sprintf("runs as UID %d, and %s runs as its image's user, which could be the same", uid, o.what)
		}
	}
	return ""
}

// usedGIDs is every GID a container of the pod other than those in needGID may run with:
// their runAsGroup (or the pod's), the pod's fsGroup and supplementalGroups, and the proxy's
// and the validator's GIDs; and every explicit UID in the pod (the pod's runAsUser, each
// container's, the proxy's and the validator's), since images commonly give user N the
// primary group N. A dedicated GID must be none of them.
func usedGIDs(pod *corev1.Pod, cfg *Config, needGID []int) map[uint32]bool {
	used := map[uint32]bool{cfg.Proxy.GID: true, cfg.Validator.GID: true, cfg.Proxy.UID: true, cfg.Validator.UID: true}
	add := func(g *int64) {
		if g != nil && *g >= 0 && *g < math.MaxUint32 {
			used[uint32(*g)] = true
		}
	}
	if sc := pod.Spec.SecurityContext; sc != nil {
		add(sc.RunAsUser)
		add(sc.RunAsGroup)
		add(sc.FSGroup)
		for _, g := range sc.SupplementalGroups {
			add(&g)
		}
	}
	for i := range pod.Spec.Containers {
		add(EffectiveGID(pod, &pod.Spec.Containers[i]))
		add(EffectiveUID(pod, &pod.Spec.Containers[i]))
	}
	for i := range pod.Spec.InitContainers {
		add(EffectiveUID(pod, &pod.Spec.InitContainers[i]))
		if !slices.Contains(needGID, i) {
			add(EffectiveGID(pod, &pod.Spec.InitContainers[i]))
		}
	}
	return used
}

// runsAsProxy reports whether container c runs as the proxy's UID, whose traffic is never
// redirected.
func runsAsProxy(pod *corev1.Pod, c *corev1.Container, cfg *Config) bool {
	uid := EffectiveUID(pod, c)
	return uid != nil && *uid == int64(cfg.Proxy.UID)
}

// proxyUIDConflicts records, as a warning and as a refusal (used under conflictPolicy deny),
// each container that must stay redirected but runs as the proxy's UID, so that its traffic is
// never redirected: an app container, a user sidecar, an init container that starts behind the
// proxy (native mode) or that detour.dev/init-egress leaves out. Call it after the decisions.
func (e *exemptions) proxyUIDConflicts(pod *corev1.Pod, cfg *Config) {
	check := func(what string, c *corev1.Container) {
		if c.Name == annotations.ProxyContainer || !runsAsProxy(pod, c, cfg) {
			return
		}
		e.warnings = append(e.warnings, fmt.Sprintf(
			"detour: %s runs as the proxy's UID %d, so its traffic is never redirected to the proxy; run it as another UID", what, cfg.Proxy.UID))
		e.refusals = append(e.refusals, fmt.Sprintf(
			"%s runs as the proxy's UID %d, so its traffic would bypass the proxy; to fix the pod, set its securityContext.runAsUser to another UID", what, cfg.Proxy.UID))
	}
	for i := range pod.Spec.Containers {
		c := &pod.Spec.Containers[i]
		check(fmt.Sprintf("app container %q", c.Name), c)
	}
	for _, d := range e.decisions {
		c := &pod.Spec.InitContainers[d.index]
		switch d.Via {
		case Sidecar:
			check(fmt.Sprintf("sidecar %q", c.Name), c)
		case ViaProxy:
			check(fmt.Sprintf("init container %q, which starts after the proxy,", c.Name), c)
		case NotSelected:
			check(fmt.Sprintf("init container %q, which %s leaves out,", c.Name, annotations.InitEgress), c)
		}
	}
}
