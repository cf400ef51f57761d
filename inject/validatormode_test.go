package inject

import (
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/detourmesh/detour/annotations"
)

// foldableConfig is a configuration whose check can run in the proxy's start, with
// validator.mode mode ("" for the default).
func foldableConfig(t testing.TB, mode string) *Config {
	t.Helper()
	cfg, err := ParseConfig([]byte(`
proxy:
  image: proxy:test
  command: [/usr/bin/proxy, --config]
  args: [/etc/proxy config.yaml]
  startupProbe: {tcpSocket: {port: 4191}}
validator: {image: "detour:test", timeout: 3s, mode: "` + mode + `"}
`))
	if err != nil {
		t.Fatalf("ParseConfig: %v", err)
	}
	return cfg
}

var folded = Input{NamespaceAnnotations: optedIn, NativeSidecars: true, Validator: annotations.ValidatorImageVolume}

func TestMutateFoldsTheValidatorIntoTheProxy(t *testing.T) {
	cfg := foldableConfig(t, "")
	pod := newPod(inits(container("migrate", 0, unset)))
	res, err := Mutate(pod, folded, cfg)
	if err != nil || res.Validator != annotations.ValidatorImageVolume || strings.Contains(strings.Join(res.Warnings, " "), "validator") {
		t.Fatalf("Mutate = %+v, %v", res, err)
	}
	// No validator container: the proxy comes first, a native sidecar, then the pod's own.
	if names := containerNames(pod.Spec.InitContainers); !slices.Equal(names, []string{annotations.ProxyContainer, "migrate"}) {
		t.Fatalf("init containers = %v", names)
	}
	p := pod.Spec.InitContainers[0]
	if p.RestartPolicy == nil || *p.RestartPolicy != corev1.ContainerRestartPolicyAlways {
		t.Errorf("the proxy is not a native sidecar: %+v", p.RestartPolicy)
	}
	// The check listens on the check port, where the plugin sends the proxy UID's connections to
	// a sentinel, and tries the outbound port when a node's older plugin sends them there.
	// With detour's postStart hook as its start gate (proxy.startGate auto), the check waits a
	// moment for the hook after a failure (--hook-wait).
	wantCmd := []string{"/.detour/opt/detour/bin/detour", "validate", "--port=4142", "--fallback-port=4140", "--timeout=3s", "--hook-wait=10s", "--"}
	if got := pod.Annotations[annotations.ValidatorCheckPort]; got != "4142" {
		t.Errorf("%s = %q, want 4142", annotations.ValidatorCheckPort, got)
	}
	if !slices.Equal(p.Command, wantCmd) || !slices.Equal(p.Args, []string{"/usr/bin/proxy", "--config", "/etc/proxy config.yaml"}) {
		t.Errorf("proxy command %q args %q; want %q and the proxy's command and args", p.Command, p.Args, wantCmd)
	}
	if len(p.VolumeMounts) != 1 || !reflect.DeepEqual(p.VolumeMounts[0], corev1.VolumeMount{Name: annotations.ValidatorVolume, MountPath: annotations.ValidatorMountPath, ReadOnly: true}) {
		t.Errorf("proxy volume mounts = %+v", p.VolumeMounts)
	}
	if *p.SecurityContext.RunAsUser != 2102 || !*p.SecurityContext.ReadOnlyRootFilesystem {
		t.Errorf("the check does not run as the proxy, read-only: %+v", p.SecurityContext)
	}
	want := corev1.Volume{Name: annotations.ValidatorVolume, VolumeSource: corev1.VolumeSource{Image: &corev1.ImageVolumeSource{Reference: "detour:test", PullPolicy: corev1.PullIfNotPresent}}}
	if len(pod.Spec.Volumes) != 1 || !reflect.DeepEqual(pod.Spec.Volumes[0], want) {
		t.Errorf("volumes = %+v, want detour's image", pod.Spec.Volumes)
	}
	if pod.Spec.NodeSelector[annotations.ImageVolumesLabel] != "true" {
		t.Errorf("node selector = %v, want %s=true: only such nodes mount the volume", pod.Spec.NodeSelector, annotations.ImageVolumesLabel)
	}
	if got := pod.Annotations[annotations.Validator]; got != "image-volume" {
		t.Errorf("%s = %q", annotations.Validator, got)
	}
	// The plugin redirects the sentinels whatever else it does (they come first in its rules).
	if got := pod.Annotations[annotations.ValidatorSentinels]; got != "203.0.113.254:80,[2001:db8::fe]:80" {
		t.Errorf("sentinels = %q", got)
	}
}

func TestMutateFoldedIdempotent(t *testing.T) {
	cfg := foldableConfig(t, "")
	base := newPod(inits(container("migrate", 0, unset)), func(p *corev1.Pod) {
		p.Spec.NodeSelector = map[string]string{"zone": "a"}
		p.Spec.Volumes = []corev1.Volume{{Name: "data"}}
	})
	once := base.DeepCopy()
	if _, err := Mutate(once, folded, cfg); err != nil {
		t.Fatal(err)
	}
	twice := once.DeepCopy()
	if _, err := Mutate(twice, folded, cfg); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(once, twice) {
		t.Errorf("admitting a folded pod again changed it:\n%s\n%v %v\n%v %v", diffPods(once, twice), once.Spec.Volumes, once.Spec.NodeSelector, twice.Spec.Volumes, twice.Spec.NodeSelector)
	}
	if !slices.Equal(volumeNames(once), []string{"data", annotations.ValidatorVolume}) || len(once.Spec.NodeSelector) != 2 {
		t.Errorf("volumes %v, node selector %v", volumeNames(once), once.Spec.NodeSelector)
	}

	// Admitted again where the cluster decided for the init container: nothing of the folded
	// form is left, the pod's own volume and selector are.
	again := once.DeepCopy()
	in := folded
	in.Validator = annotations.ValidatorInitContainer
	if _, err := Mutate(again, in, cfg); err != nil {
		t.Fatal(err)
	}
	if names := containerNames(again.Spec.InitContainers); !slices.Equal(names, []string{annotations.ValidatorContainer, annotations.ProxyContainer, "migrate"}) {
		t.Errorf("init containers = %v", names)
	}
	if !slices.Equal(volumeNames(again), []string{"data"}) || !reflect.DeepEqual(again.Spec.NodeSelector, map[string]string{"zone": "a"}) {
		t.Errorf("volumes %v, node selector %v; want the pod's own", volumeNames(again), again.Spec.NodeSelector)
	}
	if p := again.Spec.InitContainers[1]; !slices.Equal(p.Command, cfg.Proxy.Command) || !slices.Equal(p.Args, cfg.Proxy.Args) || len(p.VolumeMounts) != 0 {
		t.Errorf("the proxy keeps the folded form: command %q, args %q, mounts %+v", p.Command, p.Args, p.VolumeMounts)
	}

	// Not injected any more (the namespace opted out): the folded form goes too.
	skipped := once.DeepCopy()
	res, err := Mutate(skipped, Input{NativeSidecars: true, Validator: annotations.ValidatorImageVolume}, cfg)
	if err != nil || res.Outcome != Skipped {
		t.Fatalf("Mutate = %+v, %v", res, err)
	}
	if !slices.Equal(volumeNames(skipped), []string{"data"}) || len(skipped.Spec.NodeSelector) != 1 || len(skipped.Spec.InitContainers) != 1 {
		t.Errorf("a skipped pod keeps detour's: volumes %v, selector %v, init containers %v", volumeNames(skipped), skipped.Spec.NodeSelector, containerNames(skipped.Spec.InitContainers))
	}
}

func volumeNames(p *corev1.Pod) []string {
	var names []string
	for _, v := range p.Spec.Volumes {
		names = append(names, v.Name)
	}
	return names
}

func TestMutateValidatorModeChoices(t *testing.T) {
	for _, tc := range []struct {
		name    string
		config  string // added to the foldable configuration
		cluster annotations.ValidatorModeValue
		native  bool
		pod     map[string]string // annotations
		want    annotations.ValidatorModeValue
		warning string
	}{
		{"the cluster's decision", "", annotations.ValidatorImageVolume, true, nil, annotations.ValidatorImageVolume, ""},
		{"no decision is the init container", "", "", true, nil, annotations.ValidatorInitContainer, ""},
		{"container mode never folds", "", annotations.ValidatorImageVolume, false, nil, annotations.ValidatorInitContainer, ""},
		{"sidecar-mode container on the pod", "", annotations.ValidatorImageVolume, true, map[string]string{annotations.SidecarMode: "container"}, annotations.ValidatorInitContainer, ""},
		{"the pod opts out", "", annotations.ValidatorImageVolume, true, map[string]string{annotations.ValidatorMode: "init-container"}, annotations.ValidatorInitContainer, ""},
		{"the pod asks for it", "", annotations.ValidatorInitContainer, true, map[string]string{annotations.ValidatorMode: "image-volume"}, annotations.ValidatorImageVolume, ""},
		{"the pod says auto", "", annotations.ValidatorImageVolume, true, map[string]string{annotations.ValidatorMode: "auto"}, annotations.ValidatorImageVolume, ""},
		{"the pod asks in container mode", "", annotations.ValidatorInitContainer, false, map[string]string{annotations.ValidatorMode: "image-volume"}, annotations.ValidatorInitContainer,
			"needs the proxy as a native sidecar"},
		{"the pod asks without the proxy's command", "proxy: {image: proxy:test, startupProbe: {tcpSocket: {port: 4191}}}", annotations.ValidatorInitContainer, true, map[string]string{annotations.ValidatorMode: "image-volume"}, annotations.ValidatorInitContainer,
			"proxy.command is not set"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := foldableConfig(t, "")
			if tc.config != "" {
				var err error
				if cfg, err = ParseConfig([]byte(tc.config)); err != nil {
					t.Fatal(err)
				}
			}
			pod := newPod()
			pod.Annotations = tc.pod
			res, err := Mutate(pod, Input{NamespaceAnnotations: optedIn, NativeSidecars: tc.native, Validator: tc.cluster}, cfg)
			if err != nil {
				t.Fatal(err)
			}
			if res.Validator != tc.want || pod.Annotations[annotations.Validator] != string(tc.want) {
				t.Errorf("validator %q (annotation %q), want %q", res.Validator, pod.Annotations[annotations.Validator], tc.want)
			}
			hasValidator := slices.Contains(containerNames(pod.Spec.InitContainers), annotations.ValidatorContainer)
			if hasValidator != (tc.want == annotations.ValidatorInitContainer) {
				t.Errorf("init containers %v for %s", containerNames(pod.Spec.InitContainers), tc.want)
			}
			joined := strings.Join(res.Warnings, "\n")
			if tc.warning == "" && joined != "" || tc.warning != "" && !strings.Contains(joined, tc.warning) {
				t.Errorf("warnings %q, want %q", joined, tc.warning)
			}
		})
	}
}

func TestMutateBadValidatorModeAnnotation(t *testing.T) {
	pod := newPod(annotate(annotations.ValidatorMode, "proxy"))
	_, err := Mutate(pod, folded, foldableConfig(t, ""))
	if !IsDenial(err) || !strings.Contains(err.Error(), annotations.ValidatorMode) || !strings.Contains(err.Error(), `"proxy"`) {
		t.Errorf("Mutate = %v, want a denial naming the annotation and the value", err)
	}
}

func TestParseConfigValidatorMode(t *testing.T) {
	for _, tc := range []struct {
		yaml, want string
	}{
		{"proxy: {image: proxy:test}\nvalidator: {mode: image-volume}", "validator.mode: \"image-volume\" is not valid: proxy.command is not set"},
		{"proxy: {image: proxy:test, command: [p]}\nvalidator: {mode: image-volume}", "proxy.startupProbe is not set"},
		{"proxy: {image: proxy:test}\nvalidator: {mode: sidecar}", `validator.mode: "sidecar" is not valid: use "auto", "init-container" or "image-volume"`},
	} {
		if _, err := ParseConfig([]byte(tc.yaml)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want %q", tc.yaml, err, tc.want)
		}
	}
	if cfg := testConfig(t, ""); cfg.Validator.Mode != annotations.ValidatorAuto {
		t.Errorf("default validator.mode = %q, want auto", cfg.Validator.Mode)
	}
}

func TestResolveValidatorMode(t *testing.T) {
	fold, plain := foldableConfig(t, ""), testConfig(t, "")
	pinned, off := foldableConfig(t, "image-volume"), foldableConfig(t, "init-container")
	ok := Cluster{APIServerVersion: "v1.37.2", APIServerImageVolumes: GateOn, Nodes: 3}
	old := ok
	old.WithoutImageVolumes = []string{"b: the kubelet v1.34.1 has image volumes off by default (on from 1.35)"}
	none := ok
	none.Nodes, none.WithoutImageVolumes = 1, []string{"b: no node agent labelled it"}
	gateOff := ok
	gateOff.APIServerVersion, gateOff.APIServerImageVolumes = "v1.35.1", GateOff
	blind := ok
	blind.APIServerImageVolumes, blind.APIServerGateWhy = GateUnknown, "reading the API server's /metrics was forbidden"
	noRBAC := ok
	noRBAC.NodesUnknown = "the webhook may not list nodes (its RBAC)"
	for _, tc := range []struct {
		name     string
		cfg      *Config
		c        Cluster
		want     annotations.ValidatorModeValue
		because  string
		possible bool // a pod may ask for image-volume
	}{
		{"every node can", fold, ok, annotations.ValidatorImageVolume, "every node (3) mounts image volumes", true},
		{"a node cannot", fold, old, annotations.ValidatorInitContainer, "1 of 3 nodes do not carry detour.dev/image-volumes=true: b: the kubelet v1.34.1", true},
		{"no node can", fold, none, annotations.ValidatorInitContainer, "no node carries detour.dev/image-volumes=true, so its pods could not be scheduled: b: no node agent labelled it", false},
		{"the API server's gate off", fold, gateOff, annotations.ValidatorInitContainer, "the API server v1.35.1 has its ImageVolume feature gate off", false},
		{"the API server's gate unknown", fold, blind, annotations.ValidatorInitContainer, "cannot tell whether the API server keeps image volumes (reading the API server's /metrics was forbidden)", false},
		{"nodes unknown", fold, noRBAC, annotations.ValidatorInitContainer, "the webhook may not list nodes", false},
		{"no nodes", fold, Cluster{APIServerVersion: "v1.37.2", APIServerImageVolumes: GateOn}, annotations.ValidatorInitContainer, "no node has registered yet", false},
		{"no proxy command", plain, ok, annotations.ValidatorInitContainer, "proxy.command is not set", true},
		{"pinned", pinned, old, annotations.ValidatorImageVolume, "validator.mode is image-volume", true},
		{"pinned, the gate off", pinned, gateOff, annotations.ValidatorInitContainer, "validator.mode is image-volume, but the API server v1.35.1 has its ImageVolume feature gate off", false},
		{"pinned, no node can", pinned, none, annotations.ValidatorInitContainer, "validator.mode is image-volume, but no node carries", false},
		{"off", off, ok, annotations.ValidatorInitContainer, "validator.mode is init-container", true},
	} {
		d := ResolveValidatorMode(tc.cfg, tc.c)
		if d.Mode != tc.want || !strings.Contains(d.Reason, tc.because) || d.Possible != tc.possible {
			t.Errorf("%s: %+v, want %s because %q, possible %v", tc.name, d, tc.want, tc.because, tc.possible)
		}
	}
	// Many nodes: five named, the rest counted.
	many := ok
	for _, n := range []string{"a", "b", "c", "d", "e", "f", "g"} {
		many.WithoutImageVolumes = append(many.WithoutImageVolumes, n+": old")
	}
	if d := ResolveValidatorMode(fold, many); !strings.HasSuffix(d.Reason, "e: old; and 2 more") {
		t.Errorf("reason %q", d.Reason)
	}
}

func TestImageVolumes(t *testing.T) {
	for _, tc := range []struct {
		kubelet, runtime string
		want             bool
		because          string
	}{
		{"v1.37.2", "containerd://2.4.2", true, "mount image volumes"},
		{"v1.35.0", "containerd://2.1.0", true, ""},
		{"v1.35.0", "cri-o://1.31.3", true, ""},
		{"v1.34.9", "containerd://2.4.2", false, "off by default"},
		{"v1.37.2", "containerd://2.0.5", false, "needs 2.1.0 or later"},
		{"v1.37.2", "docker://28.2.2", false, "not one detour knows"},
		{"", "containerd://2.4.2", false, "cannot be read"},
		{"v1.37.2", "containerd://x", false, "cannot read"},
	} {
		got, why := ImageVolumes(corev1.NodeSystemInfo{KubeletVersion: tc.kubelet, ContainerRuntimeVersion: tc.runtime})
		if got != tc.want || !strings.Contains(why, tc.because) {
			t.Errorf("%s %s: %v %q, want %v %q", tc.kubelet, tc.runtime, got, why, tc.want, tc.because)
		}
	}
}

// Only a startup probe that reaches the proxy holds the app back until the check (which runs
// before the proxy) has passed: validator.mode image-volume refuses any other, auto falls back
// to the init container and says why, and a pod that asks for image-volume gets a warning and
// the init container (issue 32, item 7).
func TestFoldNeedsAStartupProbeOnAProxyPort(t *testing.T) {
	const base = "proxy: {image: proxy:test, command: [proxy], adminPorts: [4191, 9901], startupProbe: %s}\nvalidator: {mode: %s}"
	ok := Cluster{APIServerVersion: "v1.37.2", APIServerImageVolumes: GateOn, Nodes: 1}
	for _, tc := range []struct {
		probe string
		why   string // "" when the probe reaches the proxy
	}{
		{"{tcpSocket: {port: 4191}}", ""},
		{"{tcpSocket: {port: 9901}}", ""},
		{"{tcpSocket: {port: admin-9901}}", ""},
		{"{httpGet: {path: /ready, port: 4143}}", ""},
		{"{grpc: {port: 4140}}", ""},
		{"{exec: {command: [cat, /tmp/ready]}}", "proxy.startupProbe is an exec probe, which need not depend on the proxy"},
		{"{tcpSocket: {port: 8080}}", "proxy.startupProbe.tcpSocket.port 8080 is none of the proxy's ports (inbound 4143, outbound 4140, admin 4191 (admin-4191), admin 9901 (admin-9901))"},
		{"{httpGet: {path: /, port: http}}", "proxy.startupProbe.httpGet.port http is none of the proxy's ports"},
		{"{grpc: {port: 9090}}", "proxy.startupProbe.grpc.port 9090 is none of the proxy's ports"},
		{"{periodSeconds: 1}", "proxy.startupProbe has no tcpSocket, httpGet or grpc action"},
	} {
		t.Run(tc.probe, func(t *testing.T) {
			_, err := ParseConfig([]byte(fmt.Sprintf(base, tc.probe, "image-volume")))
			switch {
			case tc.why == "" && err != nil:
				t.Errorf("validator.mode image-volume refused: %v", err)
			case tc.why != "" && (err == nil || !strings.Contains(err.Error(), `validator.mode: "image-volume" is not valid: `+tc.why)):
				t.Errorf("validator.mode image-volume: error %v, want %q", err, tc.why)
			}
			auto, err := ParseConfig([]byte(fmt.Sprintf(base, tc.probe, "auto")))
			if err != nil {
				t.Fatal(err)
			}
			d := ResolveValidatorMode(auto, ok)
			want := annotations.ValidatorImageVolume
			if tc.why != "" {
				want = annotations.ValidatorInitContainer
			}
			if d.Mode != want || tc.why != "" && !strings.Contains(d.Reason, tc.why) {
				t.Errorf("auto decided %+v, want %s because %q", d, want, tc.why)
			}
			pod := newPod(annotate(annotations.ValidatorMode, "image-volume"))
			res, err := Mutate(pod, Input{NamespaceAnnotations: optedIn, NativeSidecars: true}, auto)
			if err != nil || res.Validator != want {
				t.Fatalf("a pod asking for image-volume got %q (%v), want %q", res.Validator, err, want)
			}
			if warned := strings.Contains(strings.Join(res.Warnings, "\n"), "cannot be granted"); warned != (tc.why != "") {
				t.Errorf("warnings %q; want one that says why exactly when the probe does not reach the proxy", res.Warnings)
			}
		})
	}
}

// A container that declares the check port would hold it when the proxy restarts, and the check
// there would fail: the webhook warns, naming the container and the port.
func TestMutateWarnsAboutAContainerOnTheCheckPort(t *testing.T) {
	cfg := foldableConfig(t, "")
	pod := newPod(inits(container("migrate", 0, unset)))
	pod.Spec.Containers[0].Ports = []corev1.ContainerPort{{ContainerPort: 4142}}
	res, err := Mutate(pod, folded, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if w := strings.Join(res.Warnings, "\n"); !strings.Contains(w, `container "`+pod.Spec.Containers[0].Name+`" declares port 4142`) {
		t.Errorf("warnings %q, want one about the container on the check port", res.Warnings)
	}
	if _, err := ParseConfig([]byte("proxy: {image: p, adminPorts: [4142]}")); err == nil || !strings.Contains(err.Error(), "validator.checkPort: 4142 is not valid") {
		t.Errorf("ParseConfig with an admin port on the check port: %v, want validator.checkPort refused", err)
	}
}

func TestNodeVersionsKnown(t *testing.T) {
	for _, tc := range []struct {
		kubelet, runtime string
		want             bool
	}{
		{"v1.37.2", "containerd://2.4.2", true},
		{"v1.37.2", "cri-o://1.31.0", true},
		{"v1.37.2", "containerd://Unknown", false}, // the runtime restarting
		{"v1.37.2", "", false},
		{"", "containerd://2.4.2", false},
	} {
		if got := NodeVersionsKnown(corev1.NodeSystemInfo{KubeletVersion: tc.kubelet, ContainerRuntimeVersion: tc.runtime}); got != tc.want {
			t.Errorf("NodeVersionsKnown(%q, %q) = %v, want %v", tc.kubelet, tc.runtime, got, tc.want)
		}
	}
}
