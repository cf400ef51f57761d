package framework

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"
)

// Namespace creates ns, opted in to injection when inject is set, and waits for its default
// ServiceAccount.
func (e *Env) Namespace(t testing.TB, ctx context.Context, ns string, inject bool) {
	t.Helper()
	obj := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}
	if inject {
		obj.Annotations = map[string]string{"detour.dev/inject": "enabled"}
	}
	if _, err := e.Node.Client.CoreV1().Namespaces().Create(ctx, obj, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	if err := e.Node.WaitServiceAccount(ctx, ns); err != nil {
		t.Fatalf("namespace %s has no default ServiceAccount: %v", ns, err)
	}
}

// DropNamespaces deletes namespaces and waits until they are gone, their pods with them: the
// next story drains or removes nodes, which a terminating pod would hold up.
func (e *Env) DropNamespaces(t testing.TB, ctx context.Context, names ...string) {
	t.Helper()
	for _, ns := range names {
		if err := e.Node.Client.CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Errorf("delete namespace %s: %v", ns, err)
		}
	}
	WaitFor(t, ctx, fmt.Sprintf("namespaces %v to be gone", names), 2*time.Minute, func() (bool, error) {
		var left []string
		for _, ns := range names {
			if _, err := e.Node.Client.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{}); err == nil {
				left = append(left, ns)
			} else if !apierrors.IsNotFound(err) {
				return false, err
			}
		}
		return len(left) == 0, Seen("still there: %v", left)
	})
}

// Pod is the stories' test pod, labelled name=name: an init container that dials the test
// server (it must reach it) and an app that dials it too and then serves on 8080, running as
// UID 1000 with a readiness probe on that port. It is injected when ns opts in
// ([Env.Namespace]).
func (e *Env) Pod(name, ns string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: map[string]string{"name": name}},
		Spec: corev1.PodSpec{
			AutomountServiceAccountToken:  ptr.To(false),
			TerminationGracePeriodSeconds: ptr.To[int64](2),
			InitContainers: []corev1.Container{{
				Name: "init", Image: e.img.refs.Workload, ImagePullPolicy: e.img.pull,
				Args:            []string{"dial", "-must", "-addr", e.Server},
				SecurityContext: &corev1.SecurityContext{RunAsUser: ptr.To[int64](1500)},
			}},
			Containers: []corev1.Container{{
				Name: "app", Image: e.img.refs.Workload, ImagePullPolicy: e.img.pull,
				Args:            []string{"dial", "-retry", "30s", "-addr", e.Server, "then", "serve", "-listen", ":8080"},
				SecurityContext: &corev1.SecurityContext{RunAsUser: ptr.To[int64](1000)},
				ReadinessProbe: &corev1.Probe{
					ProbeHandler:  corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(8080)}},
					PeriodSeconds: 1,
				},
			}},
		},
	}
}

// Deployment runs replicas of [Env.Pod] in ns, labelled app=name.
func (e *Env) Deployment(name, ns string, replicas int32) *appsv1.Deployment {
	p := e.Pod(name, ns)
	labels := map[string]string{"app": name}
	return &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: appsv1.DeploymentSpec{
			Replicas: &replicas,
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels}, Spec: p.Spec},
		},
	}
}

// OnNode pins p to node through the scheduler (the hostname label), as a user's node
// selector would.
func OnNode(p *corev1.Pod, node string) *corev1.Pod {
	p.Spec.NodeSelector = map[string]string{corev1.LabelHostname: node}
	return p
}

// OnNodeDeployment pins dep's pods to node, as [OnNode] pins a pod.
func OnNodeDeployment(dep *appsv1.Deployment, node string) *appsv1.Deployment {
	dep.Spec.Template.Spec.NodeSelector = map[string]string{corev1.LabelHostname: node}
	return dep
}

// Pods lists the pods of ns matching the label selector (all of them when it is empty).
func (e *Env) Pods(ctx context.Context, ns, selector string) ([]corev1.Pod, error) {
	list, err := e.Node.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: selector})
	if err != nil {
		return nil, err
	}
	return list.Items, nil
}

// WaitReady waits until n pods of ns matching selector are Ready and returns them.
func (e *Env) WaitReady(t testing.TB, ctx context.Context, ns, selector string, n int) []corev1.Pod {
	t.Helper()
	var ready []corev1.Pod
	err := Poll(ctx, 2*time.Minute, func() (bool, error) {
		pods, err := e.Pods(ctx, ns, selector)
		if err != nil {
			return false, err
		}
		ready = ready[:0]
		var waiting []string
		for _, p := range pods {
			if p.DeletionTimestamp == nil && PodReady(&p) {
				ready = append(ready, p)
			} else {
				waiting = append(waiting, p.Name)
			}
		}
		return len(ready) == n, Seen("%d ready, not ready: %v", len(ready), waiting)
	})
	if err != nil {
		t.Fatalf("waiting for %d ready pods %q in %s: %v\n%s", n, selector, ns, err, e.Describe(ctx, ns))
	}
	return ready
}

// PodReady reports whether p's Ready condition is true.
func PodReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// ContainerStates summarises p's containers for a wait's message: name, state, restarts.
func ContainerStates(p *corev1.Pod) string {
	var parts []string
	for _, c := range append(slices.Clone(p.Status.InitContainerStatuses), p.Status.ContainerStatuses...) {
		state := "waiting"
		switch {
		case c.State.Running != nil:
			state = "running since " + c.State.Running.StartedAt.UTC().Format(time.TimeOnly)
		case c.State.Terminated != nil:
			state = fmt.Sprintf("exited %d", c.State.Terminated.ExitCode)
		case c.State.Waiting != nil:
			state = "waiting: " + c.State.Waiting.Reason
		}
		parts = append(parts, fmt.Sprintf("%s %s, %d restarts", c.Name, state, c.RestartCount))
	}
	return "[" + strings.Join(parts, "; ") + "]"
}

// Logs returns a container's log, or a line saying why there is none.
func (e *Env) Logs(ctx context.Context, ns, pod, container string) string {
	data, err := e.Node.Client.CoreV1().Pods(ns).GetLogs(pod, &corev1.PodLogOptions{Container: container}).DoRaw(ctx)
	if err != nil {
		return fmt.Sprintf("(no log of %s/%s %s: %v)", ns, pod, container, err)
	}
	return string(data)
}

// LogsAll is what container logged in every instance the kubelet still keeps: the previous
// one's log (when it restarted) before the current one's, so a count of connections does not
// lose those an earlier instance carried.
func (e *Env) LogsAll(ctx context.Context, ns, pod, container string) string {
	prev, err := e.Node.Client.CoreV1().Pods(ns).GetLogs(pod, &corev1.PodLogOptions{Container: container, Previous: true}).DoRaw(ctx)
	if err != nil {
		return e.Logs(ctx, ns, pod, container)
	}
	return string(prev) + "(restarted)\n" + e.Logs(ctx, ns, pod, container)
}

// Describe summarises the pods and events of ns for a failure message.
func (e *Env) Describe(ctx context.Context, ns string) string {
	var b strings.Builder
	pods, _ := e.Node.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	for _, p := range pods.Items {
		status, _ := yaml.Marshal(p.Status)
		fmt.Fprintf(&b, "pod %s/%s:\n%s\n", ns, p.Name, status)
	}
	events, _ := e.Node.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
	for _, ev := range events.Items {
		fmt.Fprintf(&b, "event %s %s %s: %s\n", ev.InvolvedObject.Name, ev.Type, ev.Reason, ev.Message)
	}
	return b.String()
}
