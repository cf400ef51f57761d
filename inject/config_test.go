package inject

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/internal/version"
)

func TestParseConfigDefaults(t *testing.T) {
	cfg, err := ParseConfig([]byte("proxy:\n  image: proxy:1\n"))
	if err != nil {
		t.Fatal(err)
	}
	p, v := cfg.Proxy, cfg.Validator
	if p.UID != 2102 || p.GID != 2102 || p.InboundPort != 4143 || p.OutboundPort != 4140 || len(p.AdminPorts) != 1 || p.AdminPorts[0] != 4191 ||
		p.ImagePullPolicy != corev1.PullIfNotPresent || p.Resources.Requests.Cpu().String() != "100m" {
		t.Errorf("proxy defaults = %+v", p)
	}
	if v.UID != 2103 || v.GID != 2103 || v.Timeout != 5*time.Second || v.Image != "ghcr.io/detourmesh/detour:"+version.Version || v.Sentinel != "" {
		t.Errorf("validator defaults = %+v", v)
	}
	if !cfg.InitEgress.All || cfg.GIDRange != (GIDRange{2600, 2699}) || cfg.ConflictPolicy != ConflictWarn || cfg.SidecarMode != SidecarAuto ||
		strings.Join(cfg.ExcludeNamespaces, ",") != "kube-system,kube-public,kube-node-lease" || cfg.DefaultInject != annotations.InjectDisabled {
		t.Errorf("defaults = %+v", cfg)
	}
	runtimeDefault := corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault}
	if !reflect.DeepEqual(p.SeccompProfile, runtimeDefault) || !reflect.DeepEqual(v.SeccompProfile, runtimeDefault) {
		t.Errorf("seccomp profiles default to %+v and %+v, want RuntimeDefault", p.SeccompProfile, v.SeccompProfile)
	}
	none, err := ParseConfig([]byte("proxy: {image: p, resources: {}}\nexcludeNamespaces: []\n"))
	if err != nil || len(none.ExcludeNamespaces) != 0 || len(none.Proxy.Resources.Requests) != 0 {
		t.Errorf("explicit empty values were defaulted: %+v, %v", none, err)
	}
}

func TestParseConfigErrors(t *testing.T) {
	for _, tc := range []struct{ yaml, want string }{
		{"", "proxy.image: is required"},
		{"proxy: {image: p, uid: 0}", "proxy.uid: 0 is not valid: use a non-root ID"},
		{"proxy: {image: p, gid: -1}", "proxy.gid: -1 is not valid"},
		{"proxy: {image: p, inboundPort: 70000}", "proxy.inboundPort: 70000 is not valid: a port is a whole number from 1 to 65535"},
		{"proxy: {image: p, inboundPort: 4140}", "proxy.outboundPort: 4140 is not valid: the inbound and outbound ports must differ"},
		{"proxy: {image: p, adminPorts: [4191, 4191]}", "proxy.adminPorts[1]: 4191 is not valid: the port is listed twice"},
		{"proxy: {image: p, adminPorts: [4143]}", "proxy.adminPorts[0]: 4143 is not valid: an admin port must differ"},
		{"proxy: {image: p, imagePullPolicy: Sometimes}", "proxy.imagePullPolicy: Sometimes is not valid"},
		{"proxy: {image: p, env: [{value: x}]}", "proxy.env[0].name: is required"},
		{"proxy: {image: p, resources: {requests: {cpu: 2}, limits: {cpu: 1}}}", "proxy.resources.requests.cpu: 2 is not valid: the request is above the limit 1"},
		{"proxy: {image: p, uid: 2103}", "validator.uid: 2103 is not valid: the validator must not run as the proxy's UID"},
		{"proxy: {image: p}\nvalidator: {timeout: -1s}", "validator.timeout: -1s is not valid"},
		{"proxy: {image: p}\nvalidator: {sentinel: 10.0.0.1}", `validator.sentinel: "10.0.0.1" is not valid: it must be an IPv4 address and port, such as 203.0.113.254:80`},
		{"proxy: {image: p}\nvalidator: {sentinel: \"sentinel.example:80\"}", `validator.sentinel: "sentinel.example:80" is not valid: it must be an IPv4 address and port`},
		{"proxy: {image: p}\nvalidator: {sentinel: \"127.0.0.1:80\"}", `it must be a unicast address outside the pod (loopback is never redirected)`},
		{"proxy: {image: p}\nvalidator: {sentinel6: \"203.0.113.1:80\"}", `validator.sentinel6: "203.0.113.1:80" is not valid: it must be an IPv6 address and port, such as [2001:db8::fe]:80`},
		{"proxy: {image: p}\ninitEgress: Migrate", `initEgress: "Migrate" is not valid`},
		{"proxy: {image: p}\ngidRange: {first: 2700, last: 2600}", "gidRange: 2700-2600 is not valid: first must not be above last"},
		{"proxy: {image: p}\ngidRange: {first: 0}", "gidRange.first: 0 is not valid"},
		{"proxy: {image: p}\ngidRange: {first: 1, last: 100000}", "reserve at most 65536 GIDs"},
		{"proxy: {image: p}\ngidRange: {first: 2100, last: 2199}", "the range holds the proxy's GID 2102"},
		{"proxy: {image: p, gid: 1}\ngidRange: {first: 2100, last: 2199}", "the range holds the validator's GID 2103, which must never be exempt"},
		{"proxy: {image: p}\nconflictPolicy: block", `conflictPolicy: "block" is not valid: use "warn" or "deny"`},
		{"proxy: {image: p}\nsidecarMode: sidecar", `sidecarMode: "sidecar" is not valid`},
		{"proxy: {image: p}\nexcludeNamespaces: [Kube_System]", `excludeNamespaces[0]: "Kube_System" is not valid`},
		{"proxy: {image: p}\ndefaultInject: all", `defaultInject: "all" is not valid: use "disabled"`},
		{"proxy: {image: p}\nproxyy: {}", `unknown field "proxyy"`},
		{"proxy: [1]", "decode"},
		{"proxy: {image: p, seccompProfile: {type: runtime/default}}", `proxy.seccompProfile.type: "runtime/default" is not valid: use RuntimeDefault`},
		{"proxy: {image: p, seccompProfile: {localhostProfile: a.json}}", "proxy.seccompProfile.type: is required"},
		{"proxy: {image: p, seccompProfile: {type: Localhost}}", `proxy.seccompProfile.localhostProfile: "" is not valid: type Localhost needs the profile's path relative to the kubelet's seccomp directory`},
		{"proxy: {image: p}\nvalidator: {seccompProfile: {type: Localhost, localhostProfile: /etc/a.json}}", `validator.seccompProfile.localhostProfile: "/etc/a.json" is not valid`},
		{"proxy: {image: p}\nvalidator: {seccompProfile: {type: Localhost, localhostProfile: ../a.json}}", `validator.seccompProfile.localhostProfile: "../a.json" is not valid`},
		{"proxy: {image: p, seccompProfile: {type: RuntimeDefault, localhostProfile: a.json}}", `proxy.seccompProfile.localhostProfile: "a.json" is not valid: only type Localhost takes a localhostProfile`},
		{"proxy: {image: p, readinessProbe: {httpGet: {host: 10.0.0.1, port: 4191}}}", `proxy.readinessProbe.httpGet.host: "10.0.0.1" is not valid: remove it`},
		{"proxy: {image: p, startupProbe: {tcpSocket: {host: example.com, port: 4191}}}", `proxy.startupProbe.tcpSocket.host: "example.com" is not valid: remove it`},
	} {
		_, err := ParseConfig([]byte(tc.yaml))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ParseConfig(%q) error = %v, want one containing %q", tc.yaml, err, tc.want)
		}
	}
	// Every bad field is reported, not just the first.
	_, err := ParseConfig([]byte("proxy: {uid: 0}\nsidecarMode: x"))
	if err == nil || !strings.Contains(err.Error(), "proxy.image") || !strings.Contains(err.Error(), "proxy.uid") || !strings.Contains(err.Error(), "sidecarMode") {
		t.Errorf("error = %v, want all three fields", err)
	}
}

// The seccomp profiles are the configuration's: each container's own, Localhost with its
// path, or Unconfined (which the restricted Pod Security Standard refuses, the admin's choice).
func TestParseConfigSeccompProfile(t *testing.T) {
	cfg, err := ParseConfig([]byte("proxy: {image: p, seccompProfile: {type: Localhost, localhostProfile: profiles/proxy.json}}\nvalidator: {seccompProfile: {type: Unconfined}}\n"))
	if err != nil {
		t.Fatal(err)
	}
	local := "profiles/proxy.json"
	if want := (corev1.SeccompProfile{Type: corev1.SeccompProfileTypeLocalhost, LocalhostProfile: &local}); !reflect.DeepEqual(cfg.Proxy.SeccompProfile, want) {
		t.Errorf("proxy.seccompProfile = %+v, want %+v", cfg.Proxy.SeccompProfile, want)
	}
	if cfg.Validator.SeccompProfile.Type != corev1.SeccompProfileTypeUnconfined {
		t.Errorf("validator.seccompProfile = %+v, want Unconfined", cfg.Validator.SeccompProfile)
	}
	pod := newPod()
	if _, err := Mutate(pod, Input{NamespaceAnnotations: optedIn}, cfg); err != nil {
		t.Fatal(err)
	}
	for _, c := range append(pod.Spec.InitContainers, pod.Spec.Containers...) {
		want := map[string]corev1.SeccompProfileType{annotations.ProxyContainer: corev1.SeccompProfileTypeLocalhost, annotations.ValidatorContainer: corev1.SeccompProfileTypeUnconfined}[c.Name]
		if want == "" {
			continue
		}
		if sp := c.SecurityContext.SeccompProfile; sp == nil || sp.Type != want {
			t.Errorf("%s: seccompProfile %+v, want %s", c.Name, sp, want)
		}
	}
}

func TestLoadConfig(t *testing.T) {
	path := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(path, []byte("proxy: {image: p}\nsidecarMode: native\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg, err := LoadConfig(path, func(f *File) { f.SidecarMode = "container" })
	if err != nil || cfg.SidecarMode != SidecarContainer {
		t.Errorf("LoadConfig with an override = %+v, %v", cfg, err)
	}
	if _, err := LoadConfig(filepath.Join(t.TempDir(), "missing.yaml")); err == nil || !strings.Contains(err.Error(), "read webhook config") {
		t.Errorf("missing file error = %v", err)
	}
	if err := os.WriteFile(path, []byte("proxy: {image: p, uid: 0}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadConfig(path); err == nil || !strings.Contains(err.Error(), path+": proxy.uid") {
		t.Errorf("error = %v, want the file and the field", err)
	}
}

// Any configuration file either parses into a configuration that keeps the invariants the
// mutation relies on, or is refused with an error; it never panics.
func FuzzParseConfig(f *testing.F) {
	f.Add([]byte("proxy: {image: proxy:1}\n"))
	f.Add([]byte("proxy: {image: p, uid: 1000, inboundPort: 15006, outboundPort: 15001, adminPorts: [15020, 15021]}\nvalidator: {uid: 1001, sentinel: \"192.0.2.1:80\", sentinel6: \"[2001:db8::1]:80\"}\ngidRange: {first: 3000, last: 3010}\nconflictPolicy: deny\nsidecarMode: native\ninitEgress: \"migrate,fetch\"\n"))
	f.Add([]byte("proxy: {image: p, resources: {requests: {cpu: 1}}}\nexcludeNamespaces: []\n"))
	f.Add([]byte("proxy: {image: p}\ndefaultInject: enabled\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		cfg, err := ParseConfig(data)
		if err != nil {
			return
		}
		p, v := cfg.Proxy, cfg.Validator
		switch {
		case p.Image == "":
			t.Fatal("accepted a configuration without a proxy image")
		case p.UID == 0 || v.UID == 0 || p.UID == v.UID:
			t.Fatalf("accepted proxy UID %d and validator UID %d", p.UID, v.UID)
		case p.InboundPort == 0 || p.OutboundPort == 0 || p.InboundPort == p.OutboundPort:
			t.Fatalf("accepted proxy ports %d and %d", p.InboundPort, p.OutboundPort)
		case cfg.GIDRange.First == 0 || cfg.GIDRange.First > cfg.GIDRange.Last:
			t.Fatalf("accepted gidRange %v", cfg.GIDRange)
		case cfg.GIDRange.Contains(p.GID) || cfg.GIDRange.Contains(v.GID):
			t.Fatalf("accepted gidRange %v holding the proxy's GID %d or the validator's %d", cfg.GIDRange, p.GID, v.GID)
		case cfg.DefaultInject != annotations.InjectEnabled && cfg.DefaultInject != annotations.InjectDisabled:
			t.Fatalf("accepted defaultInject %q", cfg.DefaultInject)
		}
	})
}
