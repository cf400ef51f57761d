package e2e

import (
	"context"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/test/e2e/framework"
)

// The stories of issue 33: an inbound connection reaches the proxy only where the app listens
// (detour.dev/redirect-inbound: listening), so a client or a kubelet probe meets what the app
// does.

// inboundProbesMeetTheApp: a pod whose app binds its port 5 s after it starts, with a
// tcpSocket readiness probe on it, is not Ready before the app listens (the gap between the
// app's bind and Ready is printed); a pod whose app never binds its probed port never becomes
// Ready, and its liveness probe restarts it, as without detour.
func inboundProbesMeetTheApp(t *testing.T, ctx context.Context, e *framework.Env) {
	e.Namespace(t, ctx, "inbound", true)
	pods := e.Node.Client.CoreV1().Pods("inbound")

	late := e.Pod("late", "inbound")
	late.Spec.Containers[0].Args = []string{"sleep", "5s", "then", "serve", "-listen", ":8080"}
	start := time.Now()
	if _, err := pods.Create(ctx, late, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var readyAt time.Time
	framework.WaitFor(t, ctx, "the late pod to become Ready", 2*time.Minute, func() (bool, error) {
		p, err := pods.Get(ctx, "late", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if framework.PodReady(p) {
			readyAt = time.Now()
			return true, nil
		}
		return false, framework.Seen("%s", framework.ContainerStates(p))
	})
	if p, err := pods.Get(ctx, "late", metav1.GetOptions{}); err == nil && p.Annotations[annotations.RedirectInbound] != string(annotations.InboundListening) {
		t.Errorf("%s = %q, want listening", annotations.RedirectInbound, p.Annotations[annotations.RedirectInbound])
	}
	bound := bindTime(t, ctx, e, "inbound", "late")
	gap := readyAt.Sub(bound)
	t.Logf("the app listened %s after the pod's creation; Ready %s after it listened (seen by polling every 100ms)", bound.Sub(start).Round(time.Millisecond), gap.Round(time.Millisecond))
	if gap < 0 {
		t.Errorf("the pod was Ready %s before its app listened: its probe reached the proxy", -gap)
	}
	p, _ := pods.Get(ctx, "late", metav1.GetOptions{})
	e.AssertCaptured(t, ctx, *p, "late")

	never := e.Pod("never", "inbound")
	app := &never.Spec.Containers[0]
	app.Args = []string{"sleep"}
	app.LivenessProbe = &corev1.Probe{ProbeHandler: corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(8080)}},
		PeriodSeconds: 1, FailureThreshold: 2}
	if _, err := pods.Create(ctx, never, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	framework.WaitFor(t, ctx, "the liveness probe to restart the app that never listens", 2*time.Minute, func() (bool, error) {
		p, err := pods.Get(ctx, "never", metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if framework.PodReady(p) {
			return false, fmt.Errorf("the pod whose app never listens is Ready: %s", framework.ContainerStates(p))
		}
		for _, s := range p.Status.ContainerStatuses {
			if s.Name == "app" && s.RestartCount >= 1 {
				return true, nil
			}
		}
		return false, framework.Seen("%s", framework.ContainerStates(p))
	})
}

// bindTime is when the app of pod logged that it listens (the runtime's timestamp).
func bindTime(t *testing.T, ctx context.Context, e *framework.Env, ns, pod string) time.Time {
	t.Helper()
	raw, err := e.Node.Client.CoreV1().Pods(ns).GetLogs(pod, &corev1.PodLogOptions{Container: "app", Timestamps: true}).DoRaw(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(raw)) {
		stamp, text, _ := strings.Cut(line, " ")
		if strings.HasPrefix(text, "serve ") && strings.Contains(text, "listening on") {
			at, err := time.Parse(time.RFC3339Nano, stamp)
			if err != nil {
				t.Fatal(err)
			}
			return at
		}
	}
	t.Fatalf("the app of %s/%s never logged that it listens:\n%s", ns, pod, raw)
	return time.Time{}
}

// inboundEveryBackend: the plugin's inbound rule holds with every backend the node can use —
// nftables (auto's choice), iptables-legacy and iptables-nft, each set through the chart: a port
// the app binds on 127.0.0.1 only is refused from another pod and still served to the app's own
// process, a port it listens on everywhere reaches the proxy, and the pod's live rules carry the
// socket lookup of that backend.
func inboundEveryBackend(t *testing.T, ctx context.Context, e *framework.Env) {
	e.Namespace(t, ctx, "inbound-client", false)
	for _, b := range []struct {
		backend iptables.Backend
		rule    string // what the pod's live rules hold
	}{
		{iptables.BackendAuto, "socket wildcard 0 redirect to :4143"},
		{iptables.BackendLegacy, "-m socket --nowildcard"},
		{iptables.BackendNFT, "-m socket --nowildcard"},
	} {
		t.Run(string(b.backend), func(t *testing.T) {
			if b.backend != iptables.BackendAuto {
				e.InstallDetour(t, ctx, "nodeAgent: {plugin: {iptablesBackend: "+string(b.backend)+"}}\n")
				waitPluginBackend(t, ctx, e, b.backend)
			}
			inboundLoopbackStaysLocal(t, ctx, e, "inbound-"+string(b.backend), b.backend, b.rule)
		})
	}
	e.InstallDetour(t, ctx, "")
	waitPluginBackend(t, ctx, e, iptables.BackendAuto)
}

// waitPluginBackend waits until detour-cni's configuration on the node names backend.
func waitPluginBackend(t *testing.T, ctx context.Context, e *framework.Env, backend iptables.Backend) {
	t.Helper()
	framework.WaitFor(t, ctx, "the node agent to configure the plugin's backend "+string(backend), 2*time.Minute, func() (bool, error) {
		files, err := e.DetourConfigs()
		if err != nil {
			return false, err
		}
		for _, f := range files {
			if strings.Contains(framework.ReadFile(f), `"iptablesBackend": "`+string(backend)+`"`) {
				return true, nil
			}
		}
		return false, framework.Seen("detour's configuration in %v", files)
	})
}

// inboundLoopbackStaysLocal runs a pod in ns whose app listens on :8080 and whose admin
// container binds 127.0.0.1:9090, and checks with the plugin's backend that the loopback port is refused from another pod
// and served to the app's own process, that :8080 is captured, and that the pod's rules hold
// rule.
func inboundLoopbackStaysLocal(t *testing.T, ctx context.Context, e *framework.Env, ns string, backend iptables.Backend, rule string) {
	e.Namespace(t, ctx, ns, true)
	p := e.Pod("local", ns)
	app := p.Spec.Containers[0]
	p.Spec.Containers = append(p.Spec.Containers, corev1.Container{
		Name: "admin", Image: app.Image, ImagePullPolicy: app.ImagePullPolicy,
		Args:            []string{"serve", "-name", "admin", "-listen", "127.0.0.1:9090"},
		SecurityContext: &corev1.SecurityContext{RunAsUser: ptr.To[int64](1000)},
	}, corev1.Container{
		Name: "self", Image: app.Image, ImagePullPolicy: app.ImagePullPolicy,
		Args:            []string{"dial", "-must", "-retry", "30s", "-addr", "127.0.0.1:9090", "then", "sleep"},
		SecurityContext: &corev1.SecurityContext{RunAsUser: ptr.To[int64](1000)},
	})
	if _, err := e.Node.Client.CoreV1().Pods(ns).Create(ctx, p, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	server := e.WaitReady(t, ctx, ns, "name=local", 1)[0]
	framework.WaitFor(t, ctx, "the app's own process to reach its loopback port", time.Minute, func() (bool, error) {
		log := e.Logs(ctx, ns, "local", "self")
		return strings.Contains(log, "dial 127.0.0.1:9090 ok: admin"), framework.Seen("%s", log)
	})
	e.AssertCaptured(t, ctx, server, "local")
	if saved := podRules(t, ctx, e, &server, backend); !strings.Contains(saved, rule) {
		t.Errorf("the pod's live rules (%s backend) lack %q:\n%s", backend, rule, saved)
	}

	// A client outside the mesh, so that the refusal it sees is the server pod's kernel's, not
	// its own proxy closing a connection it accepted.
	addr := net.JoinHostPort(server.Status.PodIP, "9090")
	if log := dialOutsideMesh(t, ctx, e, "inbound-client", "client-"+string(backend), addr); !strings.Contains(log, "connection refused") {
		t.Errorf("a client in another pod dialled %s, bound on 127.0.0.1 only: %q, want connection refused", addr, log)
	}
}

// dialOutsideMesh runs a pod named name in ns (not injected) that dials addr once, and returns
// its log: the refusal it sees is the server pod's kernel's, not its own proxy's.
func dialOutsideMesh(t *testing.T, ctx context.Context, e *framework.Env, ns, name, addr string) string {
	t.Helper()
	workload := e.Pod(name, ns).Spec.Containers[0] // the workload image, as the stories' pods get it
	client := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: corev1.PodSpec{
			RestartPolicy: corev1.RestartPolicyNever, AutomountServiceAccountToken: ptr.To(false),
			Containers: []corev1.Container{{Name: "dial", Image: workload.Image, ImagePullPolicy: workload.ImagePullPolicy,
				Args: []string{"dial", "-timeout", "5s", "-addr", addr}}},
		},
	}
	if _, err := e.Node.Client.CoreV1().Pods(ns).Create(ctx, client, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	framework.WaitFor(t, ctx, "the client to finish", 2*time.Minute, func() (bool, error) {
		c, err := e.Node.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		return c.Status.Phase == corev1.PodSucceeded || c.Status.Phase == corev1.PodFailed, framework.Seen("%s", c.Status.Phase)
	})
	return e.Logs(ctx, ns, name, "dial")
}

// podRules is the pod's live nat rules (IPv4) as the backend prints them, read from the host
// through the pod's network namespace.
func podRules(t *testing.T, ctx context.Context, e *framework.Env, p *corev1.Pod, backend iptables.Backend) string {
	t.Helper()
	netns, err := e.PodNetns(p)
	if err != nil {
		t.Fatal(err)
	}
	saved, _, err := iptables.NewExecutor(iptables.WithBackend(backend)).Save(ctx, netns, iptables.IPv4)
	if err != nil {
		t.Fatalf("read the rules of pod %s: %v", p.Name, err)
	}
	return saved
}
