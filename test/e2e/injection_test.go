package e2e

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/internal/clustercheck"
	"github.com/detourmesh/detour/test/e2e/framework"
)

// seed000Startup: pods of an opted-in Deployment stay Pending on the tainted node under the
// real scheduler until the node agent has chained detour-cni and removed the taint; then they
// run with their rules and the validator passes.
func seed000Startup(t *testing.T, ctx context.Context, e *framework.Env) {
	e.InstallDetour(t, ctx, "")
	e.Namespace(t, ctx, "shop", true)
	dep := e.Deployment("web", "shop", 2)
	if _, err := e.Node.Client.AppsV1().Deployments("shop").Create(ctx, dep, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// The scheduler says why it does not place them: a taint, and the node has only detour's.
	node, err := e.Node.Client.CoreV1().Nodes().Get(ctx, framework.NodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(node.Spec.Taints) != 1 || node.Spec.Taints[0].Key != framework.StartupTaint {
		t.Fatalf("node %s has taints %v, want only %s", framework.NodeName, node.Spec.Taints, framework.StartupTaint)
	}
	framework.WaitFor(t, ctx, "the scheduler to hold web's pods back for the startup taint", time.Minute, func() (bool, error) {
		pods, err := e.Pods(ctx, "shop", "app=web")
		if err != nil {
			return false, err
		}
		if len(pods) != 2 {
			return false, framework.Seen("%d pods of web", len(pods))
		}
		for _, p := range pods {
			if p.Spec.NodeName != "" {
				return false, fmt.Errorf("pod %s was scheduled onto %s while the node was tainted", p.Name, p.Spec.NodeName)
			}
			if !unschedulableForTaint(&p) {
				return false, framework.Seen("pod %s: conditions %+v", p.Name, p.Status.Conditions)
			}
		}
		return true, nil
	})

	e.SetAgent(t, ctx, true)
	framework.WaitFor(t, ctx, "the node agent to remove the startup taint and set the ready label", time.Minute, func() (bool, error) {
		node, err := e.Node.Client.CoreV1().Nodes().Get(ctx, framework.NodeName, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		return !framework.HasStartupTaint(node) && node.Labels[annotations.CNIReadyLabel] == "true", framework.Seen("taints %v, labels %v", node.Spec.Taints, node.Labels)
	})
	pods := e.WaitReady(t, ctx, "shop", "app=web", 2)
	for _, p := range pods {
		if !annotations.IsInjected(p.Annotations) {
			t.Errorf("pod %s is not injected: %v", p.Name, p.Annotations)
		}
		if code := framework.CheckExit(&p); code != 0 {
			t.Errorf("pod %s: the validator exited %d, want 0", p.Name, code)
		}
	}
	e.AssertCaptured(t, ctx, pods[0], "web")
}

// unschedulableForTaint reports whether the scheduler marked p unschedulable for a taint
// it does not tolerate (the scheduler's message does not name the taint; the story checks
// that the node carries no other).
func unschedulableForTaint(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && strings.Contains(c.Message, "untolerated taint") {
			return true
		}
	}
	return false
}

// seed003Demo: testdata/workloads/demo.yaml — a root init container that downloads from a
// server outside the pod — completes in container mode; the app's connections pass through
// the proxy, outbound to the right original destination and inbound.
func seed003Demo(t *testing.T, ctx context.Context, e *framework.Env) {
	e.Namespace(t, ctx, "demo", false)
	dep := demoDeployment(t, e)
	if _, err := e.Node.Client.AppsV1().Deployments("demo").Create(ctx, dep, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pods := e.WaitReady(t, ctx, "demo", "app=demo", 1)
	p := pods[0]
	if got := p.Annotations[annotations.ExemptGIDs]; got == "" {
		t.Errorf("fetch runs as root: want it exempted through a dedicated GID, annotations %v", p.Annotations)
	}
	if log := e.Logs(ctx, "demo", p.Name, "fetch"); !strings.Contains(log, "dial "+e.Server+" ok") {
		t.Errorf("fetch did not reach %s directly:\n%s", e.Server, log)
	}
	e.AssertCaptured(t, ctx, p, "web")
}

// demoDeployment is testdata/workloads/demo.yaml with its busybox commands played by the
// workload image (the node has no registry): fetch dials the test server as root, web dials
// it through the proxy and then serves. Everything else — the opt-in, container mode, the
// users, the volume — is the file's.
func demoDeployment(t testing.TB, e *framework.Env) *appsv1.Deployment {
	t.Helper()
	data, err := os.ReadFile(e.Root + "/testdata/workloads/demo.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var dep appsv1.Deployment
	if err := yaml.UnmarshalStrict(data, &dep); err != nil {
		t.Fatal(err)
	}
	dep.Namespace = "demo"
	spec := &dep.Spec.Template.Spec
	for i := range spec.InitContainers {
		c := &spec.InitContainers[i]
		c.Image, c.ImagePullPolicy, c.Command = e.Artifacts.Refs.Workload, corev1.PullNever, nil
		c.Args = []string{"dial", "-must", "-addr", e.Server}
	}
	for i := range spec.Containers {
		c := &spec.Containers[i]
		c.Image, c.ImagePullPolicy, c.Command = e.Artifacts.Refs.Workload, corev1.PullNever, nil
		c.Args = []string{"dial", "-retry", "30s", "-addr", e.Server, "then", "serve", "-listen", ":8080"}
	}
	return &dep
}

// seed003ImageUsers: init containers whose image's USER is unset, numeric or a name from the
// image's /etc/passwd keep egress in container mode.
func seed003ImageUsers(t *testing.T, ctx context.Context, e *framework.Env) {
	e.Namespace(t, ctx, "users", true)
	pod := e.Pod("image-users", "users")
	pod.Annotations = map[string]string{"detour.dev/sidecar-mode": "container"}
	pod.Spec.InitContainers = nil
	for _, img := range []struct{ name, ref string }{
		{"unset", e.Artifacts.Refs.Workload}, {"numeric", e.Artifacts.Refs.WorkloadNumeric}, {"named", e.Artifacts.Refs.WorkloadNamed},
	} {
		pod.Spec.InitContainers = append(pod.Spec.InitContainers, corev1.Container{
			Name: "user-" + img.name, Image: img.ref, ImagePullPolicy: corev1.PullNever,
			Args: []string{"dial", "-must", "-addr", e.Server},
		})
	}
	if _, err := e.Node.Client.CoreV1().Pods("users").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p := e.WaitReady(t, ctx, "users", "name=image-users", 1)[0]
	for _, c := range p.Spec.InitContainers {
		if !strings.HasPrefix(c.Name, "user-") {
			continue
		}
		if log := e.Logs(ctx, "users", p.Name, c.Name); !strings.Contains(log, "dial "+e.Server+" ok") {
			t.Errorf("%s did not reach %s directly:\n%s", c.Name, e.Server, log)
		}
	}
}

// seed003NativeJob: in native-sidecar mode the proxy starts before the user's init
// containers (their traffic goes through it) and a Job completes.
func seed003NativeJob(t *testing.T, ctx context.Context, e *framework.Env) {
	e.Namespace(t, ctx, "batch", true)
	pod := e.Pod("report", "batch")
	pod.Annotations = map[string]string{"detour.dev/sidecar-mode": "native"}
	pod.Spec.RestartPolicy = corev1.RestartPolicyNever
	pod.Spec.Containers[0].Args = []string{"dial", "-must", "-addr", e.Server}
	job := &batchv1.Job{
		ObjectMeta: metav1.ObjectMeta{Name: "report", Namespace: "batch"},
		Spec: batchv1.JobSpec{
			BackoffLimit: ptr.To[int32](0),
			Template:     corev1.PodTemplateSpec{ObjectMeta: pod.ObjectMeta, Spec: pod.Spec},
		},
	}
	job.Spec.Template.Name, job.Spec.Template.Namespace = "", ""
	if _, err := e.Node.Client.BatchV1().Jobs("batch").Create(ctx, job, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	framework.WaitFor(t, ctx, "Job report to complete", 2*time.Minute, func() (bool, error) {
		j, err := e.Node.Client.BatchV1().Jobs("batch").Get(ctx, "report", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if j.Status.Failed > 0 {
			return false, fmt.Errorf("job failed:\n%s", e.Describe(ctx, "batch"))
		}
		return j.Status.Succeeded == 1, framework.Seen("job status %+v; pods:\n%s", j.Status, e.Describe(ctx, "batch"))
	})
	pods, err := e.Pods(ctx, "batch", "batch.kubernetes.io/job-name=report")
	if err != nil || len(pods) != 1 {
		t.Fatalf("the Job's pod: %v (%d pods)", err, len(pods))
	}
	p := pods[0]
	// The validator's check ran where validator.mode auto puts it on this release: at the
	// proxy's start, the proxy the first init container (1.35 and later), or in the validator
	// container before it; either way nothing of the check keeps the Job alive.
	atProxyStart := autoChecksAtProxyStart(e)
	proxy := p.Spec.InitContainers[0]
	if !atProxyStart {
		if proxy.Name != annotations.ValidatorContainer || len(p.Spec.InitContainers) < 2 {
			t.Errorf("first init container %s, want %s (the check in the validator container on this release)", proxy.Name, annotations.ValidatorContainer)
		} else {
			proxy = p.Spec.InitContainers[1]
		}
	}
	if framework.ChecksAtProxyStart(&p) != atProxyStart || proxy.Name != "detour-proxy" || proxy.RestartPolicy == nil || *proxy.RestartPolicy != corev1.ContainerRestartPolicyAlways {
		t.Errorf("init container %s (restartPolicy %v, detour.dev/validator %q), want the native detour-proxy with the check in %s", proxy.Name, proxy.RestartPolicy, p.Annotations[annotations.Validator], checkPlace(atProxyStart))
	}
	// Both the init container's and the app's dial went through the proxy.
	if log := e.Logs(ctx, "batch", p.Name, "detour-proxy"); e.Proxy.OutboundCount(log, e.Server) < 2 {
		t.Errorf("the proxy did not carry both the init container's and the app's connection to %s:\n%s", e.Server, log)
	}
}

// seed003UserNamespaces: a pod with hostUsers: false gets a user namespace of its own, and
// containerd creates its network namespace inside it. The kernel accepts iptables' owner matches
// only from a writer inside that user namespace, which detour-cni is not (this story first ran
// such a pod with the iptables tools: every ADD failed with "RULE_APPEND failed (Invalid
// argument)" and the pod never got a sandbox, so the webhook refused such pods). auto now writes
// the rules with nftables, whose skuid/skgid matches the kernel accepts from the host: the pod is
// admitted, its validator passes, and its traffic goes through the proxy.
func seed003UserNamespaces(t *testing.T, ctx context.Context, e *framework.Env) {
	e.Namespace(t, ctx, "userns", true)
	pod := e.Pod("userns", "userns")
	pod.Spec.HostUsers = ptr.To(false)
	if _, err := e.Node.Client.CoreV1().Pods("userns").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatalf("creating a pod with hostUsers: false: %v", err)
	}
	p := e.WaitReady(t, ctx, "userns", "name=userns", 1)[0]
	if p.Spec.HostUsers == nil || *p.Spec.HostUsers {
		t.Fatalf("the pod runs with hostUsers %v, want false", p.Spec.HostUsers)
	}
	if code := framework.CheckExit(&p); code != 0 {
		t.Errorf("the validator exited %d, want 0", code)
	}
	e.AssertCaptured(t, ctx, p, "userns")
}

// kubectlWarnings: a real `kubectl apply` prints detour's admission warnings.
func kubectlWarnings(t *testing.T, ctx context.Context, e *framework.Env) {
	e.Namespace(t, ctx, "warn", true)
	manifest := fmt.Sprintf(`apiVersion: v1
kind: Pod
metadata:
  name: root-init
  namespace: warn
  annotations:
    detour.dev/sidecar-mode: container
spec:
  automountServiceAccountToken: false
  initContainers:
    - name: migrate
      image: %[1]s
      imagePullPolicy: Never
      args: [dial, -must, -addr, %[2]s]
      securityContext: {runAsUser: 0}
  containers:
    - name: app
      image: %[1]s
      imagePullPolicy: Never
      args: [serve, -listen, ":8080"]
`, e.Artifacts.Refs.Workload, e.Server)
	path := e.Node.Dir + "/warn-pod.yaml"
	if err := os.WriteFile(path, []byte(manifest), 0o644); err != nil {
		t.Fatal(err)
	}
	stdout, stderr, err := e.Node.Kubectl(ctx, "apply", "-f", path)
	if err != nil {
		t.Fatalf("kubectl apply: %v\n%s%s", err, stdout, stderr)
	}
	if !strings.Contains(stderr, "Warning:") || !strings.Contains(stderr, "migrate") || !strings.Contains(stderr, "GID") {
		t.Errorf("kubectl apply printed no warning about migrate's GID; stderr:\n%s", stderr)
	}
	e.WaitReady(t, ctx, "warn", "", 1)
}

// meshWide: with the chart's webhook.config.defaultInject enabled, a pod of a namespace that
// says nothing is injected and runs captured, a namespace annotated detour.dev/inject: disabled
// keeps its pods out, and detour check --cluster counts the namespaces that say nothing as
// opted in. (The story before uninstall: it leaves the mesh-wide setting in place.)
func meshWide(t *testing.T, ctx context.Context, e *framework.Env) {
	e.Namespace(t, ctx, "everywhere", false)
	if _, err := e.Node.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{
		Name: "legacy", Annotations: map[string]string{annotations.Inject: string(annotations.InjectDisabled)},
	}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := e.Node.WaitServiceAccount(ctx, "legacy"); err != nil {
		t.Fatal(err)
	}
	defer e.DropNamespaces(t, ctx, "everywhere", "legacy")
	e.InstallDetour(t, ctx, "webhook:\n  config:\n    defaultInject: enabled\n")
	for _, ns := range []string{"everywhere", "legacy"} {
		if _, err := e.Node.Client.CoreV1().Pods(ns).Create(ctx, e.Pod("web", ns), metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	meshed := e.WaitReady(t, ctx, "everywhere", "name=web", 1)[0]
	if !annotations.IsInjected(meshed.Annotations) {
		t.Fatalf("the pod of a namespace without detour.dev/inject was not injected under defaultInject enabled: %v", meshed.Annotations)
	}
	e.AssertCaptured(t, ctx, meshed, "web")
	if out := e.WaitReady(t, ctx, "legacy", "name=web", 1)[0]; annotations.IsInjected(out.Annotations) {
		t.Errorf("the pod of a namespace annotated %s: disabled was injected", annotations.Inject)
	}
	report, _ := e.CheckCluster(t, ctx)
	framework.WantCheck(t, report, "opted-in-namespaces", clustercheck.OK, "defaultInject is enabled")
}
