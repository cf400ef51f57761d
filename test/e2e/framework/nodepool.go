package framework

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// Join starts a node that joins the cluster as an admin following docs/operations.md would
// add one to a node pool: registered with detour's startup taint and labelled for the node
// agent. It returns once the node is Ready, the agent runs on it and has removed the taint.
// The node leaves, and its Node object goes, when the test ends.
func (e *Env) Join(t testing.TB, ctx context.Context, name string) *Node {
	t.Helper()
	n := e.JoinNode(t, ctx, name, Options{
		Taints: []string{StartupTaint + ":NoSchedule"},
		Labels: []string{AgentLabel + "=yes"},
	})
	WaitFor(t, ctx, "the node agent to run on "+name+" and remove its startup taint", 3*time.Minute, func() (bool, error) {
		node, err := e.Node.Client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		agent, err := e.AgentPod(ctx, name)
		if err != nil {
			return false, err
		}
		return agent != nil && PodReady(agent) && !HasStartupTaint(node), Seen("agent %v, taints %v", AgentState(agent), node.Spec.Taints)
	})
	return n
}

// JoinNode starts a node that joins the cluster with opts (the sandbox image, and the images
// when they are imported rather than pulled from the registry) and makes it leave, and its
// Node object go, when the test ends — also when it failed to join after its kubelet
// registered, so that no agent pod waits on a node that is not there.
func (e *Env) JoinNode(t testing.TB, ctx context.Context, name string, opts Options) *Node {
	t.Helper()
	if opts.PauseImage == "" {
		opts.PauseImage = e.img.refs.Pause
	}
	if e.img.pull == corev1.PullNever && opts.Images == nil {
		opts.Images = e.Artifacts.Tarballs // the images come imported, not from the registry
	}
	n, err := e.Node.Join(ctx, name, opts)
	if err != nil {
		e.deleteNode(t, name)
		t.Fatalf("node %s did not join: %v", name, err)
	}
	t.Cleanup(func() { e.Remove(t, n) })
	return n
}

// Remove takes a node that joined out of the cluster: the machine goes, then its Node object.
func (e *Env) Remove(t testing.TB, n *Node) {
	t.Helper()
	if err := n.Leave(); err != nil {
		t.Errorf("node %s did not leave cleanly: %v", n.Name, err)
	}
	e.deleteNode(t, n.Name)
}

func (e *Env) deleteNode(t testing.TB, name string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := e.Node.Client.CoreV1().Nodes().Delete(ctx, name, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		t.Errorf("delete node %s: %v", name, err)
	}
}

// Cordon marks nodes unschedulable.
func (e *Env) Cordon(t testing.TB, ctx context.Context, nodes ...string) {
	t.Helper()
	e.setUnschedulable(t, ctx, true, nodes...)
}

// Uncordon marks nodes schedulable again.
func (e *Env) Uncordon(t testing.TB, ctx context.Context, nodes ...string) {
	t.Helper()
	e.setUnschedulable(t, ctx, false, nodes...)
}

func (e *Env) setUnschedulable(t testing.TB, ctx context.Context, unschedulable bool, nodes ...string) {
	t.Helper()
	patch := fmt.Sprintf(`{"spec":{"unschedulable":%v}}`, unschedulable)
	for _, n := range nodes {
		_, err := e.Node.Client.CoreV1().Nodes().Patch(ctx, n, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
		if err != nil && !apierrors.IsNotFound(err) {
			t.Fatalf("set node %s unschedulable=%v: %v", n, unschedulable, err)
		}
	}
}

// HasStartupTaint reports whether node carries detour's startup taint.
func HasStartupTaint(node *corev1.Node) bool {
	return slices.ContainsFunc(node.Spec.Taints, func(t corev1.Taint) bool { return t.Key == StartupTaint })
}

// NodeCondition returns whether the control-plane node ([NodeName]), as n's API server sees it,
// is Ready, and its Ready condition's message.
func NodeCondition(ctx context.Context, n *Node) (bool, string) {
	node, err := n.Client.CoreV1().Nodes().Get(ctx, NodeName, metav1.GetOptions{})
	if err != nil {
		return false, err.Error()
	}
	for _, c := range node.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.Status == corev1.ConditionTrue, c.Message
		}
	}
	return false, "no Ready condition"
}
