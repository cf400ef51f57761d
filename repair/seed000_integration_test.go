package repair_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/prometheus/client_golang/prometheus"
	appsv1 "k8s.io/api/apps/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/internal/cli"
	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/nodeagent"
	"github.com/detourmesh/detour/repair"
	"github.com/detourmesh/detour/test/testenv"
	"github.com/detourmesh/detour/validator"
)

func TestMain(m *testing.M) {
	testenv.MainWithChildren(m, map[string]func([]string) int{"detour": cli.Main})
}

var (
	proxyUID    = uint32(2102)
	validatorID = testenv.Identity{UID: 2103, GID: 2103}
	redirect    = annotations.Redirect{Version: "v0.1.0-test", ProxyUID: proxyUID, InboundPort: 4143, OutboundPort: 4140}
)

func suffix() string {
	var b [3]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// node is a freshly scaled node: its CNI config and bin directories, the runtime that reads
// them through libcni as containerd does, and the detour agent's service account.
type node struct {
	name            string
	confDir, binDir string
	saDir           string
	cniCache        string
}

// sandbox creates a pod's sandbox the way the runtime does: it loads the configuration the
// runtime would use from the node's directory and runs ADD of it, with the pod's annotations
// in runtimeConfig. It returns the sandbox's network namespace.
func (n *node) sandbox(t *testing.T, pod *corev1.Pod) *testenv.NetNS {
	t.Helper()
	primary, err := nodeagent.Primary(n.confDir)
	if err != nil || primary == "" {
		t.Fatalf("the node has no CNI config: %q, %v", primary, err)
	}
	list, err := libcni.ConfListFromFile(primary)
	if err != nil {
		t.Fatal(err)
	}
	ns := testenv.NewNetNS(t)
	rt := libcni.NewCNIConfigWithCacheDir([]string{n.binDir, testenv.BinDir()}, n.cniCache, nil)
	att := testenv.PodAttachment(ns, pod.Namespace, pod.Name, string(pod.UID), pod.Annotations)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := rt.AddNetworkList(ctx, list, att.Runtime); err != nil {
		t.Fatalf("create the sandbox of %s through %s: %v", pod.Name, primary, err)
	}
	t.Cleanup(func() { rt.DelNetworkList(context.Background(), list, att.Runtime) })
	return ns
}

// validate runs the real validator (`detour validate`, as the injected init container runs it)
// in the sandbox as the validator's UID. The sentinel is an unused address of the bridge's own
// subnet, so an unredirected connection stays on the test bridge instead of leaving the machine.
func validate(t *testing.T, ns *testenv.NetNS, sentinel netip.Addr) testenv.ChildResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res, err := testenv.RunChild(ctx, ns, validatorID, "detour", "validate", "--port=4140", "--timeout=2s",
		"--sentinel="+netip.AddrPortFrom(sentinel, 80).String())
	if err != nil {
		t.Fatalf("detour validate: %v", err)
	}
	t.Logf("validator in %s: exit %d %s%s", ns.Name, res.ExitCode, res.Stdout, res.Stderr)
	return res
}

// podFor is an injected pod on nodeName (what the webhook and scheduler made of it).
func podFor(namespace, name, nodeName string, owner *metav1.OwnerReference) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace, Annotations: redirect.Annotations(), Labels: map[string]string{"app": "web"}},
		Spec: corev1.PodSpec{
			NodeName: nodeName,
			InitContainers: []corev1.Container{{
				Name: annotations.ValidatorContainer, Image: "detour:test", Args: []string{"validate", "--port=4140"},
				SecurityContext: &corev1.SecurityContext{RunAsUser: ptr.To(int64(validatorID.UID))},
			}},
			Containers: []corev1.Container{
				{Name: "app", Image: "web:1"},
				{Name: annotations.ProxyContainer, Image: "proxy:1", SecurityContext: &corev1.SecurityContext{RunAsUser: ptr.To(int64(proxyUID))}},
			},
		},
	}
	if owner != nil {
		p.OwnerReferences = []metav1.OwnerReference{*owner}
	}
	return p
}

// reportValidator sets the pod's status as the kubelet does after the validator exited with
// res: the init container terminated with its exit code and message, now in back-off.
func reportValidator(t *testing.T, client kubernetes.Interface, pod *corev1.Pod, res testenv.ChildResult) {
	t.Helper()
	pod, err := client.CoreV1().Pods(pod.Namespace).Get(context.Background(), pod.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	now := metav1.Now()
	pod.Status.Phase = corev1.PodPending
	pod.Status.InitContainerStatuses = []corev1.ContainerStatus{{
		Name:  annotations.ValidatorContainer,
		Image: "detour:test",
		State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff"}},
		LastTerminationState: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{
			ExitCode: int32(res.ExitCode), Reason: "Error", Message: res.Stderr, StartedAt: now, FinishedAt: now,
		}},
		RestartCount: 1,
	}}
	if _, err := client.CoreV1().Pods(pod.Namespace).UpdateStatus(context.Background(), pod, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("update the status of %s: %v", pod.Name, err)
	}
}

func counter(t *testing.T, reg *prometheus.Registry, name, label string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if label == "" || (len(m.GetLabel()) == 1 && m.GetLabel()[0].GetValue() == label) {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Seed 000: pods scheduled onto a fresh node before detour's CNI config was in place get no
// redirect; their validator fails for ever (Init:CrashLoopBackOff) because the sandbox is
// never recreated. detour's agent installs the config and marks the node ready, and repair
// has the failed pods recreated — the controller-owned one deleted, the bare one annotated.
func TestIntegrationSeed000(t *testing.T) {
	testenv.Privileged(t)
	testenv.Binary(t, "bridge")
	testenv.Binary(t, "host-local")
	cfg := testenv.ControlPlane(t)
	client := kubernetes.NewForConfigOrDie(cfg)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	id := suffix()

	// The cluster: a node registered with the startup taint, a namespace, a ReplicaSet.
	n := &node{name: "fresh-" + id, confDir: t.TempDir(), binDir: t.TempDir(), saDir: t.TempDir(), cniCache: t.TempDir()}
	_, err := client.CoreV1().Nodes().Create(ctx, &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: n.name},
		Spec:       corev1.NodeSpec{Taints: []corev1.Taint{{Key: annotations.CNINotReadyTaint, Value: "true", Effect: corev1.TaintEffectNoSchedule}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.CoreV1().Nodes().Delete(context.Background(), n.name, metav1.DeleteOptions{}) })
	namespace := "shop-" + id
	if _, err := client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.CoreV1().Namespaces().Delete(context.Background(), namespace, metav1.DeleteOptions{}) })
	rs, err := client.AppsV1().ReplicaSets(namespace).Create(ctx, &appsv1.ReplicaSet{
		ObjectMeta: metav1.ObjectMeta{Name: "web-7d9f"},
		Spec: appsv1.ReplicaSetSpec{
			Replicas: ptr.To(int32(1)),
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "web"}},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": "web"}},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "app", Image: "web:1"}}},
			},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	owner := metav1.NewControllerRef(rs, appsv1.SchemeGroupVersion.WithKind("ReplicaSet"))

	// The node's primary CNI (bridge + host-local) writes its config; detour's agent has not
	// run yet.
	bridge := testenv.NewBridge(t, false)
	writeFile(t, filepath.Join(n.confDir, "10-bridge.conflist"), string(testenv.ConfList("bridge-net", bridge.Plugins()...)))
	net4 := bridge.Subnet4.Addr().As4()
	sentinel := netip.AddrFrom4([4]byte{net4[0], net4[1], net4[2], 254}) // host-local hands out .2 upward

	// The scheduler put three injected pods here meanwhile (and one on another node).
	create := func(p *corev1.Pod) *corev1.Pod {
		t.Helper()
		p, err := client.CoreV1().Pods(namespace).Create(ctx, p, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	web := create(podFor(namespace, "web-7d9f-abcde", n.name, owner))
	debug := create(podFor(namespace, "debug", n.name, nil))
	elsewhere := create(podFor(namespace, "web-7d9f-zzzzz", "other-"+id, owner))

	// Their sandboxes get the bridge only: no detour rules.
	for _, p := range []*corev1.Pod{web, debug} {
		sb := n.sandbox(t, p)
		rules, _, err := iptables.NewExecutor().Save(ctx, sb.Path, iptables.IPv4)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(rules, iptables.OutboundChain) {
			t.Fatalf("sandbox of %s has detour rules before the agent ran:\n%s", p.Name, rules)
		}
		// The real validator fails there with its documented code, and the kubelet reports it.
		res := validate(t, sb, sentinel)
		if res.ExitCode != validator.ExitNoRedirect || !strings.Contains(res.Stderr, "no redirect in this pod's network namespace") {
			t.Fatalf("validator in %s's sandbox: exit %d, %q; want %d", p.Name, res.ExitCode, res.Stderr, validator.ExitNoRedirect)
		}
		reportValidator(t, client, p, res)
	}
	reportValidator(t, client, elsewhere, testenv.ChildResult{ExitCode: validator.ExitNoRedirect})

	// Repair starts with the DaemonSet, before the agent finished: it sees the failures but
	// waits for the node's CNI config.
	reg := prometheus.NewRegistry()
	flags := repair.DefaultFlags()
	flags.NodeName, flags.Rate, flags.Burst = n.name, 5, 5
	rcfg, err := flags.Parse()
	if err != nil {
		t.Fatal(err)
	}
	logger := slog.New(slog.NewTextHandler(testWriter{t}, nil))
	ctrl, err := repair.New(client, rcfg, repair.WithMetrics(repair.NewMetrics(reg)), repair.WithLogger(logger))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- ctrl.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("repair Run: %v", err)
		}
	}()
	eventually(t, "repair defers the failed pods until the node is ready", func() bool {
		return counter(t, reg, "detour_repair_pods_deferred_total", repair.DeferNodeNotReady) >= 2
	})
	if got, _ := client.CoreV1().Pods(namespace).Get(ctx, web.Name, metav1.GetOptions{}); got.DeletionTimestamp != nil {
		t.Fatal("repair deleted a pod before the node's CNI config was in place")
	}

	// The agent installs detour: binary, kubeconfig (a real service-account token), entry,
	// then the node's taint and label.
	sa, err := client.CoreV1().ServiceAccounts(namespace).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "detour-cni"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	tok, err := client.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, sa.Name, &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(n.saDir, "token"), tok.Status.Token)
	writeFile(t, filepath.Join(n.saDir, "ca.crt"), string(cfg.CAData))
	af := nodeagent.DefaultFlags()
	af.ConfDir, af.HostConfDir, af.BinDir, af.ServiceAccountDir = n.confDir, n.confDir, n.binDir, n.saDir
	af.PluginSource, af.APIServer, af.NodeName = testenv.DetourCNI(t), cfg.Host, n.name
	acfg, err := af.Parse()
	if err != nil {
		t.Fatal(err)
	}
	agent := nodeagent.New(acfg, nodeagent.WithNodeClient(client), nodeagent.WithLogger(logger))
	if s, err := agent.Reconcile(ctx); err != nil || !s.NodeReady {
		t.Fatalf("agent Reconcile = %+v, %v", s, err)
	}
	fresh, _ := client.CoreV1().Nodes().Get(ctx, n.name, metav1.GetOptions{})
	if slices.ContainsFunc(fresh.Spec.Taints, func(t corev1.Taint) bool { return t.Key == annotations.CNINotReadyTaint }) || fresh.Labels[annotations.CNIReadyLabel] != "true" {
		t.Errorf("node after the agent: taints %v labels %v", fresh.Spec.Taints, fresh.Labels)
	}

	// A sandbox created now gets detour's rules, and the validator passes in it.
	replacement := create(podFor(namespace, "web-7d9f-fghij", n.name, owner))
	sb := n.sandbox(t, replacement)
	if res := validate(t, sb, sentinel); res.ExitCode != validator.ExitOK {
		t.Fatalf("validator in a sandbox created after the agent ran: exit %d, %s", res.ExitCode, res.Stderr)
	}

	// Repair: the ReplicaSet's pod is deleted (its controller recreates it); the bare pod is
	// only annotated; the pod on the other node is not even in repair's cache.
	eventually(t, "repair deletes the controller-owned pod and annotates the bare one", func() bool {
		w, err1 := client.CoreV1().Pods(namespace).Get(ctx, web.Name, metav1.GetOptions{})
		d, err2 := client.CoreV1().Pods(namespace).Get(ctx, debug.Name, metav1.GetOptions{})
		return err1 == nil && w.DeletionTimestamp != nil && err2 == nil && d.Annotations[repair.RecreateAnnotation] != ""
	})
	d, _ := client.CoreV1().Pods(namespace).Get(ctx, debug.Name, metav1.GetOptions{})
	if d.DeletionTimestamp != nil {
		t.Error("repair deleted the bare pod")
	}
	t.Logf("%s: %s", repair.RecreateAnnotation, d.Annotations[repair.RecreateAnnotation])
	for _, p := range []string{elsewhere.Name, replacement.Name} {
		got, _ := client.CoreV1().Pods(namespace).Get(ctx, p, metav1.GetOptions{})
		if got.DeletionTimestamp != nil || got.Annotations[repair.RecreateAnnotation] != "" {
			t.Errorf("repair acted on %s", p)
		}
	}

	// One Event per action.
	events, err := client.CoreV1().Events(namespace).List(ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("reason", repair.EventReason).String()})
	if err != nil {
		t.Fatal(err)
	}
	actions := map[string]string{}
	for _, e := range events.Items {
		if _, dup := actions[e.InvolvedObject.Name]; dup {
			t.Errorf("two events for %s", e.InvolvedObject.Name)
		}
		actions[e.InvolvedObject.Name] = e.Action
		t.Logf("event %s %s on %s: %s", e.Type, e.Reason, e.InvolvedObject.Name, e.Message)
	}
	if len(actions) != 2 || actions[web.Name] != "Delete" || actions[debug.Name] != "Annotate" {
		t.Errorf("events by pod %v, want Delete for %s and Annotate for %s", actions, web.Name, debug.Name)
	}

	// And the metrics show it.
	for _, m := range []struct {
		name, label string
		want        float64
	}{
		{"detour_repair_pods_seen_total", "", 2},
		{"detour_repair_pods_deleted_total", "", 1},
		{"detour_repair_pods_skipped_total", repair.SkipNoController, 1},
		{"detour_repair_errors_total", repair.ActionDelete, 0},
		{"detour_repair_errors_total", repair.ActionEvent, 0},
	} {
		if got := counter(t, reg, m.name, m.label); got != m.want {
			t.Errorf("%s{%s} = %v, want %v", m.name, m.label, got, m.want)
		}
	}
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(b)))
	return len(b), nil
}
