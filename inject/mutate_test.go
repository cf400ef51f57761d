package inject

import (
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/internal/version"
	"github.com/detourmesh/detour/test/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// testConfig is the configuration of the table tests: defaults, a proxy image, and the
// changes of the case.
func testConfig(t testing.TB, yaml string) *Config {
	t.Helper()
	cfg, err := ParseConfig([]byte("proxy: {image: proxy:test}\n" + yaml))
	if err != nil {
		t.Fatalf("ParseConfig: %v", err)
	}
	return cfg
}

// container builds a container; uid and gid < 0 mean unset.
func container(name string, uid, gid int64) corev1.Container {
	c := corev1.Container{Name: name, Image: name + ":1"}
	if uid >= 0 || gid >= 0 {
		c.SecurityContext = &corev1.SecurityContext{}
		if uid >= 0 {
			c.SecurityContext.RunAsUser = ptr(uid)
		}
		if gid >= 0 {
			c.SecurityContext.RunAsGroup = ptr(gid)
		}
	}
	return c
}

const unset = -1

type podOpt func(*corev1.Pod)

func inits(cs ...corev1.Container) podOpt {
	return func(p *corev1.Pod) { p.Spec.InitContainers = append(p.Spec.InitContainers, cs...) }
}

func apps(cs ...corev1.Container) podOpt {
	return func(p *corev1.Pod) { p.Spec.Containers = cs }
}

func annotate(kv ...string) podOpt {
	return func(p *corev1.Pod) {
		if p.Annotations == nil {
			p.Annotations = map[string]string{}
		}
		for i := 0; i+1 < len(kv); i += 2 {
			p.Annotations[kv[i]] = kv[i+1]
		}
	}
}

func podSecurity(sc corev1.PodSecurityContext) podOpt {
	return func(p *corev1.Pod) { p.Spec.SecurityContext = &sc }
}

func newPod(opts ...podOpt) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "shop"},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{container("app", 1000, unset)}},
	}
	for _, o := range opts {
		o(p)
	}
	return p
}

var optedIn = map[string]string{annotations.Inject: "enabled"}

// want is the expected outcome of one table case; zero fields are not checked.
type want struct {
	outcome    Outcome
	reason     string
	mode       annotations.SidecarModeValue
	uids, gids *string           // the exempt-uids and exempt-gids annotations (nil: not checked)
	runAsGroup map[string]int64  // init container → runAsGroup after the mutation (-1: none)
	vias       map[string]Via    // init container → decision
	warnings   []string          // substrings, each in some warning
	noWarning  []string          // substrings that no warning may hold
	annots     map[string]string // further annotations the pod must carry
	denial     []string          // substrings of the denial; the case must be denied
}

func TestMutate(t *testing.T) {
	for _, tc := range []struct {
		name   string
		cfg    string // YAML added to the test configuration
		pod    *corev1.Pod
		ns     map[string]string // namespace annotations (default: opted in)
		native bool              // the cluster runs native sidecars
		want   want
	}{
		{
			name: "no init containers",
			pod:  newPod(),
			want: want{outcome: Injected, mode: annotations.SidecarContainer, uids: ids(""), gids: ids(""),
				annots: map[string]string{annotations.InitEgressStatus: "container: no init containers"}},
		},
		{
			name: "explicit non-root UIDs are exempt by UID",
			pod:  newPod(inits(container("fetch", 1001, unset), container("migrate", 1002, unset))),
			want: want{outcome: Injected, mode: annotations.SidecarContainer, uids: ids("1001,1002"), gids: ids(""),
				vias:     map[string]Via{"fetch": ViaUID, "migrate": ViaUID},
				warnings: []string{`init container "fetch" runs as UID 1001; it keeps egress as UID 1001`}},
		},
		{
			name: "image-default user in container mode: a dedicated GID, the image's user kept",
			cfg:  "sidecarMode: container",
			pod:  newPod(inits(container("fetch", unset, unset))),
			want: want{outcome: Injected, mode: annotations.SidecarContainer, uids: ids(""), gids: ids("2600"),
				vias:       map[string]Via{"fetch": ViaGID},
				runAsGroup: map[string]int64{"fetch": 2600},
				warnings:   []string{`init container "fetch" runs as its image's default user; it keeps egress through GID 2600`},
				noWarning:  []string{"set securityContext.runAsUser"},
				annots:     map[string]string{annotations.InitEgressStatus: "container: fetch gid 2600 (runs as its image's default user)"}},
		},
		{
			name:   "image-default UID in auto mode on a 1.29+ server: native sidecar",
			pod:    newPod(inits(container("fetch", unset, unset))),
			native: true,
			want: want{outcome: Injected, mode: annotations.SidecarNative, uids: ids(""), gids: ids(""),
				vias:       map[string]Via{"fetch": ViaProxy},
				runAsGroup: map[string]int64{"fetch": unset},
				warnings:   []string{`the proxy runs as a native sidecar, so init container "fetch" starts after it`},
				noWarning:  []string{"runAsUser"}},
		},
		{
			name: "image-default user in auto mode on an older server: container mode and a dedicated GID",
			pod:  newPod(inits(container("fetch", unset, unset))),
			want: want{outcome: Injected, mode: annotations.SidecarContainer, vias: map[string]Via{"fetch": ViaGID},
				runAsGroup: map[string]int64{"fetch": 2600}},
		},
		{
			name: "image-default user under deny: admitted with a dedicated GID",
			cfg:  "conflictPolicy: deny\nsidecarMode: container",
			pod:  newPod(inits(container("fetch", unset, unset))),
			want: want{outcome: Injected, gids: ids("2600"), vias: map[string]Via{"fetch": ViaGID}},
		},
		{
			name: "a UID inherited from the pod's runAsUser is exempted through a GID, never by UID (kubectl debug inherits it)",
			pod: newPod(podSecurity(corev1.PodSecurityContext{RunAsUser: ptr(int64(1200))}),
				inits(container("fetch", unset, unset)), apps(container("app", 1000, unset))),
			want: want{uids: ids(""), gids: ids("2600"), vias: map[string]Via{"fetch": ViaGID}, runAsGroup: map[string]int64{"fetch": 2600},
				warnings: []string{`init container "fetch" inherits UID 1200 from the pod's securityContext.runAsUser, which containers added later (kubectl debug) inherit too; it keeps egress through GID 2600`}},
		},
		{
			name: "an init container's own UID equal to the pod's runAsUser is exempted through a GID",
			pod: newPod(podSecurity(corev1.PodSecurityContext{RunAsUser: ptr(int64(1200))}),
				inits(container("fetch", 1200, unset)), apps(container("app", 1000, unset))),
			want: want{uids: ids(""), gids: ids("2600"), vias: map[string]Via{"fetch": ViaGID},
				warnings: []string{`runs as UID 1200, the pod's securityContext.runAsUser`}},
		},
		{
			name: "a dedicated GID never equals another container's UID (uid N commonly has group N)",
			pod:  newPod(inits(container("migrate", 0, unset)), apps(container("app", 2600, unset))),
			want: want{gids: ids("2601"), runAsGroup: map[string]int64{"migrate": 2601}},
		},
		{
			name: "a dedicated GID avoids the pod's runAsUser and every init container's UID",
			pod: newPod(podSecurity(corev1.PodSecurityContext{RunAsUser: ptr(int64(2600))}),
				inits(container("a", 0, unset), container("b", 2601, unset), container("c", 0, unset)), apps(container("app", 1000, unset))),
			want: want{uids: ids("2601"), gids: ids("2602,2603"), runAsGroup: map[string]int64{"a": 2602, "c": 2603}},
		},
		{
			name:   "a Job's pod in container mode is warned that it never completes",
			cfg:    "sidecarMode: container",
			pod:    func() *corev1.Pod { p := newPod(); p.Spec.RestartPolicy = corev1.RestartPolicyNever; return p }(),
			native: true,
			want: want{mode: annotations.SidecarContainer, warnings: []string{
				"the pod's restartPolicy is Never (a Job or CronJob runs such pods), and the proxy runs as a regular container that does not exit, so the pod never completes",
				"annotate the pod detour.dev/sidecar-mode: native"}},
		},
		{
			name: "a Job's pod in auto mode on an older cluster is warned, with the upgrade as the fix",
			pod:  func() *corev1.Pod { p := newPod(); p.Spec.RestartPolicy = corev1.RestartPolicyOnFailure; return p }(),
			want: want{mode: annotations.SidecarContainer, warnings: []string{"restartPolicy is OnFailure", "Kubernetes 1.29 or later"}},
		},
		{
			name:   "a Job's pod in auto mode gets the native sidecar where the cluster has it",
			pod:    func() *corev1.Pod { p := newPod(); p.Spec.RestartPolicy = corev1.RestartPolicyNever; return p }(),
			native: true,
			want:   want{mode: annotations.SidecarNative, noWarning: []string{"never completes"}},
		},
		{
			name: "a long-running pod in container mode gets no completion warning",
			cfg:  "sidecarMode: container",
			pod:  newPod(),
			want: want{mode: annotations.SidecarContainer, noWarning: []string{"never completes"}},
		},
		{
			name: "root gets a dedicated GID",
			pod:  newPod(inits(container("migrate", 0, unset))),
			want: want{outcome: Injected, uids: ids(""), gids: ids("2600"),
				vias: map[string]Via{"migrate": ViaGID}, runAsGroup: map[string]int64{"migrate": 2600},
				warnings: []string{`detour: init container "migrate" runs as root; it keeps egress through GID 2600`},
				annots:   map[string]string{annotations.InitEgressStatus: "container: migrate gid 2600 (runs as root)"}},
		},
		{
			name: "root with its own runAsGroup 0: the group is replaced",
			pod:  newPod(inits(container("migrate", 0, 0))),
			want: want{gids: ids("2600"), runAsGroup: map[string]int64{"migrate": 2600}},
		},
		{
			name: "UID shared with an app container gets a dedicated GID",
			pod:  newPod(inits(container("fetch", 1000, unset))),
			want: want{uids: ids(""), gids: ids("2600"), vias: map[string]Via{"fetch": ViaGID},
				warnings: []string{`runs as UID 1000, which app container "app" also uses; it keeps egress through GID 2600`}},
		},
		{
			name: "app container with the image's user: the UID is not provably unique, so a GID",
			pod:  newPod(inits(container("fetch", 1001, unset)), apps(container("app", unset, unset))),
			want: want{uids: ids(""), gids: ids("2600"), vias: map[string]Via{"fetch": ViaGID},
				warnings: []string{`app container "app" runs as its image's user`}},
		},
		{
			name: "pod-level runAsUser is inherited by init and app containers",
			pod: newPod(podSecurity(corev1.PodSecurityContext{RunAsUser: ptr(int64(1000))}),
				inits(container("fetch", unset, unset)), apps(container("app", unset, unset))),
			want: want{uids: ids(""), gids: ids("2600"), vias: map[string]Via{"fetch": ViaGID},
				runAsGroup: map[string]int64{"fetch": 2600}},
		},
		{
			name: "pod-level runAsUser for the apps, the init container's own UID is exempt",
			pod: newPod(podSecurity(corev1.PodSecurityContext{RunAsUser: ptr(int64(1000))}),
				inits(container("fetch", 999, unset)), apps(container("app", unset, unset))),
			want: want{uids: ids("999"), gids: ids(""), vias: map[string]Via{"fetch": ViaUID}},
		},
		{
			name: "pod-level root is inherited: dedicated GID",
			pod: newPod(podSecurity(corev1.PodSecurityContext{RunAsUser: ptr(int64(0))}),
				inits(container("setup", unset, unset)), apps(container("app", 1000, unset))),
			want: want{gids: ids("2600"), runAsGroup: map[string]int64{"setup": 2600}, warnings: []string{`"setup" runs as root`}},
		},
		{
			name: "dedicated GIDs avoid every GID the pod uses",
			pod: newPod(
				podSecurity(corev1.PodSecurityContext{FSGroup: ptr(int64(2600)), SupplementalGroups: []int64{2602}, RunAsGroup: ptr(int64(2603))}),
				inits(container("a", 0, unset), container("b", 0, unset), container("c", 1500, 2601)),
				apps(container("app", 1000, 2604))),
			want: want{uids: ids("1500"), gids: ids("2605,2606"), runAsGroup: map[string]int64{"a": 2605, "b": 2606, "c": 2601}},
		},
		{
			name: "the validator's UID is never exempt",
			pod:  newPod(inits(container("fetch", DefaultValidatorUID, unset))),
			want: want{uids: ids(""), gids: ids("2600"), warnings: []string{"the validator's UID, which is never exempt"}},
		},
		{
			name: "the proxy's UID needs no exemption",
			pod:  newPod(inits(container("fetch", DefaultProxyUID, unset))),
			want: want{uids: ids(""), gids: ids(""), vias: map[string]Via{"fetch": ViaProxyUID}},
		},
		{
			name: "init-egress none: nothing is exempt",
			pod:  newPod(annotate(annotations.InitEgress, "none"), inits(container("fetch", 1001, unset), container("migrate", 0, unset))),
			want: want{uids: ids(""), gids: ids(""), vias: map[string]Via{"fetch": NotSelected, "migrate": NotSelected},
				runAsGroup: map[string]int64{"migrate": unset},
				warnings:   []string{`init container "fetch" is not selected by detour.dev/init-egress="none"`}},
		},
		{
			name: "init-egress names a subset; a non-selected container sharing a UID forces a GID",
			pod: newPod(annotate(annotations.InitEgress, "migrate,ghost"),
				inits(container("fetch", 1001, unset), container("migrate", 1001, unset))),
			want: want{uids: ids(""), gids: ids("2600"), vias: map[string]Via{"fetch": NotSelected, "migrate": ViaGID},
				warnings: []string{`names "ghost", which is not an init container`, `init container "fetch" (not selected) also uses`}},
		},
		{
			name: "init-egress from the namespace, the pod's value wins",
			pod:  newPod(annotate(annotations.InitEgress, "fetch"), inits(container("fetch", 1001, unset), container("migrate", 1002, unset))),
			ns:   map[string]string{annotations.Inject: "enabled", annotations.InitEgress: "none"},
			want: want{uids: ids("1001"), vias: map[string]Via{"fetch": ViaUID, "migrate": NotSelected}},
		},
		{
			name: "init-egress default from the configuration",
			cfg:  "initEgress: migrate",
			pod:  newPod(inits(container("fetch", 1001, unset), container("migrate", 1002, unset))),
			want: want{uids: ids("1002"), vias: map[string]Via{"fetch": NotSelected, "migrate": ViaUID},
				warnings: []string{"(from the webhook configuration)"}},
		},
		{
			name:   "native mode from the configuration",
			cfg:    "sidecarMode: native",
			pod:    newPod(inits(container("migrate", 0, unset))),
			native: true,
			want: want{mode: annotations.SidecarNative, uids: ids(""), gids: ids(""), runAsGroup: map[string]int64{"migrate": unset},
				vias: map[string]Via{"migrate": ViaProxy}, annots: map[string]string{annotations.InitEgressStatus: "native: migrate after the proxy"}},
		},
		{
			name:   "container mode by pod annotation on a native-capable cluster",
			pod:    newPod(annotate(annotations.SidecarMode, "container"), inits(container("migrate", 0, unset))),
			native: true,
			want:   want{mode: annotations.SidecarContainer, gids: ids("2600")},
		},
		{
			name: "native requested on an old cluster falls back to container mode",
			pod:  newPod(annotate(annotations.SidecarMode, "native"), inits(container("migrate", 0, unset))),
			want: want{mode: annotations.SidecarContainer, gids: ids("2600"), warnings: []string{"needs native sidecars (Kubernetes 1.29 or later)"}},
		},
		{
			name: "a user sidecar is never exempt and counts as an app container",
			pod: newPod(inits(func() corev1.Container {
				c := container("logs", 1001, unset)
				c.RestartPolicy = ptr(corev1.ContainerRestartPolicyAlways)
				return c
			}(), container("fetch", 1001, unset))),
			want: want{uids: ids(""), gids: ids("2600"), vias: map[string]Via{"logs": Sidecar, "fetch": ViaGID},
				warnings: []string{`sidecar "logs" also uses`}},
		},
		{
			name: "user-forged webhook annotations are overwritten",
			pod: newPod(inits(container("fetch", 1001, unset)), annotate(
				annotations.Injected, "v9", annotations.ExemptUIDs, "1000,0", annotations.ExemptGIDs, "2600",
				annotations.ProxyUID, "1000", annotations.RedirectSkipOutboundCIDRs, "0.0.0.0/0",
				annotations.InitEgressStatus, "forged")),
			want: want{uids: ids("1001"), gids: ids(""), annots: map[string]string{
				annotations.Injected: version.Version, annotations.ProxyUID: "2102", annotations.InitEgressStatus: "container: fetch uid 1001"}},
		},
		{
			name: "skip lists: namespace and pod merged per key, admin ports added, ranges merged",
			pod: newPod(annotate(annotations.SkipInboundPorts, "8080,4190,9000-9010,9005-9020",
				annotations.SkipOutboundCIDRs, "10.0.0.0/8,fd00::/8,10.0.0.0/8")),
			ns: map[string]string{annotations.Inject: "enabled", annotations.SkipInboundPorts: "1",
				annotations.SkipOutboundPorts: "3306,25", annotations.SkipOutboundCIDRs: "192.168.0.0/16"},
			want: want{annots: map[string]string{
				annotations.RedirectSkipInboundPorts:  "4190-4191,8080,9000-9020",
				annotations.RedirectSkipOutboundPorts: "25,3306",
				annotations.RedirectSkipOutboundCIDRs: "10.0.0.0/8,fd00::/8"}},
		},
		{
			name: "skip lists that cover the validator's probe: the probe is named for the plugin to redirect first",
			pod:  newPod(annotate(annotations.SkipOutboundPorts, "80", annotations.SkipOutboundCIDRs, "0.0.0.0/0,::/0")),
			want: want{annots: map[string]string{
				annotations.RedirectSkipOutboundPorts: "80",
				annotations.ValidatorSentinels:        "203.0.113.254:80,[2001:db8::fe]:80"}},
		},
		{
			name: "a malformed pod annotation is denied, naming it",
			pod:  newPod(annotate(annotations.SkipOutboundPorts, "25,smtp")),
			want: want{denial: []string{annotations.SkipOutboundPorts, `"smtp" is not valid`, "fix the pod's annotation"}},
		},
		{
			name: "a malformed namespace annotation is denied, naming the namespace",
			pod:  newPod(),
			ns:   map[string]string{annotations.Inject: "enabled", annotations.SidecarMode: "sidecar"},
			want: want{denial: []string{`namespace "shop"`, annotations.SidecarMode, "fix the annotation on the namespace"}},
		},
		{
			name: "inject: true is denied with the accepted values",
			pod:  newPod(annotate(annotations.Inject, "true")),
			ns:   map[string]string{},
			want: want{denial: []string{`use "enabled" or "disabled"`}},
		},
		{name: "not opted in", pod: newPod(), ns: map[string]string{}, want: want{outcome: Skipped, reason: SkipNotEnabled}},
		{
			name: "a skipped pod loses forged webhook annotations",
			pod: newPod(annotate(annotations.Injected, "v0.1.0", annotations.ExemptUIDs, "1000",
				annotations.RedirectSkipOutboundCIDRs, "0.0.0.0/0", "team", "shop")),
			ns:   map[string]string{},
			want: want{outcome: Skipped, reason: SkipNotEnabled},
		},
		{
			name: "an opted-out pod loses forged webhook annotations",
			pod:  newPod(annotate(annotations.Inject, "disabled", annotations.Injected, "v0.1.0", annotations.ProxyUID, "1000")),
			want: want{outcome: Skipped, reason: SkipDisabled},
		},
		{name: "pod opts in without the namespace", pod: newPod(annotate(annotations.Inject, "enabled")), ns: map[string]string{},
			want: want{outcome: Injected}},
		{name: "defaultInject enabled: a pod of a namespace without the annotation is injected", cfg: "defaultInject: enabled",
			pod: newPod(), ns: map[string]string{}, want: want{outcome: Injected}},
		{name: "defaultInject enabled: a namespace opts out", cfg: "defaultInject: enabled",
			pod: newPod(), ns: map[string]string{annotations.Inject: "disabled"}, want: want{outcome: Skipped, reason: SkipDisabled}},
		{name: "defaultInject enabled: a pod opts out", cfg: "defaultInject: enabled",
			pod: newPod(annotate(annotations.Inject, "disabled")), ns: map[string]string{}, want: want{outcome: Skipped, reason: SkipDisabled}},
		{name: "defaultInject enabled: a pod opts in again in an opted-out namespace", cfg: "defaultInject: enabled",
			pod: newPod(annotate(annotations.Inject, "enabled")), ns: map[string]string{annotations.Inject: "disabled"}, want: want{outcome: Injected}},
		{name: "defaultInject enabled: the excluded namespaces stay out", cfg: "defaultInject: enabled\nexcludeNamespaces: [shop]",
			pod: newPod(), ns: map[string]string{}, want: want{outcome: Skipped, reason: SkipExcludedNamespace}},
		{name: "defaultInject enabled: host-network pods stay out", cfg: "defaultInject: enabled",
			pod: func() *corev1.Pod { p := newPod(); p.Spec.HostNetwork = true; return p }(), ns: map[string]string{},
			want: want{outcome: Skipped, reason: SkipHostNetwork}},
		{name: "defaultInject disabled, said explicitly: not opted in", cfg: "defaultInject: disabled",
			pod: newPod(), ns: map[string]string{}, want: want{outcome: Skipped, reason: SkipNotEnabled}},
		{name: "pod opts out of an opted-in namespace", pod: newPod(annotate(annotations.Inject, "disabled")),
			want: want{outcome: Skipped, reason: SkipDisabled}},
		{
			name: "an injected pod created where detour does not inject loses detour's containers",
			pod: newPod(annotate(annotations.Injected, "v0.1.0", annotations.ProxyUID, "2102"),
				inits(container(annotations.ValidatorContainer, DefaultValidatorUID, unset), container("fetch", 1001, unset)),
				apps(container("app", 1000, unset), container(annotations.ProxyContainer, DefaultProxyUID, unset))),
			ns: map[string]string{},
			want: want{outcome: Skipped, reason: SkipNotEnabled, warnings: []string{
				`the pod is not injected (not-enabled), so detour removed its containers "detour-validator", "detour-proxy"`}},
		},
		{
			name: "an opted-out pod loses detour's native proxy and validator",
			pod: newPod(annotate(annotations.Inject, "disabled"),
				inits(container(annotations.ValidatorContainer, DefaultValidatorUID, unset), container(annotations.ProxyContainer, DefaultProxyUID, unset))),
			want: want{outcome: Skipped, reason: SkipDisabled, warnings: []string{"removed its containers"}},
		},
		{
			name: "a hostNetwork pod loses detour's containers, and is told detour never injects it",
			pod: func() *corev1.Pod {
				p := newPod(annotate(annotations.Injected, "v0.1.0"), inits(container(annotations.ValidatorContainer, DefaultValidatorUID, unset)))
				p.Spec.HostNetwork = true
				return p
			}(),
			want: want{outcome: Skipped, reason: SkipHostNetwork, warnings: []string{`so detour removed its containers "detour-validator"`, "detour never injects such a pod"},
				noWarning: []string{"opt the namespace"}},
		},
		{
			name: "a misspelt key is named with the key meant, on an injected pod",
			pod:  newPod(annotate("detour.dev/skip-outbound-port", "5432")),
			want: want{outcome: Injected, warnings: []string{
				`the pod's annotations "detour.dev/skip-outbound-port" (did you mean detour.dev/skip-outbound-ports?) are not ones detour reads, so they have no effect`}},
		},
		{
			name: "a misspelt opt-in on the namespace is named on the pod it did not opt in",
			pod:  newPod(),
			ns:   map[string]string{"detour.dev/injet": "enabled"},
			want: want{outcome: Skipped, reason: SkipNotEnabled, warnings: []string{
				`the annotations "detour.dev/injet" (did you mean detour.dev/inject?) of namespace "shop" are not ones detour reads`}},
		},
		{
			name: "forged webhook keys and repair's key are known, not reported",
			pod:  newPod(annotate(annotations.ExemptUIDs, "1000", annotations.RecreateRequired, "x")),
			want: want{outcome: Injected, uids: ids(""), noWarning: []string{"not ones detour reads"}},
		},
		{
			name: "an excluded namespace with a malformed inject value is skipped, not denied",
			cfg:  "excludeNamespaces: [shop]",
			pod:  newPod(),
			ns:   map[string]string{annotations.Inject: "yes"},
			want: want{outcome: Skipped, reason: SkipExcludedNamespace},
		},
		{
			name: "a hostNetwork pod with a malformed inject value is skipped, not denied",
			pod: func() *corev1.Pod {
				p := newPod(annotate(annotations.Inject, "true"))
				p.Spec.HostNetwork = true
				return p
			}(),
			want: want{outcome: Skipped, reason: SkipHostNetwork},
		},
		{
			name: "a user container with a reserved name is replaced with a warning",
			pod:  newPod(apps(container("app", 1000, unset), container(annotations.ProxyContainer, 1000, unset))),
			want: want{outcome: Injected, warnings: []string{`the pod's container "detour-proxy" has a name detour reserves`}},
		},
		{
			name: "re-injecting an injected pod gives no reserved-name warning",
			pod:  newPod(annotate(annotations.Injected, "v0.1.0"), apps(container("app", 1000, unset), container(annotations.ProxyContainer, DefaultProxyUID, unset))),
			want: want{outcome: Injected, noWarning: []string{"reserves"}},
		},
		{name: "host network", pod: func() *corev1.Pod { p := newPod(); p.Spec.HostNetwork = true; return p }(),
			want: want{outcome: Skipped, reason: SkipHostNetwork}},
		{name: "detour's own pods", pod: func() *corev1.Pod { p := newPod(); p.Labels = map[string]string{PartOfLabel: PartOfValue}; return p }(),
			want: want{outcome: Skipped, reason: SkipDetourPod}},
		{name: "excluded namespace", cfg: "excludeNamespaces: [shop]", pod: newPod(),
			want: want{outcome: Skipped, reason: SkipExcludedNamespace}},
		{name: "windows pods", pod: func() *corev1.Pod { p := newPod(); p.Spec.OS = &corev1.PodOS{Name: corev1.Windows}; return p }(),
			want: want{outcome: Skipped, reason: SkipWindows}},
		{
			name: "GID range exhausted: refused",
			cfg:  "gidRange: {first: 2600, last: 2600}",
			pod:  newPod(inits(container("a", 0, unset), container("b", 0, unset))),
			want: want{gids: ids("2600"), vias: map[string]Via{"a": ViaGID, "b": Refused}, runAsGroup: map[string]int64{"b": unset},
				warnings: []string{"no dedicated GID is left in the reserved range 2600-2600"}},
		},
		{
			name: "an app container running as the proxy UID is reported",
			pod:  newPod(apps(container("app", DefaultProxyUID, unset))),
			want: want{warnings: []string{`app container "app" runs as the proxy's UID 2102, so its traffic is never redirected`}},
		},
		{
			name: "an app container running as the proxy UID is denied under deny",
			cfg:  "conflictPolicy: deny",
			pod:  newPod(podSecurity(corev1.PodSecurityContext{RunAsUser: ptr(int64(DefaultProxyUID))}), apps(container("app", unset, unset))),
			want: want{denial: []string{`app container "app" runs as the proxy's UID 2102`, "set its securityContext.runAsUser to another UID"}},
		},
		{
			name:   "native mode: an init container behind the proxy running as the proxy UID is reported",
			native: true,
			pod:    newPod(inits(container("migrate", DefaultProxyUID, unset), container("fetch", 1000, unset))),
			want: want{mode: annotations.SidecarNative,
				warnings:  []string{`init container "migrate", which starts after the proxy, runs as the proxy's UID 2102, so its traffic is never redirected`, `init container "fetch" starts after it`},
				noWarning: []string{`"migrate" starts after it`}},
		},
		{
			name:   "native mode: an init container behind the proxy running as the proxy UID is denied under deny",
			cfg:    "conflictPolicy: deny",
			native: true,
			pod:    newPod(podSecurity(corev1.PodSecurityContext{RunAsUser: ptr(int64(DefaultProxyUID))}), inits(container("migrate", unset, unset)), apps(container("app", 1000, unset))),
			want:   want{denial: []string{`init container "migrate", which starts after the proxy, runs as the proxy's UID 2102, so its traffic would bypass the proxy`}},
		},
		{
			name: "an init container left out of init-egress running as the proxy UID is reported, not said to fail",
			pod:  newPod(annotate(annotations.InitEgress, "fetch"), inits(container("migrate", DefaultProxyUID, unset), container("fetch", 1000, unset))),
			want: want{vias: map[string]Via{"migrate": NotSelected, "fetch": ViaGID},
				warnings:  []string{`init container "migrate", which detour.dev/init-egress leaves out, runs as the proxy's UID 2102`},
				noWarning: []string{`"migrate" is not selected`}},
		},
		{
			name: "an init container left out of init-egress running as the proxy UID is denied under deny",
			cfg:  "conflictPolicy: deny",
			pod:  newPod(annotate(annotations.InitEgress, "none"), inits(container("migrate", DefaultProxyUID, unset))),
			want: want{denial: []string{`init container "migrate", which detour.dev/init-egress leaves out, runs as the proxy's UID 2102, so its traffic would bypass the proxy`}},
		},
		{
			// Its rules are written with nftables (auto's choice in a fresh namespace), which the
			// kernel accepts from outside the pod's user namespace.
			name: "a pod with a user namespace of its own is injected as usual",
			pod: func() *corev1.Pod {
				p := newPod()
				p.Spec.HostUsers = ptr(false)
				return p
			}(),
			want: want{outcome: Injected, mode: annotations.SidecarContainer, uids: ids(""), gids: ids("")},
		},
		{
			name: "hostUsers: true is injected as usual",
			pod: func() *corev1.Pod {
				p := newPod()
				p.Spec.HostUsers = ptr(true)
				return p
			}(),
			want: want{outcome: Injected, mode: annotations.SidecarContainer, uids: ids(""), gids: ids("")},
		},
		{
			name: "a user-namespaced pod in a namespace that is not opted in is skipped",
			ns:   map[string]string{},
			pod: func() *corev1.Pod {
				p := newPod()
				p.Spec.HostUsers = ptr(false)
				return p
			}(),
			want: want{outcome: Skipped},
		},
		{
			name:   "a sidecar running as the proxy UID is denied under deny, in native mode too",
			cfg:    "conflictPolicy: deny",
			native: true,
			pod: newPod(inits(func() corev1.Container {
				c := container("log-shipper", DefaultProxyUID, unset)
				c.RestartPolicy = ptr(corev1.ContainerRestartPolicyAlways)
				return c
			}())),
			want: want{denial: []string{`sidecar "log-shipper" runs as the proxy's UID 2102`}},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(t, tc.cfg)
			ns := tc.ns
			if ns == nil {
				ns = optedIn
			}
			pod := tc.pod.DeepCopy()
			res, err := Mutate(pod, Input{NamespaceAnnotations: ns, NativeSidecars: tc.native}, cfg)
			w := tc.want
			if len(w.denial) > 0 {
				var d *DenialError
				if !errors.As(err, &d) {
					t.Fatalf("Mutate error = %v, want a denial", err)
				}
				for _, s := range w.denial {
					if !strings.Contains(err.Error(), s) {
						t.Errorf("denial %q does not say %q", err, s)
					}
				}
				return
			}
			if err != nil {
				t.Fatalf("Mutate: %v", err)
			}
			checkResult(t, tc.pod, pod, res, cfg, w)
		})
	}
}

func checkResult(t *testing.T, before, pod *corev1.Pod, res Result, cfg *Config, w want) {
	t.Helper()
	if w.outcome != "" && res.Outcome != w.outcome {
		t.Fatalf("outcome = %s (%s), want %s", res.Outcome, res.Reason, w.outcome)
	}
	if res.Outcome == Skipped {
		if w.reason != "" && res.Reason != w.reason {
			t.Errorf("skip reason = %s, want %s", res.Reason, w.reason)
		}
		// A skipped pod loses the webhook's annotations and detour's containers, and nothing else.
		before = before.DeepCopy()
		for _, k := range annotations.WebhookKeys {
			delete(before.Annotations, k)
		}
		ours := func(c corev1.Container) bool {
			return c.Name == annotations.ProxyContainer || c.Name == annotations.ValidatorContainer
		}
		before.Spec.InitContainers = slices.DeleteFunc(before.Spec.InitContainers, ours)
		before.Spec.Containers = slices.DeleteFunc(before.Spec.Containers, ours)
		if !reflect.DeepEqual(before, pod) {
			t.Errorf("a skipped pod was changed beyond losing the webhook's annotations")
		}
		for _, k := range annotations.WebhookKeys {
			if v, ok := pod.Annotations[k]; ok {
				t.Errorf("a skipped pod keeps the webhook's annotation %s=%q", k, v)
			}
		}
		return
	}
	if w.mode != "" && res.Mode != w.mode {
		t.Errorf("mode = %s, want %s", res.Mode, w.mode)
	}
	for key, v := range map[string]*string{annotations.ExemptUIDs: w.uids, annotations.ExemptGIDs: w.gids} {
		if got, ok := pod.Annotations[key]; v != nil && got != *v {
			t.Errorf("%s = %q (set: %v), want %q", key, got, ok, *v)
		}
	}
	for k, v := range w.annots {
		if got := pod.Annotations[k]; got != v {
			t.Errorf("annotation %s = %q, want %q", k, got, v)
		}
	}
	vias := map[string]Via{}
	for _, d := range res.Decisions {
		vias[d.Container] = d.Via
	}
	for name, v := range w.vias {
		if vias[name] != v {
			t.Errorf("decision for %q = %q, want %q (all: %+v)", name, vias[name], v, res.Decisions)
		}
	}
	for name, gid := range w.runAsGroup {
		c := find(pod.Spec.InitContainers, name)
		var got int64 = unset
		if c != nil && c.SecurityContext != nil && c.SecurityContext.RunAsGroup != nil {
			got = *c.SecurityContext.RunAsGroup
		}
		if got != gid {
			t.Errorf("init container %q runAsGroup = %d, want %d", name, got, gid)
		}
	}
	all := strings.Join(res.Warnings, "\n")
	for _, s := range w.warnings {
		if !strings.Contains(all, s) {
			t.Errorf("no warning says %q; warnings:\n%s", s, all)
		}
	}
	for _, s := range w.noWarning {
		if strings.Contains(all, s) {
			t.Errorf("a warning says %q; warnings:\n%s", s, all)
		}
	}
	checkInvariants(t, pod, cfg)
}

func ids(s string) *string { return &s }

func find(cs []corev1.Container, name string) *corev1.Container {
	for i := range cs {
		if cs[i].Name == name {
			return &cs[i]
		}
	}
	return nil
}

// checkInvariants holds for every injected pod: the security rules (root, the validator, the
// pod's default identity and every container that must stay redirected are never exempt;
// exempt GIDs come from the reserved range), the container layout, and annotations the plugin
// can read.
func checkInvariants(t *testing.T, pod *corev1.Pod, cfg *Config) {
	t.Helper()
	r, err := annotations.ParseRedirect(pod.Annotations)
	if err != nil {
		t.Fatalf("the plugin cannot read the annotations: %v", err)
	}
	if r.ProxyUID != cfg.Proxy.UID || r.InboundPort != cfg.Proxy.InboundPort || r.OutboundPort != cfg.Proxy.OutboundPort {
		t.Errorf("redirect %+v does not match the proxy configuration", r)
	}
	for _, p := range cfg.Proxy.AdminPorts {
		if !slices.ContainsFunc(r.SkipInboundPorts, func(pr annotations.PortRange) bool { return p >= pr.First && p <= pr.Last }) {
			t.Errorf("admin port %d is not in the inbound skip list %v", p, r.SkipInboundPorts)
		}
	}
	if len(pod.Spec.InitContainers) == 0 || pod.Spec.InitContainers[0].Name != annotations.ValidatorContainer {
		t.Fatalf("the validator is not the first init container")
	}
	v := pod.Spec.InitContainers[0]
	if want := fmt.Sprintf("--port=%d", cfg.Proxy.OutboundPort); !slices.Contains(v.Command, want) || v.Command[0] != "detour" || v.Command[1] != "validate" {
		t.Errorf("validator command %v", v.Command)
	}
	if *v.SecurityContext.RunAsUser != int64(cfg.Validator.UID) || !*v.SecurityContext.RunAsNonRoot || *v.SecurityContext.AllowPrivilegeEscalation {
		t.Errorf("validator security context %+v", v.SecurityContext)
	}
	if !slices.Equal(r.Sentinels, cfg.Validator.Probes) || len(r.Sentinels) != 2 {
		t.Errorf("validator sentinels %v, want the validator's probes %v", r.Sentinels, cfg.Validator.Probes)
	}
	if slices.Contains(r.ExemptUIDs, cfg.Validator.UID) || slices.Contains(r.ExemptGIDs, cfg.Validator.GID) {
		t.Errorf("the validator is exempt: %+v", r)
	}
	proxies := 0
	for i, c := range pod.Spec.InitContainers {
		if c.Name == annotations.ProxyContainer {
			proxies++
			if i != 1 || c.RestartPolicy == nil || *c.RestartPolicy != corev1.ContainerRestartPolicyAlways {
				t.Errorf("native proxy at init index %d with restartPolicy %v", i, c.RestartPolicy)
			}
		}
	}
	for _, c := range pod.Spec.Containers {
		if c.Name == annotations.ProxyContainer {
			proxies++
		}
	}
	if proxies != 1 {
		t.Errorf("the pod has %d proxies", proxies)
	}
	// Exempt identities are used only by selected, run-to-completion init containers; what a
	// container added later (kubectl debug) inherits from the pod is never exempt, and no
	// dedicated GID is a UID anyone in the pod runs as.
	if sc := pod.Spec.SecurityContext; sc != nil && sc.RunAsUser != nil {
		if slices.Contains(r.ExemptUIDs, uint32(*sc.RunAsUser)) {
			t.Errorf("the pod's runAsUser %d is exempt by UID", *sc.RunAsUser)
		}
		if slices.Contains(r.ExemptGIDs, uint32(*sc.RunAsUser)) {
			t.Errorf("the pod's runAsUser %d is an exempt GID", *sc.RunAsUser)
		}
	}
	if sc := pod.Spec.SecurityContext; sc != nil && sc.RunAsGroup != nil && slices.Contains(r.ExemptGIDs, uint32(*sc.RunAsGroup)) {
		t.Errorf("the pod's runAsGroup %d is exempt", *sc.RunAsGroup)
	}
	for _, c := range append(slices.Clone(pod.Spec.InitContainers), pod.Spec.Containers...) {
		if c.SecurityContext != nil && c.SecurityContext.RunAsUser != nil && slices.Contains(r.ExemptGIDs, uint32(*c.SecurityContext.RunAsUser)) {
			t.Errorf("container %q runs as UID %d, an exempt GID", c.Name, *c.SecurityContext.RunAsUser)
		}
	}
	mustStay := slices.Clone(pod.Spec.Containers)
	for _, c := range pod.Spec.InitContainers {
		if isSidecar(&c) || c.Name == annotations.ValidatorContainer {
			mustStay = append(mustStay, c)
		}
	}
	for i := range mustStay {
		c := &mustStay[i]
		if c.Name == annotations.ProxyContainer {
			continue
		}
		if uid := EffectiveUID(pod, c); uid != nil && slices.Contains(r.ExemptUIDs, uint32(*uid)) {
			t.Errorf("container %q runs as exempt UID %d", c.Name, *uid)
		}
		if uid := EffectiveUID(pod, c); uid == nil && len(r.ExemptUIDs) > 0 {
			t.Errorf("container %q runs as its image's user while UIDs %v are exempt", c.Name, r.ExemptUIDs)
		}
		if gid := EffectiveGID(pod, c); gid != nil && slices.Contains(r.ExemptGIDs, uint32(*gid)) {
			t.Errorf("container %q runs with exempt GID %d", c.Name, *gid)
		}
	}
	if sc := pod.Spec.SecurityContext; sc != nil {
		for _, g := range append([]*int64{sc.FSGroup}, ptrs(sc.SupplementalGroups)...) {
			if g != nil && slices.Contains(r.ExemptGIDs, uint32(*g)) {
				t.Errorf("pod GID %d is exempt", *g)
			}
		}
	}
	for _, id := range append(slices.Clone(r.ExemptUIDs), r.ExemptGIDs...) {
		if id == 0 {
			t.Errorf("0 is exempt")
		}
	}
	for _, g := range r.ExemptGIDs {
		if !cfg.GIDRange.Contains(g) {
			t.Errorf("exempt GID %d is outside the reserved range", g)
		}
	}
}

func ptrs(s []int64) []*int64 {
	var out []*int64
	for i := range s {
		out = append(out, &s[i])
	}
	return out
}

// Re-admission, re-invocation and forged values all converge on the same pod.
func TestMutateIdempotent(t *testing.T) {
	cfg := testConfig(t, "sidecarMode: container")
	base := newPod(inits(container("migrate", 0, unset), container("fetch", 1001, unset), container("seed", 1000, unset)))

	once := base.DeepCopy()
	if _, err := Mutate(once, Input{NamespaceAnnotations: optedIn}, cfg); err != nil {
		t.Fatal(err)
	}
	twice := once.DeepCopy()
	res, err := Mutate(twice, Input{NamespaceAnnotations: optedIn}, cfg)
	if err != nil || res.Outcome != Injected {
		t.Fatalf("second Mutate = %+v, %v", res, err)
	}
	if !reflect.DeepEqual(once, twice) {
		t.Errorf("admitting an injected pod again changed it:\n%s", diffPods(once, twice))
	}

	// Another webhook (Vault's agent injector, say) adds an init container after detour ran;
	// the re-invocation must give it egress too, exactly as if it had been there from the start.
	reinvoked := once.DeepCopy()
	reinvoked.Spec.InitContainers = append(reinvoked.Spec.InitContainers, container("vault-agent-init", 100, unset))
	if _, err := Mutate(reinvoked, Input{NamespaceAnnotations: optedIn}, cfg); err != nil {
		t.Fatal(err)
	}
	fresh := base.DeepCopy()
	fresh.Spec.InitContainers = append(fresh.Spec.InitContainers, container("vault-agent-init", 100, unset))
	if _, err := Mutate(fresh, Input{NamespaceAnnotations: optedIn}, cfg); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(reinvoked, fresh) {
		t.Errorf("re-invocation differs from a fresh injection:\n%s", diffPods(fresh, reinvoked))
	}
	if got := reinvoked.Annotations[annotations.ExemptUIDs]; got != "100,1001" {
		t.Errorf("exempt UIDs after re-invocation = %q, want the new init container's 100 too", got)
	}
	if got := reinvoked.Annotations[annotations.ExemptGIDs]; got != "2600,2601" {
		t.Errorf("exempt GIDs after re-invocation = %q", got)
	}

	// A webhook that prepends its init container: detour's validator goes back to the front.
	prepended := once.DeepCopy()
	prepended.Spec.InitContainers = slices.Insert(prepended.Spec.InitContainers, 0, container("first", 100, unset))
	if _, err := Mutate(prepended, Input{NamespaceAnnotations: optedIn}, cfg); err != nil {
		t.Fatal(err)
	}
	if names := containerNames(prepended.Spec.InitContainers); !slices.Equal(names, []string{annotations.ValidatorContainer, "first", "migrate", "fetch", "seed"}) {
		t.Errorf("init containers after a prepend = %v", names)
	}
}

func containerNames(cs []corev1.Container) []string {
	var names []string
	for _, c := range cs {
		names = append(names, c.Name)
	}
	return names
}

func diffPods(a, b *corev1.Pod) string {
	return fmt.Sprintf("--- a\n%+v\n%+v\n%v\n--- b\n%+v\n%+v\n%v", a.Spec.InitContainers, a.Spec.Containers, a.Annotations,
		b.Spec.InitContainers, b.Spec.Containers, b.Annotations)
}

func TestMutateContainers(t *testing.T) {
	cfg, err := ParseConfig([]byte(`
proxy:
  image: proxy:test
  adminPorts: [4191, 4192]
  env: [{name: LOG, value: info}]
  startupProbe: {httpGet: {path: /ready, port: 4191}}
validator:
  sentinel: 10.96.0.1:443
  timeout: 3s
`))
	if err != nil {
		t.Fatal(err)
	}
	pod := newPod(inits(container("migrate", 0, unset)))
	if _, err := Mutate(pod, Input{NamespaceAnnotations: optedIn}, cfg); err != nil {
		t.Fatal(err)
	}
	v := pod.Spec.InitContainers[0]
	if want := []string{"detour", "validate", "--port=4140", "--timeout=3s", "--sentinel=10.96.0.1:443"}; !slices.Equal(v.Command, want) {
		t.Errorf("validator command = %v, want %v", v.Command, want)
	}
	sc := v.SecurityContext
	if *sc.RunAsUser != 2103 || *sc.RunAsGroup != 2103 || !*sc.RunAsNonRoot || *sc.AllowPrivilegeEscalation ||
		!*sc.ReadOnlyRootFilesystem || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
		t.Errorf("validator security context = %+v", sc)
	}
	if v.Resources.Limits.Memory().String() != "32Mi" {
		t.Errorf("validator resources = %+v", v.Resources)
	}
	p := pod.Spec.Containers[len(pod.Spec.Containers)-1]
	if p.Name != annotations.ProxyContainer || p.Image != "proxy:test" || p.RestartPolicy != nil {
		t.Fatalf("last container = %+v, want the proxy", p)
	}
	if *p.SecurityContext.RunAsUser != 2102 || len(p.Ports) != 2 || p.Ports[1].ContainerPort != 4192 || p.Env[0].Value != "info" {
		t.Errorf("proxy = %+v", p)
	}
	if p.StartupProbe == nil || p.StartupProbe.PeriodSeconds != 10 || p.StartupProbe.HTTPGet.Scheme != corev1.URISchemeHTTP {
		t.Errorf("proxy startup probe %+v lacks the API server's defaults", p.StartupProbe)
	}
	if got := pod.Annotations[annotations.RedirectSkipInboundPorts]; got != "4191-4192" {
		t.Errorf("inbound skip = %q", got)
	}
	// The configuration is a template: injecting must not alias it.
	p.Env[0].Value = "changed"
	if cfg.Proxy.Env[0].Value != "info" {
		t.Error("the injected proxy shares its env with the configuration")
	}
}

// Issue 33: the inbound capture the plugin installs comes from the pod's
// detour.dev/inbound-capture, else its namespace's, else the configuration (listening by
// default), and is always written, so that a pod without it is one injected before it existed.
func TestMutateInboundCapture(t *testing.T) {
	for _, tc := range []struct {
		name       string
		config     string
		pod, ns    map[string]string
		want       string
		wantDenial string
	}{
		{name: "default", want: "listening"},
		{name: "configuration", config: "inboundCapture: all", want: "all"},
		{name: "namespace", ns: map[string]string{annotations.InboundCapture: "all"}, want: "all"},
		{name: "the pod wins", config: "inboundCapture: all", ns: map[string]string{annotations.InboundCapture: "all"}, pod: map[string]string{annotations.InboundCapture: " listening "}, want: "listening"},
		{name: "bad value", pod: map[string]string{annotations.InboundCapture: "some"}, wantDenial: `annotation detour.dev/inbound-capture: "some" is not valid`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := testConfig(t, tc.config)
			pod := newPod()
			pod.Annotations = map[string]string{annotations.Inject: "enabled"}
			for k, v := range tc.pod {
				pod.Annotations[k] = v
			}
			_, err := Mutate(pod, Input{NamespaceAnnotations: tc.ns}, cfg)
			if tc.wantDenial != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantDenial) {
					t.Fatalf("Mutate = %v, want a denial containing %q", err, tc.wantDenial)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := pod.Annotations[annotations.RedirectInbound]; got != tc.want {
				t.Errorf("%s = %q, want %q", annotations.RedirectInbound, got, tc.want)
			}
		})
	}
	if _, err := ParseConfig([]byte("proxy: {image: p}\ninboundCapture: some")); err == nil || !strings.Contains(err.Error(), `inboundCapture: "some" is not valid`) {
		t.Errorf("ParseConfig with inboundCapture: some = %v, want the field named", err)
	}
}
