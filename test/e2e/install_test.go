package e2e

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/internal/clustercheck"
	"github.com/detourmesh/detour/test/e2e/framework"
)

// uninstallHelm: `helm uninstall` leaves no detour configuration on the node (no drop-in, no
// entry in the conflist), running pods keep working, new pods start uninjected.
func uninstallHelm(t *testing.T, ctx context.Context, e *framework.Env) {
	web, err := e.Pods(ctx, "shop", "app=web")
	if err != nil || len(web) == 0 {
		t.Fatalf("no web pod to keep running: %v", err)
	}
	// As docs/operations.md says: not in the middle of the agent's rollout (helm upgrade --wait
	// returns once the new pod is scheduled: maxUnavailable rounds up to the one node), whose
	// new pod would be deleted before it could remove anything.
	if stdout, stderr, err := e.Node.Kubectl(ctx, "-n", framework.DetourNamespace, "rollout", "status", "daemonset/detour-node-agent", "--timeout=3m"); err != nil {
		t.Fatalf("kubectl rollout status: %v\n%s%s", err, stdout, stderr)
	}
	// What the agent decided at SIGTERM, for when its configuration stays.
	logs, err := e.HoldAgentLogs(ctx, e.Node)
	if err != nil {
		t.Fatal(err)
	}
	defer logs.Close()
	defer func() {
		if t.Failed() {
			t.Logf("the node agent's log at SIGTERM: %s", logs.AtSIGTERM())
		}
	}()
	if out, err := e.Node.Helm(ctx, "uninstall", "detour", "--namespace", framework.DetourNamespace, "--wait", "--timeout", "2m"); err != nil {
		t.Fatalf("helm uninstall: %v\n%s", err, out)
	}
	e.WaitDetourConfigs(t, ctx, "detour's drop-in and entry to leave the node")
	e.AssertCaptured(t, ctx, web[0], "web")
	report, failed := e.CheckCluster(t, ctx)
	if !failed {
		t.Errorf("detour check --cluster exited 0 after helm uninstall")
	}
	framework.WantCheck(t, report, "detour-namespace", clustercheck.Error, "not installed")
	if _, err := e.Node.Client.CoreV1().Pods("shop").Create(ctx, e.Pod("after", "shop"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p := e.WaitReady(t, ctx, "shop", "name=after", 1)[0]
	if annotations.IsInjected(p.Annotations) || len(p.Spec.InitContainers) != len(e.Pod("after", "shop").Spec.InitContainers) {
		t.Errorf("a pod created after uninstall was injected: %v", p.Spec.InitContainers)
	}
}

// installManifest: manifests/install.yaml, applied with kubectl, runs detour as the chart
// does: the webhook injects, the node agent chains the plugin, an injected pod runs with its
// rules. Only what a cluster admin on another node would change changes: the CNI directories
// are the node's, and the images the manifest names are tags of the ones built for the e2e.
// Deleting the manifest takes detour's entry out of the conflist again.
func installManifest(t *testing.T, ctx context.Context, e *framework.Env) {
	manifest := framework.ReadFile(filepath.Join(e.Root, "manifests", "install.yaml"))
	// The manifest names no proxy: its ConfigMap asks for one, as a user sets it.
	if !strings.Contains(manifest, "\n      image: \"\"\n") {
		t.Fatal(`install.yaml has no empty proxy image (image: "") to set`)
	}
	manifest = strings.Replace(manifest, "\n      image: \"\"\n", "\n      image: "+e.Artifacts.Refs.Proxy+"\n", 1)
	for _, m := range regexp.MustCompile(`image: (ghcr\.io/detourmesh/detour:\S+)`).FindAllStringSubmatch(manifest, -1) {
		src := e.Artifacts.Repo + ":" + e.Artifacts.Tag
		if out, err := e.Node.Run(ctx, e.Node.Ctr("images", "tag", "--force", src, m[1])...); err != nil {
			t.Fatalf("tag %s as %s: %v\n%s", src, m[1], err, out)
		}
	}
	manifest = strings.NewReplacer("/etc/cni/net.d", e.Node.CNIConfDir, "/opt/cni/bin", e.Node.CNIBinDir).Replace(manifest)
	path := filepath.Join(e.Node.Dir, "install.yaml")
	if err := os.WriteFile(path, []byte(manifest), 0o644); err != nil {
		t.Fatal(err)
	}
	if stdout, stderr, err := e.Node.Kubectl(ctx, "apply", "-f", path); err != nil {
		t.Fatalf("kubectl apply -f install.yaml: %v\n%s%s", err, stdout, stderr)
	}
	for _, rollout := range []string{"deployment/detour-webhook", "daemonset/detour-node-agent"} {
		if stdout, stderr, err := e.Node.Kubectl(ctx, "-n", framework.DetourNamespace, "rollout", "status", rollout, "--timeout=3m"); err != nil {
			t.Fatalf("kubectl rollout status %s: %v\n%s%s\n%s", rollout, err, stdout, stderr, e.Describe(ctx, framework.DetourNamespace))
		}
	}
	e.Namespace(t, ctx, "manifest", true)
	if _, err := e.Node.Client.CoreV1().Pods("manifest").Create(ctx, e.Pod("m", "manifest"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p := e.WaitReady(t, ctx, "manifest", "name=m", 1)[0]
	if !annotations.IsInjected(p.Annotations) {
		t.Errorf("pod m is not injected: %v", p.Annotations)
	}
	if code := framework.CheckExit(&p); code != 0 {
		t.Errorf("pod m: the validator exited %d, want 0", code)
	}
	e.AssertCaptured(t, ctx, p, "m")

	if stdout, stderr, err := e.Node.Kubectl(ctx, "delete", "-f", path, "--wait", "--timeout=2m"); err != nil {
		t.Fatalf("kubectl delete -f install.yaml: %v\n%s%s", err, stdout, stderr)
	}
	e.WaitDetourConfigs(t, ctx, "detour's drop-in and entry to leave the node")
}
