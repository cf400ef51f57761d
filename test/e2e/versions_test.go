package e2e

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilversion "k8s.io/apimachinery/pkg/util/version"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/internal/clustercheck"
	"github.com/detourmesh/detour/test/e2e/framework"
)

// The stories of the versions users run (issue 34; TestE2EVersions, `make e2e-versions`): the
// ones that hold on any supported Kubernetes release, with the check wherever `auto` puts it
// there, and the kubelet replaced in place under detour.

// autoChecksAtProxyStart reports where validator.mode auto must put the check on e's cluster,
// from the releases it runs rather than from detour's own decision: at the proxy's start where
// the API server keeps image volumes (its ImageVolume gate, on by default from 1.35) and the
// node's kubelet mounts them (1.35, with containerd 2.4 here), else in the validator init
// container.
func autoChecksAtProxyStart(e *framework.Env) bool {
	onByDefault := func(v string) bool {
		parsed, err := utilversion.ParseGeneric(v)
		return err == nil && parsed.AtLeast(utilversion.MajorMinor(1, 35))
	}
	if !onByDefault(e.Node.KubernetesVersion()) {
		return false
	}
	for _, n := range e.Node.Nodes() {
		if !onByDefault(n.KubeletVersion()) {
			return false
		}
	}
	return true
}

// checkPlace names where the check runs, for messages.
func checkPlace(atProxyStart bool) string {
	if atProxyStart {
		return "the proxy's start (image volume)"
	}
	return "the detour-validator init container"
}

// versionsValidatorMode: the node agent labels the node detour.dev/image-volumes=true exactly
// where its kubelet mounts image volumes; an injected pod's check runs where `auto` must put it
// on this release (autoChecksAtProxyStart) — for real: the validator container on a kubelet
// and API server whose image volumes are off, not a fake old Node — and passes; the pod is
// captured both ways, and `detour check --cluster` says where the check runs. It leaves pod
// fold/web for validatorDebugContainer.
func versionsValidatorMode(t *testing.T, ctx context.Context, e *framework.Env) {
	want := autoChecksAtProxyStart(e)
	framework.WaitFor(t, ctx, "the agent's image-volumes label to match the kubelet", time.Minute, func() (bool, error) {
		node, err := e.Node.Client.CoreV1().Nodes().Get(ctx, e.Node.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		_, labelled := node.Labels[annotations.ImageVolumesLabel]
		return labelled == want && node.Labels[annotations.CNIReadyLabel] == "true",
			framework.Seen("kubelet %s, labels %v", node.Status.NodeInfo.KubeletVersion, node.Labels)
	})
	e.Namespace(t, ctx, "fold", true)
	if _, err := e.Node.Client.CoreV1().Pods("fold").Create(ctx, e.Pod("web", "fold"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p := e.WaitReady(t, ctx, "fold", "name=web", 1)[0]
	if got := framework.ChecksAtProxyStart(&p); got != want {
		t.Errorf("the check runs in %s, want %s (API server %s, kubelet %s)", checkPlace(got), checkPlace(want),
			e.Node.KubernetesVersion(), e.Node.KubeletVersion())
	}
	names := containerNames(p.Spec.InitContainers)
	if hasValidator := slices.Contains(names, annotations.ValidatorContainer); hasValidator == want {
		t.Errorf("init containers %v: a detour-validator container where the check runs in %s", names, checkPlace(want))
	}
	if code := framework.CheckExit(&p); code != 0 {
		t.Errorf("the check exited %d, want 0", code)
	}
	e.AssertCaptured(t, ctx, p, "web")
	report, _ := e.CheckCluster(t, ctx)
	place := "runs as the detour-validator init container"
	if want {
		place = "runs at the start of the detour-proxy container (image volume)"
	}
	framework.WantCheck(t, report, "validator-mode", clustercheck.OK, place)
}

// dropInOnThisRelease: the drop-in (dropInSurvivesARewrite), then pods created in waves while
// the primary rewrites its conflist 50 times: none starts without its rules.
func dropInOnThisRelease(t *testing.T, ctx context.Context, e *framework.Env) {
	dropInSurvivesARewrite(t, ctx, e)
	res := churn(t, ctx, e, "churn-dropin")
	if res.failed != 0 || res.pods == 0 {
		t.Errorf("with the drop-in, %d of %d pods started without rules during %d rewrites of the conflist", res.failed, res.pods, res.rewrites)
	}
	e.DropNamespaces(t, ctx, "dropin", "churn-dropin")
}

// nodeRegisteredAgain: the node's Node object is deleted and the kubelet, restarted, registers
// it again (with the startup taint, as at its first registration). With the agent's resync
// set to 10 minutes, only its watch of the Node can bring the marks back: the ready label, the
// image-volumes label where the kubelet mounts image volumes, the taint gone — and they are
// back within a minute, and a new injected pod runs captured. The resync goes back to the e2e's.
func nodeRegisteredAgain(t *testing.T, ctx context.Context, e *framework.Env) {
	e.InstallDetour(t, ctx, "nodeAgent: {resync: 10m}\n")
	e.SetAgent(t, ctx, true)
	defer func() {
		e.InstallDetour(t, ctx, "")
		e.SetAgent(t, ctx, true)
	}()
	wantImageVolumes := autoChecksAtProxyStart(e)
	nodes := e.Node.Client.CoreV1().Nodes()
	old, err := nodes.Get(ctx, e.Node.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// kube-proxy exits when its Node is deleted ("Node is being deleted", 1.37): it is stopped
	// with the kubelet and started again after it, as a node's restart would.
	for _, c := range []string{"kube-proxy", "kubelet"} {
		if err := e.Node.StopComponent(c); err != nil {
			t.Fatal(err)
		}
	}
	if err := nodes.Delete(ctx, e.Node.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []string{"kubelet", "kube-proxy"} {
		if err := e.Node.StartComponent(ctx, c); err != nil {
			t.Fatal(err)
		}
	}
	var again *corev1.Node
	framework.WaitFor(t, ctx, "the agent to mark the node registered again", time.Minute, func() (bool, error) {
		var err error
		if again, err = nodes.Get(ctx, e.Node.Name, metav1.GetOptions{}); err != nil {
			return false, err
		}
		_, imageVolumes := again.Labels[annotations.ImageVolumesLabel]
		return again.UID != old.UID && again.Labels[annotations.CNIReadyLabel] == "true" && imageVolumes == wantImageVolumes &&
				!framework.HasStartupTaint(again),
			framework.Seen("UID %s (was %s), labels %v, taints %v", again.UID, old.UID, again.Labels, again.Spec.Taints)
	})
	t.Logf("the node registered again at %s; marked %s later, with the agent's resync at 10m",
		again.CreationTimestamp.UTC().Format(time.TimeOnly), time.Since(again.CreationTimestamp.Time).Round(time.Second))
	e.Namespace(t, ctx, "again", true)
	defer e.DropNamespaces(t, ctx, "again")
	if _, err := e.Node.Client.CoreV1().Pods("again").Create(ctx, e.Pod("after", "again"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p := e.WaitReady(t, ctx, "again", "name=after", 1)[0]
	if code := framework.CheckExit(&p); code != 0 {
		t.Errorf("the pod's check exited %d, want 0", code)
	}
	e.AssertCaptured(t, ctx, p, "after")
}

// kubeletInPlace: the kubelet replaced in place under detour (stop, swap the binary, start; no
// reboot), with meshed pods serving and an injected pod created every second throughout
// (runUpgrade): from v1.34.4 (image volumes off: no image-volumes label, the check in the
// validator container) to v1.37.2 — the agent labels the node on the Node's update and `auto`
// moves the check to the proxy's start — then, as docs/operations.md tells admins to downgrade,
// with validator.mode pinned to init-container (the webhook without RBAC on nodes), back to
// v1.34.4 — the label goes — and auto again, which keeps the init container. No pod may be left
// Pending or crash-looping, none Ready without its redirect.
func kubeletInPlace(t *testing.T, ctx context.Context, e *framework.Env, from, to string) {
	u := runUpgrade(t, ctx, e, upgradePlan{first: installWorkingTree("the working tree installed, kubelet " + from), dwell: 20 * time.Second,
		steps: []upgradeStep{
			replaceKubelet(to, true),
			pinInitContainer(),
			replaceKubelet(from, false),
			installWorkingTree("validator.mode auto again (helm upgrade)"),
		}})
	if n := u.figure(figFolded, 1); n == 0 {
		t.Errorf("no pod created after the kubelet became %s had its check at the proxy's start", to)
	}
	// From the kubelet's downgrade on (the pin's own phase includes its rollout, while the old
	// replicas still serve), no pod may get the check at the proxy's start.
	for i := 3; i <= 4; i++ {
		if n := u.figure(figFolded, i); n != 0 {
			t.Errorf("phase %d: %d pods had their check at the proxy's start, want none (pinned, or no node mounts image volumes)", i+1, n)
		}
	}
}

// installWorkingTree installs (or upgrades to) the working tree with the e2e values, puts the
// agent on the node and waits until the webhook puts the check where the node's releases call
// for.
func installWorkingTree(name string) upgradeStep {
	return upgradeStep{name: name, run: func(t *testing.T, ctx context.Context, u *upgradeRun) {
		u.e.InstallDetour(t, ctx, "")
		u.e.SetAgent(t, ctx, true)
		u.waitRollouts(t, ctx)
		waitImageVolumesLabel(t, ctx, u.e, autoChecksAtProxyStart(u.e))
		waitAdmittedCheck(t, ctx, u.e, autoChecksAtProxyStart(u.e))
	}}
}

// replaceKubelet replaces the node's kubelet with release version in place, and waits until the
// agent has set (or removed) the image-volumes label from the Node's update and, when
// waitMode is set, until the webhook puts the check where the new release calls for.
func replaceKubelet(version string, waitMode bool) upgradeStep {
	return upgradeStep{name: "kubelet replaced in place with " + version, run: func(t *testing.T, ctx context.Context, u *upgradeRun) {
		was := u.e.Node.KubeletVersion()
		start := time.Now()
		if err := u.e.Node.ReplaceKubelet(ctx, version); err != nil {
			t.Fatal(err)
		}
		back := time.Since(start)
		want := autoChecksAtProxyStart(u.e)
		waitImageVolumesLabel(t, ctx, u.e, want)
		labelled := time.Since(start)
		if waitMode {
			waitAdmittedCheck(t, ctx, u.e, want)
		}
		t.Logf("kubelet %s → %s: Ready and reported after %s, the image-volumes label %v after %s, the webhook's check in %s after %s",
			was, version, back.Round(100*time.Millisecond), want, labelled.Round(100*time.Millisecond), checkPlace(want), time.Since(start).Round(100*time.Millisecond))
	}}
}

// pinInitContainer is `helm upgrade` with validator.mode init-container: the chart gives the
// webhook no RBAC on nodes (nor on the API server's /metrics); it becomes Ready all the same and
// injects the validator container.
func pinInitContainer() upgradeStep {
	return upgradeStep{name: "validator.mode pinned to init-container (helm upgrade)", run: func(t *testing.T, ctx context.Context, u *upgradeRun) {
		u.e.InstallDetour(t, ctx, "webhook: {config: {validator: {mode: init-container}}}\n")
		u.waitRollouts(t, ctx)
		role, err := u.e.Node.Client.RbacV1().ClusterRoles().Get(ctx, "detour-webhook", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range role.Rules {
			if slices.Contains(r.Resources, "nodes") || len(r.NonResourceURLs) > 0 {
				t.Errorf("the webhook's ClusterRole with validator.mode init-container has rule %+v", r)
			}
		}
		waitAdmittedCheck(t, ctx, u.e, false)
	}}
}

// waitImageVolumesLabel waits until the node carries detour.dev/image-volumes=true, or not.
func waitImageVolumesLabel(t *testing.T, ctx context.Context, e *framework.Env, want bool) {
	framework.WaitFor(t, ctx, fmt.Sprintf("the agent to set the node's image-volumes label to %v", want), 2*time.Minute, func() (bool, error) {
		node, err := e.Node.Client.CoreV1().Nodes().Get(ctx, e.Node.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		_, labelled := node.Labels[annotations.ImageVolumesLabel]
		return labelled == want, framework.Seen("kubelet %s, labels %v", node.Status.NodeInfo.KubeletVersion, node.Labels)
	})
}

// waitAdmittedCheck waits until a pod created in the upgrade story's namespace (dry run: nothing
// is stored or runs) comes back with its check where want says.
func waitAdmittedCheck(t *testing.T, ctx context.Context, e *framework.Env, atProxyStart bool) {
	e.Namespace(t, ctx, upgradeNS, true)
	framework.WaitFor(t, ctx, "the webhook to put the check in "+checkPlace(atProxyStart), 2*time.Minute, func() (bool, error) {
		got, err := e.Node.Client.CoreV1().Pods(upgradeNS).Create(ctx, e.Pod("probe", upgradeNS), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		if err != nil {
			return false, err
		}
		names := containerNames(got.Spec.InitContainers)
		folded := framework.ChecksAtProxyStart(got)
		return folded == atProxyStart && slices.Contains(names, annotations.ValidatorContainer) != atProxyStart,
			framework.Seen("detour.dev/validator %q, init containers %v", got.Annotations[annotations.Validator], names)
	})
}
