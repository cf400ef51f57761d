package inject

import (
	"reflect"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/detourmesh/detour/annotations"
)

// proxyKit is what a production proxy needs injected (issue 43): its configuration from a
// ConfigMap, an identity token for an audience, a state directory, the pod's name and IP from
// the downward API, and a preStop hook of its own.
const proxyKit = `
  volumes:
  - {name: proxy-config, configMap: {name: haproxy-config, optional: true}}
  - name: proxy-identity
    projected: {sources: [{serviceAccountToken: {audience: mesh.example, expirationSeconds: 3600, path: token}}]}
  - {name: proxy-run, emptyDir: {medium: Memory}}
  volumeMounts:
  - {name: proxy-config, mountPath: /etc/haproxy, readOnly: true}
  - {name: proxy-identity, mountPath: /var/run/secrets/mesh, readOnly: true}
  - {name: proxy-run, mountPath: /run/haproxy}
  env:
  - {name: POD_NAME, valueFrom: {fieldRef: {fieldPath: metadata.name}}}
  - {name: POD_IP, valueFrom: {fieldRef: {fieldPath: status.podIP}}}
  lifecycle: {preStop: {sleep: {seconds: 2}}}
`

func kitConfig(t testing.TB, extra string) *Config {
	t.Helper()
	cfg, err := ParseConfig([]byte(`
proxy:
  image: proxy:test
  command: [/usr/sbin/haproxy, -W, -db, -f, /etc/haproxy/haproxy.cfg]
  startupProbe: {httpGet: {path: /healthz, port: 4191}, periodSeconds: 1, failureThreshold: 30}
` + proxyKit + extra + `
validator: {image: "detour:test"}
`))
	if err != nil {
		t.Fatalf("ParseConfig: %v", err)
	}
	return cfg
}

func TestParseConfigProxyVolumes(t *testing.T) {
	cfg := kitConfig(t, "")
	if len(cfg.Proxy.Volumes) != 3 || len(cfg.Proxy.VolumeMounts) != 3 || cfg.Proxy.Lifecycle == nil || cfg.Proxy.Lifecycle.PreStop == nil {
		t.Fatalf("proxy volumes %+v, mounts %+v, lifecycle %+v", cfg.Proxy.Volumes, cfg.Proxy.VolumeMounts, cfg.Proxy.Lifecycle)
	}
	if got := cfg.Proxy.Volumes[1].Projected.Sources[0].ServiceAccountToken.Audience; got != "mesh.example" {
		t.Errorf("token audience %q", got)
	}
	// The API server's defaults are filled in, so a stored pod is what the webhook wrote.
	if m := cfg.Proxy.Volumes[0].ConfigMap.DefaultMode; m == nil || *m != 0o644 {
		t.Errorf("configMap defaultMode %v, want 0644", m)
	}
	if m := cfg.Proxy.Volumes[1].Projected.DefaultMode; m == nil || *m != 0o644 {
		t.Errorf("projected defaultMode %v, want 0644", m)
	}
	if e := cfg.Proxy.Volumes[1].Projected.Sources[0].ServiceAccountToken.ExpirationSeconds; e == nil || *e != 3600 {
		t.Errorf("token expirationSeconds %v, want 3600 as written", e)
	}
	if v := cfg.Proxy.Env[0].ValueFrom.FieldRef.APIVersion; v != "v1" {
		t.Errorf("env fieldRef apiVersion %q, want v1", v)
	}
	hook, err := ParseConfig([]byte("proxy: {image: p, lifecycle: {preStop: {httpGet: {port: 4191}}}}"))
	if err != nil || hook.Proxy.Lifecycle.PreStop.HTTPGet.Path != "/" || hook.Proxy.Lifecycle.PreStop.HTTPGet.Scheme != corev1.URISchemeHTTP {
		t.Errorf("httpGet hook %+v, %v: want path / and scheme HTTP", hook, err)
	}

	for _, tc := range []struct{ yaml, want string }{
		{"proxy: {image: p, volumes: [{name: Conf, emptyDir: {}}]}", `proxy.volumes[0].name: "Conf" is not valid: a volume's name is a DNS label`},
		{"proxy: {image: p, volumes: [{name: detour-validator, emptyDir: {}}]}", "proxy.volumes[0].name: detour-validator is not valid: detour's own volume has this name"},
		{"proxy: {image: p, volumes: [{name: a, emptyDir: {}}, {name: a, secret: {secretName: s}}]}", "proxy.volumes[1].name: a is not valid: the name is listed twice"},
		{"proxy: {image: p, volumes: [{name: a}]}", "proxy.volumes[0]: a is not valid: set its source: one of configMap, downwardAPI, emptyDir, projected, secret"},
		{"proxy: {image: p, volumes: [{name: a, hostPath: {path: /var/run}}]}", "proxy.volumes[0]: a is not valid: use one source of configMap, downwardAPI, emptyDir, projected, secret (the kinds every pod may have under the restricted Pod Security Standard); it has another"},
		{"proxy: {image: p, volumes: [{name: a, emptyDir: {}, secret: {secretName: s}}]}", "it has emptyDir and secret"},
		{"proxy: {image: p, volumeMounts: [{name: a, mountPath: /a}]}", `proxy.volumeMounts[0].name: "a" is not valid: mount one of proxy.volumes (none is set)`},
		{"proxy: {image: p, volumes: [{name: a, emptyDir: {}}], volumeMounts: [{name: b, mountPath: /a}]}", `proxy.volumeMounts[0].name: "b" is not valid: mount one of proxy.volumes (a)`},
		{"proxy: {image: p, volumes: [{name: a, emptyDir: {}}], volumeMounts: [{name: a, mountPath: run}]}", `proxy.volumeMounts[0].mountPath: "run" is not valid: write an absolute path`},
		{"proxy: {image: p, volumes: [{name: a, emptyDir: {}}], volumeMounts: [{name: a, mountPath: /.detour/opt}]}", "proxy.volumeMounts[0].mountPath: /.detour/opt is not valid: detour mounts its own image at /.detour"},
		{"proxy: {image: p, volumes: [{name: a, emptyDir: {}}], volumeMounts: [{name: a, mountPath: /}]}", "detour mounts its own image at /.detour"},
		{"proxy: {image: p, volumes: [{name: a, emptyDir: {}}], volumeMounts: [{name: a, mountPath: /a}, {name: a, mountPath: /a/}]}", "proxy.volumeMounts[1].mountPath: /a/ is not valid: two mounts have this path"},
		{"proxy: {image: p, volumes: [{name: a, emptyDir: {}}], volumeMounts: [{name: a, mountPath: /a, mountPropagation: Bidirectional}]}", "proxy.volumeMounts[0].mountPropagation: Bidirectional is not valid: the proxy runs unprivileged"},
		{"proxy: {image: p, volumes: [{name: a, configMap: {}}]}", "proxy.volumes[0].configMap.name: is required"},
		{"proxy: {image: p, volumes: [{name: a, secret: {}}]}", "proxy.volumes[0].secret.secretName: is required"},
		{"proxy: {image: p, volumes: [{name: a, projected: {}}]}", "proxy.volumes[0].projected.sources: list at least one source"},
		{"proxy: {image: p, volumes: [{name: a, projected: {sources: [{serviceAccountToken: {audience: x}}]}}]}", "proxy.volumes[0].projected.sources[0].serviceAccountToken.path: is required"},
		{"proxy: {image: p, volumes: [{name: a, emptyDir: {}}], volumeMounts: [{name: a, mountPath: /a, subPath: ../etc}]}", `proxy.volumeMounts[0].subPath: "../etc" is not valid: write a path inside the volume`},
		{"proxy: {image: p, volumes: [{name: a, emptyDir: {}}], volumeMounts: [{name: a, mountPath: /a, subPath: /etc}]}", `proxy.volumeMounts[0].subPath: "/etc" is not valid`},
		{"proxy: {image: p, lifecycle: {preStop: {}}}", "proxy.lifecycle.preStop: set one of exec, httpGet or sleep"},
		{"proxy: {image: p, lifecycle: {preStop: {exec: {command: [a]}, sleep: {seconds: 1}}}}", "proxy.lifecycle.preStop: set one of exec, httpGet or sleep"},
		{"proxy: {image: p, lifecycle: {preStop: {tcpSocket: {port: 80}}}}", "proxy.lifecycle.preStop.tcpSocket: a tcpSocket hook is deprecated"},
		{"proxy: {image: p, lifecycle: {preStop: {exec: {}}}}", "proxy.lifecycle.preStop.exec.command: is required"},
		{"proxy: {image: p, lifecycle: {preStop: {sleep: {seconds: -1}}}}", "proxy.lifecycle.preStop.sleep.seconds: -1 is not valid"},
		{"proxy: {image: p, lifecycle: {postStart: {httpGet: {host: a.example, port: 80}}}}", `proxy.lifecycle.postStart.httpGet.host: "a.example" is not valid: remove it`},
	} {
		_, err := ParseConfig([]byte(tc.yaml))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ParseConfig(%q) error = %v, want one containing %q", tc.yaml, err, tc.want)
		}
	}
}

// The proxy gets its volumes, mounts, downward-API env and hooks in every validator and sidecar
// mode; detour's own image volume stays beside them, and admitting the pod again changes nothing.
func TestMutateProxyVolumes(t *testing.T) {
	cfg := kitConfig(t, "")
	for _, tc := range []struct {
		name string
		in   Input
	}{
		{"image-volume", folded},
		{"native/init-container", Input{NamespaceAnnotations: optedIn, NativeSidecars: true, Validator: annotations.ValidatorInitContainer}},
		{"container", Input{NamespaceAnnotations: optedIn, Validator: annotations.ValidatorInitContainer}},
	} {
		pod := newPod(func(p *corev1.Pod) {
			p.Spec.Volumes = []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}}}
		})
		res, err := Mutate(pod, tc.in, cfg)
		if err != nil || res.Outcome != Injected {
			t.Fatalf("%s: Mutate = %+v, %v", tc.name, res, err)
		}
		proxy := find(append(pod.Spec.InitContainers, pod.Spec.Containers...), annotations.ProxyContainer)
		var names []string
		for _, v := range pod.Spec.Volumes {
			names = append(names, v.Name)
		}
		want := "data proxy-config proxy-identity proxy-run"
		if tc.name == "image-volume" {
			want = "data proxy-config proxy-identity proxy-run detour-validator"
		}
		if got := strings.Join(names, " "); got != want {
			t.Errorf("%s: pod volumes %s, want %s", tc.name, got, want)
		}
		mounts := map[string]string{}
		for _, m := range proxy.VolumeMounts {
			mounts[m.Name] = m.MountPath
		}
		if mounts["proxy-config"] != "/etc/haproxy" || mounts["proxy-identity"] != "/var/run/secrets/mesh" || mounts["proxy-run"] != "/run/haproxy" {
			t.Errorf("%s: proxy mounts %+v", tc.name, proxy.VolumeMounts)
		}
		if len(proxy.Env) != 2 || proxy.Env[1].ValueFrom == nil || proxy.Env[1].ValueFrom.FieldRef.FieldPath != "status.podIP" {
			t.Errorf("%s: proxy env %+v, want the downward API's pod name and IP", tc.name, proxy.Env)
		}
		if proxy.Lifecycle == nil || proxy.Lifecycle.PreStop == nil || proxy.Lifecycle.PreStop.Sleep.Seconds != 2 {
			t.Errorf("%s: proxy lifecycle %+v, want its own preStop", tc.name, proxy.Lifecycle)
		}
		if tc.name == "image-volume" && (res.StartGate != annotations.StartGateHook || proxy.Lifecycle.PostStart == nil) {
			t.Errorf("%s: gate %q, postStart %+v: want detour's hook beside the proxy's preStop", tc.name, res.StartGate, proxy.Lifecycle.PostStart)
		}
		again := pod.DeepCopy()
		if _, err := Mutate(again, tc.in, cfg); err != nil || !reflect.DeepEqual(pod, again) {
			t.Errorf("%s: admitting the pod again changed it (%v):\n%s", tc.name, err, diffPods(pod, again))
		}
	}
}

// A pod volume with a proxy volume's name is refused, naming both; one the proxy does not use
// is the pod's.
func TestMutateProxyVolumeCollision(t *testing.T) {
	cfg := kitConfig(t, "")
	pod := newPod(func(p *corev1.Pod) {
		p.Spec.Volumes = []corev1.Volume{{Name: "proxy-run", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}}}
	})
	_, err := Mutate(pod, folded, cfg)
	if !IsDenial(err) || !strings.Contains(err.Error(), `the pod's volume "proxy-run" has the name of a volume detour adds for the proxy (the webhook configuration's proxy.volumes[2]): rename the pod's volume`) {
		t.Errorf("Mutate error = %v, want a denial naming both volumes", err)
	}
}

// A sleep hook longer than the pod's grace period, which the API server would refuse, denies
// the pod with what to change; a pod with a grace period long enough is injected.
func TestMutateProxySleepAndGracePeriod(t *testing.T) {
	cfg := kitConfig(t, "") // preStop sleeps 2 s
	short := newPod(func(p *corev1.Pod) { p.Spec.TerminationGracePeriodSeconds = ptr(int64(1)) })
	_, err := Mutate(short, folded, cfg)
	if !IsDenial(err) || !strings.Contains(err.Error(), "proxy.lifecycle.preStop.sleep.seconds (2) is longer than the pod's terminationGracePeriodSeconds (1)") {
		t.Errorf("Mutate error = %v, want a denial naming the sleep and the grace period", err)
	}
	for _, grace := range []*int64{nil, ptr(int64(2))} {
		if _, err := Mutate(newPod(func(p *corev1.Pod) { p.Spec.TerminationGracePeriodSeconds = grace }), folded, cfg); err != nil {
			t.Errorf("grace period %v: %v", grace, err)
		}
	}
}

// A pod injected with other proxy volumes (the configuration changed since, or detour inject
// ran with another) loses those that only the proxy mounted; a volume a container of the pod
// mounts too stays.
func TestMutateDropsOldProxyVolumes(t *testing.T) {
	old := kitConfig(t, "")
	pod := newPod()
	pod.Spec.Containers[0].VolumeMounts = []corev1.VolumeMount{{Name: "proxy-config", MountPath: "/shared"}}
	if _, err := Mutate(pod, folded, old); err != nil {
		t.Fatal(err)
	}
	now := gateConfig(t, "", tcpProbe) // no proxy volumes
	if _, err := Mutate(pod, folded, now); err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, v := range pod.Spec.Volumes {
		names = append(names, v.Name)
	}
	if got := strings.Join(names, " "); got != "proxy-config detour-validator" {
		t.Errorf("volumes %s, want the one the app mounts and detour's", got)
	}
}

// The proxy's own postStart hook leaves the start gate to the startup probe: a container has
// one postStart hook, and the proxy's is the admin's.
func TestProxyPostStartKeepsTheProbeGate(t *testing.T) {
	cfg := kitConfig(t, "  startGate: auto\n")
	cfg2, err := ParseConfig([]byte(`
proxy:
  image: proxy:test
  command: [/usr/sbin/haproxy]
  startupProbe: {tcpSocket: {port: 4191}}
  lifecycle: {postStart: {exec: {command: [/bin/true]}}}
validator: {image: "detour:test"}
`))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		cfg  *Config
		gate annotations.StartGateValue
	}{{cfg, annotations.StartGateHook}, {cfg2, annotations.StartGateProbe}} {
		pod := newPod()
		res, err := Mutate(pod, folded, c.cfg)
		proxy := find(pod.Spec.InitContainers, annotations.ProxyContainer)
		if err != nil || res.StartGate != c.gate {
			t.Errorf("gate %q (%v), want %q", res.StartGate, err, c.gate)
		}
		if c.gate == annotations.StartGateProbe && (proxy.Lifecycle.PostStart.Exec.Command[0] != "/bin/true" || proxy.StartupProbe == nil) {
			t.Errorf("proxy lifecycle %+v, startup probe %+v: want the proxy's own hook and the probe", proxy.Lifecycle, proxy.StartupProbe)
		}
	}
	// A pod that asks for the hook is told why it cannot have it.
	pod := newPod(annotate(annotations.ProxyStartGate, "hook"))
	res, _ := Mutate(pod, folded, cfg2)
	if res.StartGate != annotations.StartGateProbe || !strings.Contains(strings.Join(res.Warnings, "\n"), "proxy.lifecycle.postStart is the proxy's own hook") {
		t.Errorf("gate %q, warnings %q", res.StartGate, res.Warnings)
	}
}
