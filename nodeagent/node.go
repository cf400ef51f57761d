package nodeagent

import (
	"context"
	"encoding/json"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/inject"
)

// nodeReadiness marks the agent's node ready for injected pods. It never adds the startup
// taint: nodes are registered with it (kubelet --register-with-taints, Karpenter startupTaints).
type nodeReadiness struct {
	client kubernetes.Interface
	name   string
	taint  string
}

// markReady removes every taint with the startup key (any effect) and sets the ready label, the
// boot ID it holds for (annotations.CNIReadyBootAnnotation) and the image volumes label, in one
// merge patch that carries the node's resourceVersion: if the node changed since it was
// read (another controller edited its taints), the API server refuses it and it is retried on
// a fresh read, so no one else's change is lost. It reports whether it patched.
func (n *nodeReadiness) markReady(ctx context.Context) (bool, error) {
	patched := false
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		node, err := n.client.CoreV1().Nodes().Get(ctx, n.name, metav1.GetOptions{})
		if err != nil {
			return fmt.Errorf("get node %s: %w (the agent's service account needs get and patch on nodes)", n.name, err)
		}
		taints := make([]corev1.Taint, 0, len(node.Spec.Taints))
		for _, t := range node.Spec.Taints {
			if t.Key != n.taint {
				taints = append(taints, t)
			}
		}
		boot := node.Status.NodeInfo.BootID
		// The image volumes label follows the node's software, not detour's readiness: it is
		// only ever removed from a node that can no longer mount image volumes (see
		// annotations.ImageVolumesLabel), not while the kubelet cannot tell its runtime's
		// version (it reports "Unknown" while the runtime restarts).
		_, labelled := node.Labels[annotations.ImageVolumesLabel]
		var imageVolumes any
		if ok, _ := inject.ImageVolumes(node.Status.NodeInfo); ok || labelled && !inject.NodeVersionsKnown(node.Status.NodeInfo) {
			imageVolumes = "true"
		}
		if len(taints) == len(node.Spec.Taints) && node.Labels[annotations.CNIReadyLabel] == "true" &&
			(boot == "" || node.Annotations[annotations.CNIReadyBootAnnotation] == boot) &&
			labelled == (imageVolumes != nil) {
			return nil
		}
		meta := map[string]any{
			"resourceVersion": node.ResourceVersion,
			"labels":          map[string]any{annotations.CNIReadyLabel: "true", annotations.ImageVolumesLabel: imageVolumes},
		}
		if boot != "" {
			// This boot's readiness: a label left from before a reboot is told apart by it.
			meta["annotations"] = map[string]any{annotations.CNIReadyBootAnnotation: boot}
		}
		patch := map[string]any{"metadata": meta, "spec": map[string]any{"taints": taints}}
		if err := n.patch(ctx, patch); err != nil {
			return err
		}
		patched = true
		return nil
	})
	return patched, err
}

// unmarkReady removes the ready label when the node carries it (one GET; a patch only then).
// It never adds the startup taint back (docs/node-agent.md says why). It reports whether it
// patched.
func (n *nodeReadiness) unmarkReady(ctx context.Context) (bool, error) {
	node, err := n.client.CoreV1().Nodes().Get(ctx, n.name, metav1.GetOptions{})
	if err != nil {
		return false, fmt.Errorf("get node %s: %w (the agent's service account needs get and patch on nodes)", n.name, err)
	}
	if _, ok := node.Labels[annotations.CNIReadyLabel]; !ok {
		return false, nil
	}
	return true, n.unlabel(ctx)
}

// unlabel removes the ready label (uninstall). The taint is not put back: detour never adds it.
func (n *nodeReadiness) unlabel(ctx context.Context) error {
	return n.patch(ctx, map[string]any{
		"metadata": map[string]any{
			"labels":      map[string]any{annotations.CNIReadyLabel: nil},
			"annotations": map[string]any{annotations.CNIReadyBootAnnotation: nil},
		},
	})
}

// EventReason is the reason of the Warning Event the agent records on its node when it refuses
// to chain detour-cni into the primary configuration.
const EventReason = "DetourCNIRefused"

// event records a Warning Event on the node (namespace default, where node events live; `kubectl
// describe node` shows it). It reads the node for its UID, which describe matches on.
func (n *nodeReadiness) event(ctx context.Context, reason, msg string) error {
	node, err := n.client.CoreV1().Nodes().Get(ctx, n.name, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("get node %s: %w", n.name, err)
	}
	now := metav1.Now()
	ev := &corev1.Event{
		ObjectMeta:          metav1.ObjectMeta{Name: fmt.Sprintf("%s.%x", n.name, now.UnixNano()), Namespace: metav1.NamespaceDefault},
		InvolvedObject:      corev1.ObjectReference{Kind: "Node", APIVersion: "v1", Name: n.name, UID: node.UID},
		Reason:              reason,
		Message:             msg,
		Type:                corev1.EventTypeWarning,
		Source:              corev1.EventSource{Component: "detour-install-cni", Host: n.name},
		FirstTimestamp:      now,
		LastTimestamp:       now,
		Count:               1,
		ReportingController: "detour.dev/install-cni",
		ReportingInstance:   "detour-install-cni-" + n.name,
	}
	if _, err := n.client.CoreV1().Events(metav1.NamespaceDefault).Create(ctx, ev, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("record an event on node %s: %w (the agent's service account needs create on events)", n.name, err)
	}
	return nil
}

func (n *nodeReadiness) patch(ctx context.Context, patch map[string]any) error {
	b, err := json.Marshal(patch)
	if err != nil {
		return err
	}
	if _, err := n.client.CoreV1().Nodes().Patch(ctx, n.name, types.MergePatchType, b, metav1.PatchOptions{FieldManager: "detour-install-cni"}); err != nil {
		return fmt.Errorf("patch node %s: %w (the agent's service account needs get and patch on nodes)", n.name, err)
	}
	return nil
}

// runtime returns the node's status.nodeInfo.containerRuntimeVersion ("containerd://2.4.2").
func (n *nodeReadiness) runtime(ctx context.Context) (string, error) {
	node, err := n.client.CoreV1().Nodes().Get(ctx, n.name, metav1.GetOptions{})
	if err != nil {
		return "", fmt.Errorf("get node %s: %w", n.name, err)
	}
	return node.Status.NodeInfo.ContainerRuntimeVersion, nil
}
