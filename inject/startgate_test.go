package inject

import (
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/detourmesh/detour/annotations"
)

// gateConfig is a foldable configuration with proxy.startGate gate ("" for the default) and the
// startup probe probe (YAML flow style).
func gateConfig(t testing.TB, gate, probe string) *Config {
	t.Helper()
	cfg, err := ParseConfig([]byte(`
proxy:
  image: proxy:test
  command: [/usr/bin/proxy]
  startupProbe: ` + probe + `
  startGate: "` + gate + `"
validator: {image: "detour:test"}
`))
	if err != nil {
		t.Fatalf("ParseConfig: %v", err)
	}
	return cfg
}

const tcpProbe = `{tcpSocket: {port: 4191}, periodSeconds: 1, failureThreshold: 30}`

func TestParseConfigStartGate(t *testing.T) {
	if g := gateConfig(t, "", tcpProbe).Proxy.StartGate; g != annotations.StartGateAuto {
		t.Errorf("default proxy.startGate = %q, want auto", g)
	}
	for _, g := range []annotations.StartGateValue{annotations.StartGateAuto, annotations.StartGateProbe, annotations.StartGateHook} {
		if got := gateConfig(t, string(g), tcpProbe).Proxy.StartGate; got != g {
			t.Errorf("proxy.startGate %q parsed as %q", g, got)
		}
	}
	for _, tc := range []struct{ yaml, want string }{
		{"proxy: {image: p, command: [p], startupProbe: {tcpSocket: {port: 4191}}, startGate: postStart}",
			`proxy.startGate: "postStart" is not valid: use "auto", "probe" (the proxy's startup probe holds the pod's next containers) or "hook"`},
		// The hook runs detour's binary from the folded check's image volume.
		{"proxy: {image: p, command: [p], startupProbe: {tcpSocket: {port: 4191}}, startGate: hook}\nvalidator: {mode: init-container}",
			`proxy.startGate: "hook" is not valid: the hook runs detour's binary from the image volume of the check at the proxy's start, which validator.mode init-container rules out`},
		{"proxy: {image: p, startupProbe: {tcpSocket: {port: 4191}}, startGate: hook}",
			`proxy.startGate: "hook" is not valid: proxy.command is not set`},
		{"proxy: {image: p, command: [p], startGate: hook}",
			`proxy.startGate: "hook" is not valid: proxy.startupProbe is not set`},
		{"proxy: {image: p, command: [p], startupProbe: {exec: {command: [ok]}}, startGate: hook}",
			`proxy.startGate: "hook" is not valid: proxy.startupProbe is an exec probe`},
		{"proxy: {image: p, command: [p], startupProbe: {grpc: {port: 4191}}, startGate: hook}",
			`proxy.startGate: "hook" is not valid: proxy.startupProbe is a grpc probe, which the start gate's hook does not ask (it asks tcpSocket and httpGet probes); or use "probe" or "auto"`},
	} {
		if _, err := ParseConfig([]byte(tc.yaml)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s:\nerror %v\nwant  %q", tc.yaml, err, tc.want)
		}
	}
	// validator.mode image-volume already says why the check cannot be folded; said once.
	_, err := ParseConfig([]byte("proxy: {image: p, startupProbe: {tcpSocket: {port: 4191}}, startGate: hook}\nvalidator: {mode: image-volume}"))
	if err == nil || strings.Count(err.Error(), "proxy.command is not set") != 1 {
		t.Errorf("error %v, want proxy.command named once", err)
	}
}

func TestMutateHookGate(t *testing.T) {
	cfg := gateConfig(t, "hook", tcpProbe)
	pod := newPod(inits(container("migrate", 0, unset)))
	res, err := Mutate(pod, folded, cfg)
	if err != nil || res.StartGate != annotations.StartGateHook || len(res.Warnings) != 1 {
		t.Fatalf("Mutate = %+v, %v; want the hook and only the native sidecar's warning", res, err)
	}
	p := pod.Spec.InitContainers[0]
	// The probe stays beside the hook: without it the kubelet counts a running proxy as started,
	// a stale status of a proxy whose check failed included.
	if p.Name != annotations.ProxyContainer || !reflect.DeepEqual(p.StartupProbe, cfg.Proxy.StartupProbe) {
		t.Fatalf("first init container %q, startup probe %+v: want the proxy with its startup probe %+v", p.Name, p.StartupProbe, cfg.Proxy.StartupProbe)
	}
	want := []string{"/.detour/opt/detour/bin/detour", "wait-proxy", "--probe=tcp://:4191", "--timeout=30s", "--attempt-timeout=1s", "--check-port=4142"}
	if p.Lifecycle == nil || p.Lifecycle.PostStart == nil || p.Lifecycle.PostStart.Exec == nil || !slices.Equal(p.Lifecycle.PostStart.Exec.Command, want) {
		t.Fatalf("proxy lifecycle %+v, want the postStart exec %q", p.Lifecycle, want)
	}
	if p.Lifecycle.PreStop != nil {
		t.Errorf("a preStop hook appeared: %+v", p.Lifecycle.PreStop)
	}
	// The check waits a moment for the hook after a failure, so that the hook reports it.
	if !slices.Contains(p.Command, "--hook-wait=10s") || slices.Index(p.Command, "--hook-wait=10s") > slices.Index(p.Command, "--") {
		t.Errorf("proxy command %q: want --hook-wait=10s among the check's flags", p.Command)
	}
	// The hook's binary is the folded check's: the same image volume and mount.
	if !strings.HasPrefix(want[0], p.VolumeMounts[0].MountPath+"/") || p.Command[0] != want[0] {
		t.Errorf("hook %q is not on the check's mount %+v (command %q)", want[0], p.VolumeMounts, p.Command)
	}

	// Idempotent: admitting the injected pod again gives the same pod.
	again := pod.DeepCopy()
	if _, err := Mutate(again, folded, cfg); err != nil || !reflect.DeepEqual(pod, again) {
		t.Errorf("admitting the pod again changed it (%v):\n%s", err, diffPods(pod, again))
	}
	// Admitted again where the cluster decided for the init container: the startup probe is the
	// gate again, and nothing of the hook is left.
	in := folded
	in.Validator = annotations.ValidatorInitContainer
	res, err = Mutate(again, in, cfg)
	proxy := find(again.Spec.InitContainers, annotations.ProxyContainer)
	if err != nil || res.StartGate != annotations.StartGateProbe || proxy.Lifecycle != nil || !reflect.DeepEqual(proxy.StartupProbe, cfg.Proxy.StartupProbe) {
		t.Errorf("with the init container: gate %q, lifecycle %+v, startup probe %+v (%v)", res.StartGate, proxy.Lifecycle, proxy.StartupProbe, err)
	}
}

func TestWaitProxyCommandAsksWhatTheStartupProbeWould(t *testing.T) {
	for _, tc := range []struct {
		probe string
		want  []string
	}{
		{tcpProbe, []string{"--probe=tcp://:4191", "--timeout=30s", "--attempt-timeout=1s"}},
		// A named port is the proxy's admin port; the budget is initialDelay + period × failures.
		{`{tcpSocket: {port: admin-4191}, initialDelaySeconds: 2, periodSeconds: 5, failureThreshold: 4, timeoutSeconds: 3}`,
			[]string{"--probe=tcp://:4191", "--timeout=22s", "--attempt-timeout=3s"}},
		// The API server's defaults: period 10 s, 3 failures, 1 s per attempt.
		{`{httpGet: {port: 4191, path: ready, httpHeaders: [{name: X-Probe, value: "start gate"}]}}`,
			[]string{"--probe=http://:4191/ready", "--header=X-Probe: start gate", "--timeout=30s", "--attempt-timeout=1s"}},
		{`{httpGet: {port: 4191, path: "/healthz/ready?full=1", scheme: HTTPS}, periodSeconds: 1, failureThreshold: 600}`,
			[]string{"--probe=https://:4191/healthz/ready?full=1", "--timeout=600s", "--attempt-timeout=1s"}},
	} {
		cfg := gateConfig(t, "hook", tc.probe)
		got := WaitProxyCommand(cfg)
		if !slices.Equal(got[:2], []string{ValidatorBinary, "wait-proxy"}) || !slices.Equal(got[2:], append(tc.want, "--check-port=4142")) {
			t.Errorf("startup probe %s: hook %q, want the flags %q", tc.probe, got, tc.want)
		}
	}
}

func TestMutateStartGateChoices(t *testing.T) {
	grpc := `{grpc: {port: 4191}}`
	for _, tc := range []struct {
		name        string
		gate, probe string
		ann         []string // the pod's annotations
		in          Input
		want        annotations.StartGateValue
		warning     string
	}{
		{name: "auto is the hook where it can be had", gate: "", probe: tcpProbe, in: folded, want: annotations.StartGateHook},
		{name: "probe", gate: "probe", probe: tcpProbe, in: folded, want: annotations.StartGateProbe},
		{name: "hook", gate: "hook", probe: tcpProbe, in: folded, want: annotations.StartGateHook},
		{name: "the pod asks for the hook", gate: "probe", probe: tcpProbe, ann: []string{annotations.ProxyStartGate, "hook"}, in: folded, want: annotations.StartGateHook},
		{name: "the pod asks for the probe", gate: "hook", probe: tcpProbe, ann: []string{annotations.ProxyStartGate, "probe"}, in: folded, want: annotations.StartGateProbe},
		{name: "the pod's auto is the configuration's", gate: "hook", probe: tcpProbe, ann: []string{annotations.ProxyStartGate, "auto"}, in: folded, want: annotations.StartGateHook},
		{name: "auto with a grpc probe is the probe", gate: "auto", probe: grpc, in: folded, want: annotations.StartGateProbe},
		{name: "the pod asks for the hook with a grpc probe", gate: "auto", probe: grpc, ann: []string{annotations.ProxyStartGate, "hook"}, in: folded,
			want: annotations.StartGateProbe, warning: "proxy.startupProbe is a grpc probe"},
		{name: "the hook needs the folded check", gate: "hook", probe: tcpProbe, in: Input{NamespaceAnnotations: optedIn, NativeSidecars: true, Validator: annotations.ValidatorInitContainer},
			want: annotations.StartGateProbe},
		{name: "the pod asks for the hook without the folded check", gate: "auto", probe: tcpProbe, ann: []string{annotations.ProxyStartGate, "hook"},
			in: Input{NamespaceAnnotations: optedIn, NativeSidecars: true}, want: annotations.StartGateProbe, warning: "this pod has the detour-validator init container"},
		{name: "a regular container has no gate", gate: "hook", probe: tcpProbe, in: Input{NamespaceAnnotations: optedIn}, want: ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pod := newPod(annotate(tc.ann...))
			cfg := gateConfig(t, tc.gate, tc.probe)
			res, err := Mutate(pod, tc.in, cfg)
			if err != nil {
				t.Fatal(err)
			}
			warnings := strings.Join(res.Warnings, "\n")
			if res.StartGate != tc.want || (tc.warning == "") != !strings.Contains(warnings, annotations.ProxyStartGate) || !strings.Contains(warnings, tc.warning) {
				t.Errorf("gate %q, warnings %q; want %q and a warning saying %q", res.StartGate, warnings, tc.want, tc.warning)
			}
			proxy := find(slices.Concat(pod.Spec.InitContainers, pod.Spec.Containers), annotations.ProxyContainer)
			if hook := proxy.Lifecycle != nil; hook != (res.StartGate == annotations.StartGateHook) || !reflect.DeepEqual(proxy.StartupProbe, cfg.Proxy.StartupProbe) {
				t.Errorf("gate %q: lifecycle %+v, startup probe %+v", res.StartGate, proxy.Lifecycle, proxy.StartupProbe)
			}
		})
	}
}

func TestMutateBadStartGateAnnotation(t *testing.T) {
	pod := newPod(annotate(annotations.ProxyStartGate, "postStart"))
	_, err := Mutate(pod, folded, gateConfig(t, "", tcpProbe))
	if !IsDenial(err) || !strings.Contains(err.Error(), annotations.ProxyStartGate) || !strings.Contains(err.Error(), `"postStart"`) {
		t.Errorf("Mutate = %v, want a denial naming the annotation and the value", err)
	}
	// The key is one detour reads: no "unknown annotation" warning.
	res, err := Mutate(newPod(annotate(annotations.ProxyStartGate, "probe")), folded, gateConfig(t, "", tcpProbe))
	if err != nil || strings.Contains(strings.Join(res.Warnings, " "), "not ones detour reads") {
		t.Errorf("Mutate = %+v, %v", res, err)
	}
}
