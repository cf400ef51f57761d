package cli

import (
	"bytes"
	"flag"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/internal/manifest"
	"github.com/detourmesh/detour/internal/version"
	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/test/testenv"
)

var updateGolden = flag.Bool("update", false, "rewrite the golden files in testdata/workloads/golden from the current output")

func TestMain(m *testing.M) { testenv.Main(m) }

const workloads = "../../testdata/workloads"

// run runs the detour command with args and returns its stdout and stderr.
func run(t *testing.T, stdin string, args ...string) (string, string, error) {
	t.Helper()
	root := NewRoot()
	var out, errOut bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&errOut)
	root.SetIn(strings.NewReader(stdin))
	root.SetArgs(args)
	err := root.Execute()
	return out.String(), errOut.String(), err
}

func golden(t *testing.T, name, got string) {
	t.Helper()
	testenv.Golden(t, filepath.Join(workloads, "golden", name), got, *updateGolden)
}

// goldenVersion pins the injected marker, so the golden files do not depend on the build.
func goldenVersion(t *testing.T) {
	old := version.Version
	version.Version = "v0.0.0-golden"
	t.Cleanup(func() { version.Version = old })
}

var goldenInjectArgs = []string{"--proxy-image=proxy.example/proxy:golden", "--validator-image=detour:golden"}

func TestInjectGolden(t *testing.T) {
	goldenVersion(t)
	for _, tc := range []struct {
		file   string
		native bool
		// config is a configuration file of testdata/workloads/config, its name added to
		// the golden files'.
		config string
	}{
		{"demo.yaml", true, ""},
		{"pod-basic.yaml", true, ""},
		{"deployment-mixed.yaml", false, ""},
		{"statefulset-pod-defaults.yaml", false, ""},
		{"job-native.yaml", true, ""},
		{"cronjob-subset.yaml", false, ""},
		{"list.yaml", false, ""},
		{"multi.yaml", false, ""},
		// The check in the proxy's start: the image volume and the node selector are written
		// too (issue 32, item 3b), in a Pod and in templates.
		{"pod-basic.yaml", true, "image-volume"},
		{"job-native.yaml", true, "image-volume"},
		{"list.yaml", true, "image-volume"},
		// The start gate as detour's postStart hook: the startup probe goes (issue 36).
		{"pod-basic.yaml", true, "hook"},
		{"job-native.yaml", true, "hook"},
		// What a production proxy needs: volumes, downward-API env, its own preStop (issue 43).
		{"pod-basic.yaml", true, "haproxy"},
		{"deployment-mixed.yaml", false, "haproxy"},
	} {
		name := strings.TrimSuffix(tc.file, ".yaml")
		if tc.config != "" {
			name += "-" + tc.config
		}
		t.Run(name, func(t *testing.T) {
			args := append([]string{"inject", "-f", filepath.Join(workloads, tc.file)}, goldenInjectArgs...)
			if tc.config != "" {
				args = append(args, "--config="+filepath.Join(workloads, "config", tc.config+".yaml"))
			}
			if !tc.native {
				args = append(args, "--native-sidecars=false")
			}
			out, errOut, err := run(t, "", args...)
			if err != nil {
				t.Fatalf("detour %s: %v\n%s", strings.Join(args, " "), err, errOut)
			}
			base := name
			golden(t, base+".yaml", out)
			golden(t, base+".stderr", errOut)

			// Injecting the output again changes nothing: the webhook is idempotent.
			again, _, err := run(t, out, append([]string{"inject", "-f", "-"}, args[3:]...)...)
			if err != nil || again != out {
				t.Errorf("injecting the output again changed it (%v):\n%s", err, again)
			}
			// The output carries its own opt-in: admitted in a namespace that is not opted in (here opted out),
			// it is injected the same way instead of being skipped and losing detour's containers.
			elsewhere, errOut, err := run(t, out, append(append([]string{"inject", "-f", "-"}, args[3:]...), "--namespace-annotation=detour.dev/inject=disabled")...)
			if err != nil || elsewhere != out || strings.Contains(errOut, "removed its containers") {
				t.Errorf("the output admitted in a namespace that is not opted in changed (%v):\n%s\n%s", err, elsewhere, errOut)
			}
		})
	}
}

func TestInjectStdinAndErrors(t *testing.T) {
	pod := "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  initContainers: [{name: i, image: busybox}]\n  containers: [{name: a, image: nginx}]\n"
	out, errOut, err := run(t, pod, append([]string{"inject", "-f", "-", "--sidecar-mode=container"}, goldenInjectArgs...)...)
	if err != nil || !strings.Contains(out, "name: "+annotations.ProxyContainer) || !strings.Contains(errOut, `Warning: Pod p: detour: init container "i" runs as its image's default user; it keeps egress through GID 2600`) {
		t.Errorf("stdin injection: %v\nstdout:\n%s\nstderr:\n%s", err, out, errOut)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"inject", "-f", "-"}, "proxy.image: is required"},
		{[]string{"inject", "-f", "-", "--proxy-image=p", "--sidecar-mode=sidecar"}, `sidecarMode: "sidecar" is not valid`},
		{[]string{"inject", "-f", "-", "--proxy-image=p", "--gid-range=10"}, "--gid-range"},
		{[]string{"inject", "-f", "-", "--proxy-image=p", "--proxy-uid=0"}, "proxy.uid: 0 is not valid"},
		{[]string{"inject", "-f", "-", "--proxy-image=p", "--namespace-annotation=x"}, "key=value"},
		{[]string{"inject", "-f", "/nonexistent.yaml", "--proxy-image=p"}, "no such file"},
	} {
		out, _, err := run(t, pod, tc.args...)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("detour %v: error %v, want one containing %q", tc.args, err, tc.want)
		}
		if out != "" {
			t.Errorf("detour %v wrote output on failure:\n%s", tc.args, out)
		}
	}
	// Denied: the app runs as UID 2600, the only GID of the range, so the init container
	// cannot get a dedicated GID.
	denied := strings.Replace(pod, "{name: a, image: nginx}", "{name: a, image: nginx, securityContext: {runAsUser: 2600}}", 1)
	args := []string{"inject", "-f", "-", "--proxy-image=p", "--sidecar-mode=container", "--conflict-policy=deny", "--gid-range=2600-2600"}
	if out, _, err := run(t, denied, args...); err == nil || !strings.Contains(err.Error(), `Pod p: detour: init container "i" needs network access`) || out != "" {
		t.Errorf("detour %v: error %v, output %q; want a denial and no output", args, err, out)
	}
}

// detour rules takes the first pod or pod template of a stream, as detour inject finds them:
// after other documents, and inside a List.
func TestRulesFindsThePod(t *testing.T) {
	goldenVersion(t)
	injected, _, err := run(t, "", append([]string{"inject", "-f", filepath.Join(workloads, "deployment-mixed.yaml")}, goldenInjectArgs...)...)
	if err != nil {
		t.Fatal(err)
	}
	want, _, err := run(t, injected, "rules", "-f", "-")
	if err != nil {
		t.Fatal(err)
	}
	service := "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec: {ports: [{port: 80}]}\n"
	multi := service + "---\n" + injected
	got, _, err := run(t, multi, "rules", "-f", "-")
	if err != nil || got != want {
		t.Errorf("rules of a Service then the Deployment: %v\n%s\nwant the Deployment's:\n%s", err, got, want)
	}
	list, err := yaml.YAMLToJSON([]byte(injected))
	if err != nil {
		t.Fatal(err)
	}
	svc, _ := yaml.YAMLToJSON([]byte(service))
	got, _, err = run(t, `{"apiVersion":"v1","kind":"List","items":[`+string(svc)+`,`+string(list)+`]}`, "rules", "-f", "-")
	if err != nil || got != want {
		t.Errorf("rules of a List: %v\n%s\nwant the Deployment's:\n%s", err, got, want)
	}
}

// detour inject says so when it passes through a kind it does not know that holds a pod
// template (an Argo Rollout): that template is not injected.
func TestInjectUnknownKindWithTemplate(t *testing.T) {
	rollout := "apiVersion: argoproj.io/v1alpha1\nkind: Rollout\nmetadata: {name: web, namespace: shop}\n" +
		"spec:\n  template:\n    spec:\n      containers: [{name: app, image: nginx}]\n"
	out, errOut, err := run(t, rollout, append([]string{"inject", "-f", "-"}, goldenInjectArgs...)...)
	if err != nil || out != rollout {
		t.Fatalf("inject of a Rollout: %v, output %q; want it unchanged", err, out)
	}
	if !strings.Contains(errOut, "Warning: Rollout shop/web: left unchanged: detour inject does not know the kind Rollout, although it has a pod template at .spec.template") {
		t.Errorf("stderr = %q, want a warning that the Rollout's template was not injected", errOut)
	}
	cm := "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata: {template: x}\n"
	if _, errOut, err := run(t, cm, append([]string{"inject", "-f", "-"}, goldenInjectArgs...)...); err != nil || errOut != "" {
		t.Errorf("inject of a ConfigMap: %v, stderr %q; want silence", err, errOut)
	}
}

// detour rules prints exactly the ruleset the plugin builds from the injected annotations.
func TestRules(t *testing.T) {
	goldenVersion(t)
	injected, _, err := run(t, "", append([]string{"inject", "-f", filepath.Join(workloads, "deployment-mixed.yaml")}, goldenInjectArgs...)...)
	if err != nil {
		t.Fatal(err)
	}
	out, _, err := run(t, injected, "rules", "-f", "-")
	if err != nil {
		t.Fatal(err)
	}
	golden(t, "deployment-mixed.rules", out)

	_, a, err := manifest.PodAnnotations(strings.NewReader(injected))
	if err != nil {
		t.Fatal(err)
	}
	r, err := annotations.ParseRedirect(a)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
		rs, err := iptables.Build(iptables.ConfigFromRedirect(r, f))
		if err != nil {
			t.Fatal(err)
		}
		one, _, err := run(t, injected, "rules", "-f", "-", "--family="+f.String())
		if err != nil || one != rs.Restore() {
			t.Errorf("detour rules --family=%s = %q, %v; want the plugin's ruleset %q", f, one, err, rs.Restore())
		}
		if !strings.Contains(out, rs.Restore()) {
			t.Errorf("detour rules does not print the %s ruleset", f)
		}
	}
	for _, want := range []string{"--gid-owner 2600", "--uid-owner 1001", "--dports 4191,9090", "-d 169.254.169.254/32", "-d fd00:ec2::254/128"} {
		if !strings.Contains(out, want) {
			t.Errorf("rules lack %q:\n%s", want, out)
		}
	}

	for _, tc := range []struct{ stdin, want string }{
		{"apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n", "Pod p is not injected"},
		{"apiVersion: v1\nkind: Pod\nmetadata: {name: p, annotations: {detour.dev/injected: v1, detour.dev/proxy-uid: \"0\"}}\n", "detour.dev/proxy-uid"},
		{"apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n", "no pod found in ConfigMap c"},
		{"", "no object found"},
	} {
		if _, _, err := run(t, tc.stdin, "rules", "-f", "-"); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("rules on %q: error %v, want %q", tc.stdin, err, tc.want)
		}
	}
}

// detour rules --backend nftables (or auto) prints the nftables backend's table, as BuildNFT
// makes it.
func TestRulesNFTables(t *testing.T) {
	goldenVersion(t)
	injected, _, err := run(t, "", append([]string{"inject", "-f", filepath.Join(workloads, "deployment-mixed.yaml")}, goldenInjectArgs...)...)
	if err != nil {
		t.Fatal(err)
	}
	out, _, err := run(t, injected, "rules", "-f", "-", "--backend", "nftables")
	if err != nil {
		t.Fatal(err)
	}
	golden(t, "deployment-mixed.nftables", out)
	_, a, _ := manifest.PodAnnotations(strings.NewReader(injected))
	r, err := annotations.ParseRedirect(a)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := iptables.BuildNFT(iptables.ConfigFromRedirect(r, iptables.IPv4), iptables.ConfigFromRedirect(r, iptables.IPv6))
	if out != want.String() {
		t.Errorf("detour rules --backend nftables is not the plugin's table:\n%s", out)
	}
	if auto, _, err := run(t, injected, "rules", "-f", "-", "--backend", "auto"); err != nil || auto != out {
		t.Errorf("rules --backend auto is not the nftables table, auto's choice in a fresh namespace (%v):\n%s", err, auto)
	}
	if _, _, err := run(t, injected, "rules", "-f", "-", "--backend", "ebpf"); err == nil || !strings.Contains(err.Error(), `--backend "ebpf"`) {
		t.Errorf("rules --backend ebpf: %v", err)
	}
}
