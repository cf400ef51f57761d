package framework

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/mutate"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/detourmesh/detour/test/images"
)

// InstallDetour installs (or upgrades) detour's chart into [DetourNamespace] with the e2e
// values and extra (YAML, applied over them), and waits for the webhook. The node agent is
// scheduled only on nodes labelled [AgentLabel]=yes, so a story decides when it arrives
// ([Env.SetAgent]).
func (e *Env) InstallDetour(t testing.TB, ctx context.Context, extra string) {
	t.Helper()
	e.helmInstall(t, ctx, e.img, extra, true)
}

// InstallDetourRefused is [Env.InstallDetour] for values the node agents are meant to refuse
// (they never become Ready): it does not wait for the release's pods.
func (e *Env) InstallDetourRefused(t testing.TB, ctx context.Context, extra string) {
	t.Helper()
	e.helmInstall(t, ctx, e.img, extra, false)
}

// helmInstall installs or upgrades detour's release from img's chart with the e2e values for
// img's images and extra over them, and waits for its pods when wait is true.
func (e *Env) helmInstall(t testing.TB, ctx context.Context, img imageSet, extra string, wait bool) {
	t.Helper()
	values := filepath.Join(e.Node.Dir, "values.yaml")
	if err := os.WriteFile(values, []byte(e.values(img)), 0o644); err != nil {
		t.Fatal(err)
	}
	extraPath := filepath.Join(e.Node.Dir, "values-extra.yaml")
	if err := os.WriteFile(extraPath, []byte(extra), 0o644); err != nil {
		t.Fatal(err)
	}
	args := append(append([]string{"upgrade", "--install", "detour"}, img.chart...),
		"--namespace", DetourNamespace, "--create-namespace", "--values", values, "--values", extraPath)
	if wait {
		args = append(args, "--wait", "--timeout", "4m")
	}
	out, err := e.Node.Helm(ctx, args...)
	if err != nil {
		t.Fatalf("helm install detour: %v\n%s\n%s", err, out, e.Describe(ctx, DetourNamespace))
	}
}

// AgentLabel gates the node agent's DaemonSet in the e2e values: it runs on the nodes labelled
// AgentLabel=yes.
const AgentLabel = "e2e.detour.dev/agent"

// values are the chart values the e2e installs with: detour's image of img, the run's proxy
// (Env.Proxy), the node's CNI directories, the plugin's log where the test reads it.
func (e *Env) values(img imageSet) string {
	return fmt.Sprintf(`createNamespace: false
image:
  repository: %[1]s
  tag: %[2]s
  pullPolicy: %[3]s
webhook:
  replicas: 1
  failurePolicy: Fail
  config:
%[8]snodeAgent:
  cniConfDir: %[4]s
  cniBinDir: %[5]s
  resync: 2s
  nodeSelector:
    %[6]s: "yes"
  plugin:
    logLevel: debug
    logFile: %[7]s
  repair:
    rate: 5
    burst: 5
`, img.repo, img.tag, img.pull, e.Node.CNIConfDir, e.Node.CNIBinDir, AgentLabel, e.PluginLogPath(), cmp.Or(img.proxy, e.Proxy).webhookConfig(img))
}

// importedImages are the images as the node imported them and the chart's directory.
func (e *Env) importedImages() imageSet {
	return imageSet{
		repo: e.Artifacts.Repo, tag: e.Artifacts.Tag, refs: e.Artifacts.Refs, pull: corev1.PullNever,
		chart: []string{filepath.Join(e.Root, "manifests", "charts", "detour")},
	}
}

// EnsureInstalled installs detour with its node agent on the control-plane node (a no-op
// upgrade when a story already did), for a test or benchmark that runs without TestE2E's
// stories before it.
func (e *Env) EnsureInstalled(t testing.TB, ctx context.Context) {
	t.Helper()
	e.InstallDetour(t, ctx, "")
	e.SetAgent(t, ctx, true)
}

// SetAgent puts the node agent on the control-plane node (present) or takes it away.
func (e *Env) SetAgent(t testing.TB, ctx context.Context, present bool) {
	t.Helper()
	e.SetNodeAgent(t, ctx, e.Node, present)
}

// SetNodeAgent puts the node agent on node n (present) or takes it away, and waits for its
// pod to be ready, or gone.
func (e *Env) SetNodeAgent(t testing.TB, ctx context.Context, n *Node, present bool) {
	t.Helper()
	value := "null"
	if present {
		value = `"yes"`
	}
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%s}}}`, AgentLabel, value)
	if _, err := e.Node.Client.CoreV1().Nodes().Patch(ctx, n.Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	WaitFor(t, ctx, fmt.Sprintf("the node agent on %s to be present=%v", n.Name, present), 2*time.Minute, func() (bool, error) {
		p, err := e.AgentPod(ctx, n.Name)
		if err != nil {
			return false, err
		}
		if !present {
			return p == nil, Seen("agent %s", AgentState(p))
		}
		return p != nil && PodReady(p) && p.DeletionTimestamp == nil, Seen("agent %s", AgentState(p))
	})
}

// UseRegistry moves the e2e to the cluster's registry, starting it on first use: the test
// images are pushed there, detour's image by `make image-push` and its chart by `helm push`
// (both run on the control-plane node, where the registry's address is reachable); detour is
// then installed from the OCI chart with every image pulled (pull policy IfNotPresent).
// [Env.UseImported] moves it back.
func (e *Env) UseRegistry(t testing.TB, ctx context.Context) {
	t.Helper()
	if e.Registry == nil {
		r, err := e.Node.StartRegistry()
		if err != nil {
			t.Fatal(err)
		}
		// Closed at the end of the run (TestMain), or now if it never holds every image.
		ready := false
		defer func() {
			if !ready {
				r.Close()
			}
		}()
		// The registry's images are not the imported ones: the kubelet (with
		// KubeletEnsureSecretPulledImages, on by default) treats an image it once pulled as
		// pulled, not preloaded, under every name it has, and then refuses it to the pods that
		// name it with pull policy Never — as it would on a real node.
		for ref, img := range e.Artifacts.testImages {
			cfg, err := img.ConfigFile()
			if err != nil {
				t.Fatal(err)
			}
			cfg = cfg.DeepCopy()
			cfg.Config.Labels = map[string]string{"dev.detour.e2e.source": "registry"}
			if img, err = mutate.ConfigFile(img, cfg); err != nil {
				t.Fatal(err)
			}
			if err := r.Push(ctx, r.Ref(ref), img); err != nil {
				t.Fatal(err)
			}
		}
		repo := r.Host + "/detour"
		bin := filepath.Join(e.Node.Dir, "image-push-bin")
		out, stderr, err := e.Node.RunSplit(ctx, goEnv(t), "make", "-C", e.Root, "image-push",
			"IMAGE="+repo+":"+e.Artifacts.Tag, "VERSION="+e2eVersion(e.Root)+".registry", "BIN="+bin)
		if err != nil {
			t.Fatalf("make image-push: %v\n%s\n%s", err, out, stderr)
		}
		chartDir := filepath.Join(e.Node.Dir, "chart-package")
		out, err = e.Node.Helm(ctx, "package", filepath.Join(e.Root, "manifests", "charts", "detour"), "--destination", chartDir)
		if err != nil {
			t.Fatalf("helm package: %v\n%s", err, out)
		}
		packaged, err := filepath.Glob(filepath.Join(chartDir, "detour-*.tgz"))
		if err != nil || len(packaged) != 1 {
			t.Fatalf("helm package wrote %v (%v)", packaged, err)
		}
		if out, err := e.Node.Helm(ctx, "push", packaged[0], "oci://"+r.Host+"/charts", "--plain-http"); err != nil {
			t.Fatalf("helm push: %v\n%s", err, out)
		}
		version := strings.TrimSuffix(strings.TrimPrefix(filepath.Base(packaged[0]), "detour-"), ".tgz")
		e.registryImages = imageSet{
			repo: repo, tag: e.Artifacts.Tag, pull: corev1.PullIfNotPresent,
			refs: images.Refs{
				Pause: r.Ref(e.Artifacts.Refs.Pause), Proxy: r.Ref(e.Artifacts.Refs.Proxy), Workload: r.Ref(e.Artifacts.Refs.Workload),
				WorkloadNumeric: r.Ref(e.Artifacts.Refs.WorkloadNumeric), WorkloadNamed: r.Ref(e.Artifacts.Refs.WorkloadNamed),
				HAProxy: r.Ref(e.Artifacts.Refs.HAProxy),
			},
			chart: []string{"oci://" + r.Host + "/charts/detour", "--version", version, "--plain-http"},
		}
		e.Registry, ready = r, true
	}
	e.img = e.registryImages
	e.InstallDetour(t, ctx, "")
}

// UseImported moves the e2e back from the registry ([Env.UseRegistry]) to the images the nodes
// imported and the chart's directory, and installs detour from there again.
func (e *Env) UseImported(t testing.TB, ctx context.Context) {
	t.Helper()
	e.img = e.importedImages()
	e.InstallDetour(t, ctx, "")
}

// goEnv is the environment a go command run inside a node needs to find this process's
// toolchain, module cache and build cache (the node's HOME is its own directory).
func goEnv(t testing.TB) []string {
	t.Helper()
	out, err := exec.Command("go", "env", "GOROOT", "GOPATH", "GOMODCACHE", "GOCACHE", "GOPROXY", "GOFLAGS").Output()
	if err != nil {
		t.Fatalf("go env: %v", err)
	}
	lines := strings.Split(string(out), "\n")
	names := []string{"GOROOT", "GOPATH", "GOMODCACHE", "GOCACHE", "GOPROXY", "GOFLAGS"}
	env := []string{"PATH=" + os.Getenv("PATH")}
	for i, name := range names {
		if i < len(lines) {
			env = append(env, name+"="+lines[i])
		}
	}
	return env
}
