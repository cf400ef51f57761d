package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/inject"
	"github.com/detourmesh/detour/internal/clustercheck"
	"github.com/detourmesh/detour/test/e2e/framework"
	"github.com/detourmesh/detour/validator"
)

// The stories of issue 21: the validator's check runs at the proxy's start on this node
// (kubelet 1.37, containerd 2.4: image volumes; the e2e configuration names the proxy's command
// and startup probe), with no validator container, and the init container comes back where a
// node cannot mount image volumes.

// validatorInTheProxysStart: an injected pod has no validator container; its proxy, first of
// its init containers, mounts detour's image, runs the check as the proxy's UID and execs the
// test proxy, whose log shows both; its traffic is captured both ways. The webhook and detour
// check --cluster say where the check runs and why.
func validatorInTheProxysStart(t *testing.T, ctx context.Context, e *framework.Env) {
	node, err := e.Node.Client.CoreV1().Nodes().Get(ctx, framework.NodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if node.Labels[annotations.ImageVolumesLabel] != "true" {
		t.Fatalf("node %s labels %v: the agent did not label it %s=true (kubelet %s, runtime %s)", framework.NodeName, node.Labels,
			annotations.ImageVolumesLabel, node.Status.NodeInfo.KubeletVersion, node.Status.NodeInfo.ContainerRuntimeVersion)
	}
	e.Namespace(t, ctx, "fold", true)
	if _, err := e.Node.Client.CoreV1().Pods("fold").Create(ctx, e.Pod("web", "fold"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p := e.WaitReady(t, ctx, "fold", "name=web", 1)[0]
	if !framework.ChecksAtProxyStart(&p) {
		t.Fatalf("detour.dev/validator is %q, want image-volume", p.Annotations[annotations.Validator])
	}
	names := containerNames(p.Spec.InitContainers)
	if slices.Contains(names, annotations.ValidatorContainer) || names[0] != annotations.ProxyContainer {
		t.Errorf("init containers %v, want the proxy first and no validator", names)
	}
	proxy := p.Spec.InitContainers[0]
	if proxy.Command[0] != inject.ValidatorBinary || !slices.Equal(proxy.Args, e.Proxy.Command) {
		t.Errorf("proxy command %q args %q", proxy.Command, proxy.Args)
	}
	if i := slices.IndexFunc(p.Spec.Volumes, func(v corev1.Volume) bool { return v.Name == annotations.ValidatorVolume }); i < 0 ||
		p.Spec.Volumes[i].Image == nil || p.Spec.Volumes[i].Image.Reference != e.Artifacts.Repo+":"+e.Artifacts.Tag {
		t.Errorf("volumes %+v, want detour's image %s:%s as an image volume", p.Spec.Volumes, e.Artifacts.Repo, e.Artifacts.Tag)
	}
	if code := framework.CheckExit(&p); code != 0 {
		t.Errorf("the check exited %d, want 0", code)
	}
	log := e.Logs(ctx, "fold", "web", annotations.ProxyContainer)
	// The primary family's check comes first (an IPv6-only pod's IPv4 is "not checked").
	checked := "ipv4 connection to " + validator.DefaultSentinel
	if !e.Node.Families().Has4() {
		checked = "ipv6 connection to " + validator.DefaultSentinel6
	}
	wants := []string{
		"redirect in place: " + checked + " came back to port 4142",
		validator.StartedMarker + e.Proxy.Command[0],
	}
	if e.Proxy == framework.TestProxy {
		wants = append(wants, "proxy outbound listening")
	}
	for _, want := range wants {
		if !strings.Contains(log, want) {
			t.Errorf("the proxy's log lacks %q:\n%s", want, log)
		}
	}
	e.AssertCaptured(t, ctx, p, "web")

	if log := webhookLog(t, ctx, e); !lineWith(log, `"validator mode"`, `"image-volume"`, "every node (1) mounts image volumes") {
		t.Errorf("the webhook's log does not say it runs the check in the proxy's start, and why:\n%s", framework.Tail(log, 20))
	}
	report, _ := e.CheckCluster(t, ctx)
	framework.WantCheck(t, report, "validator-mode", clustercheck.OK, "runs at the start of the detour-proxy container (image volume): every node (1) mounts image volumes")
}

// validatorDebugContainer: `kubectl debug` adds an ephemeral container to a pod whose check ran
// in its proxy's start: its connection is captured like the app's (the proxy carries it).
func validatorDebugContainer(t *testing.T, ctx context.Context, e *framework.Env) {
	before := strings.Count(e.Logs(ctx, "fold", "web", annotations.ProxyContainer), "-> "+e.Server)
	out, errOut, err := e.Node.Kubectl(ctx, "-n", "fold", "debug", "web", "--image", e.Artifacts.Refs.Workload,
		"--image-pull-policy", "Never", "--container", "debugger", "--", "/usr/local/bin/workload", "dial", "-must", "-addr", e.Server)
	if err != nil {
		t.Fatalf("kubectl debug: %v\n%s%s", err, out, errOut)
	}
	framework.WaitFor(t, ctx, "the debug container to finish", time.Minute, func() (bool, error) {
		p, err := e.Node.Client.CoreV1().Pods("fold").Get(ctx, "web", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		for _, s := range p.Status.EphemeralContainerStatuses {
			if s.Name == "debugger" && s.State.Terminated != nil {
				if s.State.Terminated.ExitCode != 0 {
					return false, fmt.Errorf("the debug container's dial failed: exit %d", s.State.Terminated.ExitCode)
				}
				return true, nil
			}
		}
		return false, framework.Seen("ephemeral containers %+v", p.Status.EphemeralContainerStatuses)
	})
	if after := strings.Count(e.Logs(ctx, "fold", "web", annotations.ProxyContainer), "-> "+e.Server); after != before+1 {
		t.Errorf("the proxy carried %d connections to %s after the debug container's dial, %d before: want one more", after, e.Server, before)
	}
}

// validatorWhereImageVolumesAreNotPossible: a node whose kubelet cannot mount image volumes
// joins (a Node object reporting kubelet 1.34): the webhook goes back to the validator init
// container for new pods, says why in its log, and detour check --cluster names the node; once
// the node is gone, new pods run the check in the proxy's start again.
func validatorWhereImageVolumesAreNotPossible(t *testing.T, ctx context.Context, e *framework.Env) {
	nodes := e.Node.Client.CoreV1().Nodes()
	old := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "e2e-old-node", Labels: map[string]string{"kubernetes.io/os": "linux"}},
		Spec: corev1.NodeSpec{Taints: []corev1.Taint{{Key: "e2e.detour.dev/no-kubelet", Effect: corev1.TaintEffectNoSchedule}}}}
	if _, err := nodes.Create(ctx, old, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := nodes.Delete(context.Background(), old.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete node %s: %v", old.Name, err)
		}
	}()
	// The controller manager updates a new node too (its taints, its CIDR): retry on conflict.
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		n, err := nodes.Get(ctx, old.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		n.Status.NodeInfo = corev1.NodeSystemInfo{KubeletVersion: "v1.34.3", ContainerRuntimeVersion: "containerd://2.4.2"}
		_, err = nodes.UpdateStatus(ctx, n, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	waitDryRunValidator(t, ctx, e, annotations.ValidatorInitContainer)
	// Logged when the mode changed: the node, which no agent labels, counted at once.
	if log := webhookLog(t, ctx, e); !lineWith(log, `"validator mode"`, `"init-container"`, "1 of 2 nodes do not carry detour.dev/image-volumes=true: e2e-old-node: ") {
		t.Errorf("the webhook's log does not say why it went back to the init container:\n%s", framework.Tail(log, 20))
	}
	report, _ := e.CheckCluster(t, ctx)
	framework.WantCheck(t, report, "validator-mode", clustercheck.OK, "runs as the detour-validator init container: 1 of 2 nodes do not carry detour.dev/image-volumes=true: e2e-old-node: the kubelet v1.34.3")

	if err := nodes.Delete(ctx, old.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	waitDryRunValidator(t, ctx, e, annotations.ValidatorImageVolume)
}

// validatorHookGateFailsClosed (issue 36, seed 000): with detour's postStart hook in the proxy's
// start gate (detour.dev/proxy-start-gate: hook, beside the proxy's startup probe: the hook alone
// let 2 of 20 pods through on a loaded node), a pod whose redirect is missing — the node lost
// detour's CNI configuration — never runs its init container nor its app: the check exits 42,
// the hook fails with the check's message, and the kubelet starts the proxy again, and again,
// without starting anything after it. Once the node is whole, a new pod passes the gate and is
// captured.
func validatorHookGateFailsClosed(t *testing.T, ctx context.Context, e *framework.Env) {
	e.Namespace(t, ctx, "hookgate", true)
	defer e.DropNamespaces(t, ctx, "hookgate")
	patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:"hook"}}}`, annotations.ProxyStartGate)
	if _, err := e.Node.Client.CoreV1().Namespaces().Patch(ctx, "hookgate", types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	// The node loses detour's configuration (as in seed000/repair-after-the-node-broke): new
	// sandboxes get no rules.
	e.SetAgent(t, ctx, false)
	restored := false
	defer func() {
		if !restored {
			e.SetAgent(t, ctx, true)
		}
	}()
	if err := os.RemoveAll(filepath.Dir(e.DropInPath())); err != nil {
		t.Fatal(err)
	}
	if err := e.Node.WritePrimaryConfig(); err != nil {
		t.Fatal(err)
	}
	// Several pods at once, each through three failing checks: a kubelet that let one next
	// container start behind a failed hook would show it in one of them
	// (DETOUR_E2E_HOOKGATE_PODS raises the count, to measure such a race).
	n := 4
	if v, err := strconv.Atoi(os.Getenv("DETOUR_E2E_HOOKGATE_PODS")); err == nil && v > 0 {
		n = v
	}
	pods := e.Node.Client.CoreV1().Pods("hookgate")
	for i := range n {
		pod := e.Pod(fmt.Sprintf("gated-%d", i), "hookgate")
		pod.Labels["gate"] = "failing"
		if _, err := pods.Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	var gated []corev1.Pod
	framework.WaitFor(t, ctx, "the check to fail three times (42) behind the hook in every pod", time.Duration(n)*time.Minute, func() (bool, error) {
		list, err := pods.List(ctx, metav1.ListOptions{LabelSelector: "gate=failing"})
		if err != nil {
			return false, err
		}
		gated = list.Items
		waiting := 0
		for i := range gated {
			if restarts := proxyRestarts(&gated[i]); framework.CheckExit(&gated[i]) != 42 || restarts < 2 {
				waiting++
			}
		}
		return len(gated) == n && waiting == 0, framework.Seen("%d of %d pods with fewer than three failed checks", waiting, len(gated))
	})
	events, err := e.Node.Client.CoreV1().Events("hookgate").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	kubelet, err := os.ReadFile(filepath.Join(e.Node.Dir, "logs", "kubelet.log"))
	if err != nil {
		t.Fatal(err)
	}
	for i := range gated {
		p := &gated[i]
		proxy := p.Spec.InitContainers[0]
		if proxy.Name != annotations.ProxyContainer || proxy.StartupProbe == nil || proxy.Lifecycle == nil || proxy.Lifecycle.PostStart == nil ||
			proxy.Lifecycle.PostStart.Exec == nil || !slices.Equal(proxy.Lifecycle.PostStart.Exec.Command[:2], []string{inject.ValidatorBinary, "wait-proxy"}) {
			t.Fatalf("%s: first init container %s: startup probe %+v, lifecycle %+v; want the proxy gated by detour wait-proxy and its startup probe", p.Name, proxy.Name, proxy.StartupProbe, proxy.Lifecycle)
		}
		// Fail closed: nothing after the proxy ever ran, through three runs of the failing check.
		ranBehind := false
		for _, s := range slices.Concat(p.Status.InitContainerStatuses, p.Status.ContainerStatuses) {
			if s.Name != annotations.ProxyContainer && (s.State.Running != nil || s.State.Terminated != nil || s.LastTerminationState.Terminated != nil) {
				t.Errorf("%s: container %s ran although the proxy's check found no redirect: %s", p.Name, s.Name, framework.ContainerStates(p))
				ranBehind = true
			}
		}
		if ranBehind {
			// What the race needs to be told apart: the check's own last words (did the kubelet
			// stop it?) and the kubelet's record of this pod's containers.
			prev, err := pods.GetLogs(p.Name, &corev1.PodLogOptions{Container: annotations.ProxyContainer, Previous: true}).DoRaw(ctx)
			t.Logf("%s: the proxy's previous run logged (err %v):\n%s", p.Name, err, prev)
			var lines []string
			for line := range strings.Lines(string(kubelet)) {
				if strings.Contains(line, `"hookgate/`+p.Name+`"`) { // pod="…" and pods=["…"], not gated-10 for gated-1
					lines = append(lines, line)
				}
			}
			t.Logf("%s: the kubelet's log about it (%d lines):\n%s", p.Name, len(lines), framework.Tail(strings.Join(lines, ""), 80))
		}
		// What the user sees: the hook's failure event, and the check's reason in the kubelet's
		// record of the hook's error.
		if !slices.ContainsFunc(events.Items, func(ev corev1.Event) bool {
			return ev.InvolvedObject.Name == p.Name && ev.Reason == "FailedPostStartHook"
		}) {
			t.Errorf("%s: no FailedPostStartHook event", p.Name)
		}
		if !lineWith(string(kubelet), "Exec lifecycle hook", "hookgate/"+p.Name, "the redirect check at the proxy's start failed (exit 42)", "no redirect") {
			t.Errorf("%s: the kubelet's log does not show the hook failing with the check's message", p.Name)
		}
		t.Logf("%s: %s", p.Name, framework.ContainerStates(p))
	}

	// The node whole again: a new pod passes the gate and its traffic is captured.
	e.SetAgent(t, ctx, true)
	restored = true
	e.WaitDetourConfigs(t, ctx, "the agent to put detour's configuration back", e.DropInPath())
	if err := pods.DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{LabelSelector: "gate=failing"}); err != nil {
		t.Fatal(err)
	}
	if _, err := pods.Create(ctx, e.Pod("passed", "hookgate"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	ready := e.WaitReady(t, ctx, "hookgate", "name=passed", 1)[0]
	if code := framework.CheckExit(&ready); code != 0 || ready.Spec.InitContainers[0].Lifecycle == nil {
		t.Errorf("the new pod: check exit %d, proxy lifecycle %+v; want 0 behind the hook", code, ready.Spec.InitContainers[0].Lifecycle)
	}
	e.AssertCaptured(t, ctx, ready, "passed")
}

// slowProxyValues configure detour with a proxy that listens 20 s after its start — longer than
// its liveness probe's budget, 5 s × 3 — with the probes a production proxy has: a startup probe
// the hook gate asks too (budget 120 s), a liveness and a readiness probe.
const slowProxyValues = `webhook:
  config:
    proxy:
      args: ["-listen-delay=20s"]
      startupProbe: {tcpSocket: {port: 4191}, periodSeconds: 1, failureThreshold: 120}
      livenessProbe: {tcpSocket: {port: 4191}, periodSeconds: 5, failureThreshold: 3}
      readinessProbe: {httpGet: {path: /ready, port: 4191}, periodSeconds: 1}
`

// validatorSlowProxy (issue 42.1): behind the hook start gate, beside the proxy's startup probe,
// its liveness and readiness probes stay as configured. A proxy that listens 20 s after its
// start is never restarted by its liveness probe — the kubelet runs no liveness probe before the
// startup probe has passed, nor any probe of a container whose postStart hook still runs — and the pod
// is Ready only once the proxy answers. A proxy that crashes takes its pod out of Ready until its
// check at the new start has passed and the proxy answers again, 20 s later; it is restarted
// once, by the crash.
func validatorSlowProxy(t *testing.T, ctx context.Context, e *framework.Env) {
	e.InstallDetour(t, ctx, slowProxyValues)
	defer e.InstallDetour(t, ctx, "")
	e.Namespace(t, ctx, "slowproxy", true)
	defer e.DropNamespaces(t, ctx, "slowproxy")
	pods := e.Node.Client.CoreV1().Pods("slowproxy")
	if _, err := pods.Create(ctx, e.Pod("slow", "slowproxy"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p := e.WaitReady(t, ctx, "slowproxy", "name=slow", 1)[0]
	proxy := p.Spec.InitContainers[0]
	if proxy.Name != annotations.ProxyContainer || proxy.StartupProbe == nil || proxy.StartupProbe.FailureThreshold != 120 || proxy.Lifecycle == nil || proxy.Lifecycle.PostStart == nil ||
		proxy.LivenessProbe == nil || proxy.LivenessProbe.PeriodSeconds != 5 || proxy.ReadinessProbe == nil {
		t.Fatalf("proxy %s: startup probe %+v, liveness %+v, readiness %+v, lifecycle %+v; want the hook gate with the startup, liveness and readiness probes",
			proxy.Name, proxy.StartupProbe, proxy.LivenessProbe, proxy.ReadinessProbe, proxy.Lifecycle)
	}
	started := proxyStarted(t, &p)
	ready := podReadySince(&p)
	t.Logf("first start: the proxy started at %s, the pod Ready at %s (+%s); %s", started.Format(time.RFC3339), ready.Format(time.RFC3339), ready.Sub(started), framework.ContainerStates(&p))
	if n := proxyRestarts(&p); n != 0 || ready.Sub(started) < 19*time.Second {
		t.Errorf("the proxy restarted %d times, the pod was Ready %s after the proxy's start; want no restart and Ready once the proxy listens (20 s)", n, ready.Sub(started))
	}
	e.AssertCaptured(t, ctx, p, "slow")

	// The proxy crashes: the pod leaves Ready, and comes back only after its check passed
	// again and the proxy answers, 20 s after its restart.
	w, err := pods.Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=slow", ResourceVersion: p.ResourceVersion})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	killedAt := time.Now()
	if n, err := e.KillInPod(&p, "testproxy"); err != nil || n != 1 {
		t.Fatalf("kill the proxy: %d killed, %v", n, err)
	}
	var notReadyAt, readyAgainAt time.Time
	var last *corev1.Pod
	deadline := time.After(2 * time.Minute)
	for readyAgainAt.IsZero() {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				t.Fatal("the pod watch ended")
			}
			q, ok := ev.Object.(*corev1.Pod)
			if !ok {
				continue
			}
			last = q
			switch isReady := framework.PodReady(q); {
			case !isReady && notReadyAt.IsZero():
				notReadyAt = time.Now()
			case isReady && !notReadyAt.IsZero():
				readyAgainAt = time.Now()
			}
		case <-deadline:
			t.Fatalf("the pod was not Ready again within 2 minutes of its proxy's crash (NotReady seen: %v): %s", !notReadyAt.IsZero(), framework.ContainerStates(last))
		}
	}
	passed := checkPassedAt(t, ctx, e, "slowproxy", "slow")
	t.Logf("crash at %s: NotReady +%s, the check passed +%s, Ready again +%s", killedAt.Format(time.RFC3339), notReadyAt.Sub(killedAt), passed.Sub(killedAt), readyAgainAt.Sub(killedAt))
	if readyAgainAt.Before(passed) || readyAgainAt.Sub(killedAt) < 19*time.Second {
		t.Errorf("the pod was Ready again %s after the crash, its check passed %s after it; want Ready only after the check passed and the proxy listened (20 s)",
			readyAgainAt.Sub(killedAt), passed.Sub(killedAt))
	}
	// Another liveness period or two later: the crash is the only restart.
	time.Sleep(12 * time.Second)
	now, err := pods.Get(ctx, "slow", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if n := proxyRestarts(now); n != 1 || !framework.PodReady(now) {
		t.Errorf("after the crash: the proxy restarted %d times (want 1, the crash), pod Ready %v: %s", n, framework.PodReady(now), framework.ContainerStates(now))
	}
	events, err := e.Node.Client.CoreV1().Events("slowproxy").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, ev := range events.Items {
		if ev.Reason == "Unhealthy" && strings.Contains(ev.Message, "Liveness") || ev.Reason == "Killing" {
			t.Errorf("event %s: %s", ev.Reason, ev.Message)
		}
	}
}

// proxyStarted is when p's proxy container's current instance started.
func proxyStarted(t testing.TB, p *corev1.Pod) time.Time {
	t.Helper()
	for _, s := range slices.Concat(p.Status.InitContainerStatuses, p.Status.ContainerStatuses) {
		if s.Name == annotations.ProxyContainer && s.State.Running != nil {
			return s.State.Running.StartedAt.Time
		}
	}
	t.Fatalf("the proxy of %s is not running: %s", p.Name, framework.ContainerStates(p))
	return time.Time{}
}

// podReadySince is when p's Ready condition last became true.
func podReadySince(p *corev1.Pod) time.Time {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
			return c.LastTransitionTime.Time
		}
	}
	return time.Time{}
}

// checkPassedAt is when the check at the start of the pod's current proxy instance logged that
// the redirect is in place (the last such line of its log, with the runtime's timestamps).
func checkPassedAt(t testing.TB, ctx context.Context, e *framework.Env, ns, pod string) time.Time {
	t.Helper()
	data, err := e.Node.Client.CoreV1().Pods(ns).GetLogs(pod, &corev1.PodLogOptions{Container: annotations.ProxyContainer, Timestamps: true}).DoRaw(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var at time.Time
	for line := range strings.Lines(string(data)) {
		stamp, rest, _ := strings.Cut(line, " ")
		if strings.Contains(rest, "redirect in place") {
			if at, err = time.Parse(time.RFC3339Nano, stamp); err != nil {
				t.Fatalf("the proxy's log line %q: %v", line, err)
			}
		}
	}
	if at.IsZero() {
		t.Fatalf("the current proxy's log has no check that passed:\n%s", data)
	}
	return at
}

// proxyRestarts is the restart count of p's proxy container.
func proxyRestarts(p *corev1.Pod) int32 {
	for _, s := range slices.Concat(p.Status.InitContainerStatuses, p.Status.ContainerStatuses) {
		if s.Name == annotations.ProxyContainer {
			return s.RestartCount
		}
	}
	return 0
}

// waitDryRunValidator waits until a pod created in namespace fold (dry run: nothing is stored or
// runs) comes back from the webhook with its check where want says.
func waitDryRunValidator(t testing.TB, ctx context.Context, e *framework.Env, want annotations.ValidatorModeValue) {
	t.Helper()
	framework.WaitFor(t, ctx, "the webhook to put the check in "+string(want), time.Minute, func() (bool, error) {
		pod := e.Pod("probe", "fold")
		got, err := e.Node.Client.CoreV1().Pods("fold").Create(ctx, pod, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		if err != nil {
			return false, err
		}
		mode := annotations.ValidatorModeValue(got.Annotations[annotations.Validator])
		hasValidator := slices.Contains(containerNames(got.Spec.InitContainers), annotations.ValidatorContainer)
		return mode == want && hasValidator == (want == annotations.ValidatorInitContainer), framework.Seen("detour.dev/validator %q, init containers %v", mode, containerNames(got.Spec.InitContainers))
	})
}

// webhookLog is the log of the webhook's pods.
func webhookLog(t testing.TB, ctx context.Context, e *framework.Env) string {
	t.Helper()
	pods, err := e.Node.Client.CoreV1().Pods(framework.DetourNamespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=webhook"})
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for _, p := range pods.Items {
		b.WriteString(e.Logs(ctx, framework.DetourNamespace, p.Name, "webhook"))
	}
	return b.String()
}

func containerNames(cs []corev1.Container) []string {
	names := make([]string, len(cs))
	for i, c := range cs {
		names[i] = c.Name
	}
	return names
}

// lineWith reports whether a line of log holds every one of parts.
func lineWith(log string, parts ...string) bool {
	for line := range strings.Lines(log) {
		if !slices.ContainsFunc(parts, func(p string) bool { return !strings.Contains(line, p) }) {
			return true
		}
	}
	return false
}
