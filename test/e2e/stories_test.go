package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/internal/clustercheck"
	"github.com/detourmesh/detour/repair"
	"github.com/detourmesh/detour/test/e2e/framework"
	"github.com/detourmesh/detour/validator"
)

// TestE2E runs the user stories on the real node, in the order a cluster lives them. Each
// story is a subtest; a later one relies on what the earlier ones installed.
func TestE2E(t *testing.T) {
	e := framework.SetUp(t)
	ctx, cancel := framework.Context(t, e.Node, 35*time.Minute)
	defer cancel()
	stories := []struct {
		name string
		run  func(*testing.T, context.Context, *framework.Env)
	}{
		{"seed000/pods-wait-for-the-agent", seed000Startup},
		{"seed003/demo-container-mode", seed003Demo},
		{"seed003/image-users-keep-egress", seed003ImageUsers},
		{"seed003/native-sidecar-job", seed003NativeJob},
		{"validator/in-the-proxys-start", validatorInTheProxysStart},
		{"validator/debug-container-captured", validatorDebugContainer},
		{"validator/init-container-where-image-volumes-are-not-possible", validatorWhereImageVolumesAreNotPossible},
		{"podsecurity/restricted-namespace", podSecurityRestricted},
		{"seed003/user-namespaces", seed003UserNamespaces},
		{"seed002/no-nsenter-on-the-runtime-path", seed002NoNsenter},
		{"runtime/annotations-from-the-runtime", runtimeAnnotations},
		{"kubectl/warnings", kubectlWarnings},
		{"badinput/kubectl-apply", badInput},
		{"check/cluster-healthy", checkClusterHealthy},
		{"node/agent-follows-the-node", agentFollowsTheNode},
		{"monitoring/alerts-fire-and-resolve", alertsFireAndResolve},
		{"seed000/repair-after-the-node-broke", seed000Repair},
		{"seed000/jobs-complete-after-the-node-broke", seed000Jobs},
		{"dropin/survives-the-primary-rewriting-its-conflist", dropInSurvivesRewrites},
		{"cluster", clusterSmoke},
		{"services/cluster-ip-and-dns", servicesAndDNS},
		{"mesh-wide/every-namespace", meshWide},
		{"conformance/smoke", conformanceSmoke},
		{"uninstall/helm", uninstallHelm},
		{"install/manifest", installManifest},
	}
	for _, s := range stories {
		if !t.Run(s.name, func(t *testing.T) { s.run(t, ctx, e) }) && ctx.Err() != nil {
			return
		}
	}
}

// TestSoak is the reliability soak of issue 14 (docs/reliability.md): on the real node, with
// detour installed from its chart (two webhook replicas), Deployments scaled up and down in
// waves of 20 pods, Jobs and a few bare pods, while faults hit the node at seeded random
// moments — the node agent's pod deleted, containerd, the kubelet and kube-apiserver restarted,
// a webhook replica deleted, the webhook's serving certificate rotated, the primary CNI
// rewriting its conflist, a node reboot. Every injected pod that goes Ready is proven captured
// by a real inbound connection; the test fails when one ran its app without the redirect
// while its validator passed, when repair deleted a bare pod, when a pod admitted uninjected
// is not reported by `detour check --cluster`, or when anything of a deleted pod stays on the
// node. It prints a table of every figure at the end.
//
// It is declared here, after TestE2E, because go test runs a package's tests in the order of
// their files and declarations: the stories begin on a node that still carries its startup
// taint, which the soak's node agent removes.
//
// SOAK_DURATION (default 2m: the short form that `make e2e` runs) sets its length, split in
// two phases: the webhook's failurePolicy Fail, then Ignore; `make soak` runs 10m. SOAK_SEED
// replays a fault schedule.
func TestSoak(t *testing.T) {
	e := framework.SetUp(t)
	cfg := soakConfigFromEnv(t)
	// Beyond the duration: the faults' recovery, each phase's settling (up to 10 minutes),
	// the checks at the end. On a machine shared with other runs all of them stretch.
	ctx, cancel := framework.Context(t, e.Node, cfg.duration+50*time.Minute)
	defer cancel()
	// After TestE2E, `kubectl delete -f install.yaml` may still be deleting detour's namespace.
	framework.WaitFor(t, ctx, "namespace "+framework.DetourNamespace+" to finish terminating", 3*time.Minute, func() (bool, error) {
		ns, err := e.Node.Client.CoreV1().Namespaces().Get(ctx, framework.DetourNamespace, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		if err != nil {
			return false, err
		}
		return ns.DeletionTimestamp == nil, framework.Seen("namespace %s: %s since %s", ns.Name, ns.Status.Phase, ns.DeletionTimestamp)
	})
	values, config := "webhook: {replicas: 2}\n", e.DropInPath()
	if cfg.configMode == "chained-entry" {
		values += "nodeAgent: {cniConfigMode: chained-entry}\n"
		config = e.Node.PrimaryConfigPath()
	}
	e.InstallDetour(t, ctx, values)
	e.SetAgent(t, ctx, true)
	e.WaitDetourConfigs(t, ctx, "detour's configuration to be in place, once", config)
	if cfg.configMode == "chained-entry" {
		// What follows the soak (a later test, or TestSoak again) expects the default.
		defer e.InstallDetour(t, ctx, "")
	}

	s := newSoak(t, e, cfg)
	if err := s.run(ctx); err != nil {
		// A fault that failed: what follows would wait on a node that cannot recover.
		s.mu.Lock()
		s.logFaults()
		s.mu.Unlock()
		t.Fatal(err)
	}
	s.finish(ctx)
}

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
	// The validator's check ran at the proxy's start (validator.mode auto on this node): the
	// proxy is the first init container, and nothing of the check keeps the Job alive.
	proxy := p.Spec.InitContainers[0]
	if !framework.ChecksAtProxyStart(&p) || proxy.Name != "detour-proxy" || proxy.RestartPolicy == nil || *proxy.RestartPolicy != corev1.ContainerRestartPolicyAlways {
		t.Errorf("first init container %s (restartPolicy %v, detour.dev/validator %q), want the native detour-proxy running the check", proxy.Name, proxy.RestartPolicy, p.Annotations[annotations.Validator])
	}
	// Both the init container's and the app's dial went through the proxy.
	if log := e.Logs(ctx, "batch", p.Name, "detour-proxy"); strings.Count(log, "-> "+e.Server) < 2 {
		t.Errorf("the proxy did not carry both the init container's and the app's connection to %s:\n%s", e.Server, log)
	}
}

// seed002NoNsenter: the runtime runs every plugin with a PATH that holds no nsenter and
// nothing else of util-linux, and the stories above ran on it.
func seed002NoNsenter(t *testing.T, ctx context.Context, e *framework.Env) {
	pid := e.Node.PID("containerd")
	environ, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
	if err != nil {
		t.Fatal(err)
	}
	var path string
	for kv := range strings.SplitSeq(string(environ), "\x00") {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			path = v
		}
	}
	if path == "" {
		t.Fatalf("containerd (pid %d) has no PATH", pid)
	}
	for dir := range strings.SplitSeq(path, ":") {
		entries, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		for _, ent := range entries {
			switch name := ent.Name(); {
			case name == "nsenter", name == "unshare", name == "mount", name == "setpriv":
				t.Errorf("containerd's PATH %s holds %s/%s", path, dir, name)
			}
		}
	}
	if added := e.PluginLog(t, "ADD", "redirected"); len(added) == 0 {
		t.Errorf("detour-cni installed no redirect on this node; log:\n%s", framework.Tail(framework.ReadFile(e.PluginLogPath()), 20))
	}
}

// runtimeAnnotations: containerd hands the pod's annotations to detour-cni (the plugin's log
// names that source) and the API server sees no GET of a pod from the plugin.
func runtimeAnnotations(t *testing.T, ctx context.Context, e *framework.Env) {
	added := e.PluginLog(t, "ADD", "redirected")
	if len(added) == 0 {
		t.Fatal("no ADD installed a redirect yet")
	}
	for _, l := range added {
		if l.Annotations != "runtimeConfig" {
			t.Errorf("the ADD of %s read the annotations from %q, not from the runtime", l.Pod, l.Annotations)
		}
	}
	audit := framework.ReadFile(e.Node.AuditLogPath())
	var gets int
	for line := range strings.SplitSeq(audit, "\n") {
		var ev struct {
			Verb string `json:"verb"`
			User struct {
				Username string `json:"username"`
			} `json:"user"`
		}
		if json.Unmarshal([]byte(line), &ev) != nil {
			continue
		}
		if ev.Verb == "get" && ev.User.Username == "system:serviceaccount:"+framework.DetourNamespace+":detour-cni" {
			gets++
		}
	}
	if gets != 0 {
		t.Errorf("the API server saw %d GETs of pods by detour-cni; want 0 (annotations come from the runtime)", gets)
	}
	if strings.Count(audit, "\n") == 0 {
		t.Error("the audit log is empty: the check above proves nothing")
	}
	// containerd polls STATUS; the node's network stays ready.
	if status := e.PluginLog(t, "STATUS", "ready"); len(status) == 0 {
		t.Errorf("containerd never called STATUS (or detour-cni logged none)")
	}
	// containerd 2.4 never calls CHECK or GC (docs/cni-plugin.md says so).
	for _, cmd := range []string{"CHECK", "GC"} {
		if n := len(e.PluginLog(t, cmd, "")); n != 0 {
			t.Errorf("containerd called %s %d times; docs/cni-plugin.md says it never does", cmd, n)
		}
	}
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

// checkClusterHealthy: on the node as the stories above left it — detour installed, the
// agent ready, pods injected — `detour check --cluster` exits 0, and the checks that need
// the real cluster pass: the certificate the webhook serves (seen through a port-forward by
// the kubelet), a dry-run admission through the real webhook, the agent, taint and label.
func checkClusterHealthy(t *testing.T, ctx context.Context, e *framework.Env) {
	report, failed := e.CheckCluster(t, ctx)
	if failed {
		t.Errorf("detour check --cluster failed on a healthy node: %+v", report.Results)
	}
	for _, name := range []string{"webhook-config", "webhook-endpoints", "webhook-certificate", "webhook-admission",
		"webhook-deployment", "node-agent", "startup-taint", "ready-label", "validator"} {
		framework.WantCheck(t, report, name, clustercheck.OK, "")
	}
}

// seed000Repair: with the agent gone and detour's configuration (drop-in or in-file entry)
// removed behind its back, a new pod starts without rules and its validator fails; once the agent is back, repair deletes the
// pod, its ReplicaSet recreates it and it runs. A bare pod is annotated, never deleted.
func seed000Repair(t *testing.T, ctx context.Context, e *framework.Env) {
	e.SetAgent(t, ctx, false)
	// Both forms go: the drop-in first, then the conflist's rewrite makes containerd reload.
	if err := os.RemoveAll(filepath.Dir(e.DropInPath())); err != nil {
		t.Fatal(err)
	}
	if err := e.Node.WritePrimaryConfig(); err != nil {
		t.Fatal(err)
	}
	e.Namespace(t, ctx, "late", true)
	if _, err := e.Node.Client.AppsV1().Deployments("late").Create(ctx, e.Deployment("late", "late", 1), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Node.Client.CoreV1().Pods("late").Create(ctx, e.Pod("bare", "late"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var failed map[string]string // pod name → UID
	framework.WaitFor(t, ctx, "both pods' validators to fail (no rules)", 2*time.Minute, func() (bool, error) {
		pods, err := e.Pods(ctx, "late", "")
		if err != nil {
			return false, err
		}
		failed = map[string]string{}
		for _, p := range pods {
			if framework.CheckExit(&p) == 42 {
				failed[p.Name] = string(p.UID)
			}
		}
		return len(failed) == 2, framework.Seen("validators failed with 42: %v; pods:\n%s", failed, e.Describe(ctx, "late"))
	})
	// Caught at the proxy's start (validator.mode auto): the sidecar exited with the validator's
	// code and message, and the app never ran (fail closed).
	pods, err := e.Pods(ctx, "late", "")
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pods {
		if !framework.ChecksAtProxyStart(&p) {
			t.Errorf("pod %s: the check ran in %s, want the proxy's start", p.Name, validator.CheckContainer(&p))
		}
		for _, c := range p.Status.ContainerStatuses {
			if c.State.Running != nil || c.State.Terminated != nil || c.LastTerminationState.Terminated != nil {
				t.Errorf("pod %s: container %s ran although its proxy's check found no redirect: %s", p.Name, c.Name, framework.ContainerStates(&p))
			}
		}
	}

	// `detour check --cluster` sees the broken node: no agent, two failed validators.
	report, exitNonZero := e.CheckCluster(t, ctx)
	if !exitNonZero {
		t.Errorf("detour check --cluster exited 0 on a node without its agent")
	}
	if res, _ := report.Result("node-agent"); res.Status == clustercheck.OK {
		t.Errorf("check node-agent is ok on a node without its agent: %s", res.Message)
	}
	framework.WantCheck(t, report, "validator", clustercheck.Error, "exit 42")

	e.SetAgent(t, ctx, true)
	replaced := e.WaitReady(t, ctx, "late", "app=late", 1)[0]
	if _, stale := failed[replaced.Name]; stale {
		t.Errorf("the Deployment's pod %s was not recreated", replaced.Name)
	}
	if code := framework.CheckExit(&replaced); code != 0 {
		t.Errorf("the recreated pod's validator exited %d", code)
	}
	framework.WaitFor(t, ctx, "repair to annotate the bare pod", time.Minute, func() (bool, error) {
		p, err := e.Node.Client.CoreV1().Pods("late").Get(ctx, "bare", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if string(p.UID) != failed["bare"] {
			return false, fmt.Errorf("the bare pod was replaced")
		}
		_, ok := p.Annotations[repair.RecreateAnnotation]
		return ok, framework.Seen("the bare pod's annotations %v", p.Annotations)
	})
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
