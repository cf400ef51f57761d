package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"

	"github.com/detourmesh/detour/annotations"
)

// A node whose Node object is deleted is leaving the cluster (a node pool scaling in, an admin's
// `kubectl delete node`): the API server will schedule no pod there, the pod garbage collector
// deletes the ones it still runs, and the plugin's token and kubeconfig name a cluster the
// machine no longer belongs to. The agent then takes detour off the node's disk, as an
// uninstall does, and holds until the node registers again (a kubelet restarted on the same
// machine), when it installs detour again like a new node. Pods still running keep the rules
// they were given; only a sandbox created in between goes without, and its validator catches it.

// nodeEvent is a change of the agent's Node object: whether it exists, and whether it changed in
// something the agent's marks on it depend on (see markDependsOn).
type nodeEvent struct{ exists, changed bool }

// watchNode follows the agent's own Node object (a watch on that one name) and sends an event
// when it is created (also the first list's), deleted, or updated in something the agent's marks
// depend on: its kubelet or runtime upgraded or downgraded in place, the object replaced by a new
// one of the same name (a deletion the watch saw as an update, when it re-listed), or the marks
// taken off by someone. Only the latest event waits in the channel, merged with the one it
// replaces, so a pending change is never lost.
func (a *Agent) watchNode(ctx context.Context) <-chan nodeEvent {
	ch := make(chan nodeEvent, 1)
	factory := informers.NewSharedInformerFactoryWithOptions(a.client, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("metadata.name", a.node.name).String()
	}))
	send := func(ev nodeEvent) {
		// The informer calls its handlers one at a time: nothing else sends in between.
		select {
		case old := <-ch:
			ev.changed = ev.changed || old.changed
		default:
		}
		ch <- ev
	}
	inf := factory.Core().V1().Nodes().Informer()
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: func(any) { send(nodeEvent{exists: true, changed: true}) },
		UpdateFunc: func(old, cur any) {
			if o, ok := old.(*corev1.Node); ok {
				if n, ok := cur.(*corev1.Node); ok && markDependsOn(o) != markDependsOn(n) {
					send(nodeEvent{exists: true, changed: true})
				}
			}
		},
		DeleteFunc: func(any) { send(nodeEvent{exists: false}) },
	}); err != nil {
		a.log.Warn("cannot follow the node's Node object; detour stays on the node if it is deleted", "node", a.node.name, "err", err)
		return nil
	}
	factory.Start(ctx.Done())
	return ch
}

// markDependsOn is what of a Node the agent's marks on it depend on (markReady): the object's
// identity, the kubelet's and runtime's versions (the image-volume label), the boot, and the
// marks themselves.
func markDependsOn(n *corev1.Node) string {
	_, imageVolumes := n.Labels[annotations.ImageVolumesLabel]
	return strings.Join([]string{string(n.UID), n.Status.NodeInfo.KubeletVersion, n.Status.NodeInfo.ContainerRuntimeVersion,
		n.Status.NodeInfo.BootID, n.Labels[annotations.CNIReadyLabel], strconv.FormatBool(imageVolumes),
		n.Annotations[annotations.CNIReadyBootAnnotation]}, "\x00")
}

// followNode acts on the Node object's change: deleted (confirmed by a read: a watch's last word
// can be stale; a read that fails is tried again at the next reconcile), it removes detour from
// the node's disk; created again, it lets the reconcile install it; changed in what the marks
// depend on, it lets the reconcile mark it again. It reports whether the reconcile should run
// now.
func (a *Agent) followNode(ctx context.Context, ev nodeEvent) bool {
	a.nodeUnconfirmed = false
	if ev.exists {
		if ev.changed {
			a.nodeChanged = true
		}
		if !a.nodeGone {
			return ev.changed
		}
		a.nodeGone = false
		a.log.Info("the node registered again: installing detour on it", "node", a.node.name)
		return true
	}
	_, err := a.client.CoreV1().Nodes().Get(ctx, a.node.name, metav1.GetOptions{})
	if !apierrors.IsNotFound(err) {
		if err != nil {
			a.nodeUnconfirmed = true
			a.log.Warn("the node's Node object looks deleted but cannot be read; leaving detour in place and reading it again at the next reconcile", "node", a.node.name, "err", err)
		}
		return false
	}
	a.nodeGone = true
	a.log.Info("the node's Node object is deleted: the node is leaving the cluster; removing detour from it", "node", a.node.name)
	a.removeFromDeletedNode()
	return false
}

// removeFromDeletedNode removes detour from the disk of a node whose Node object is deleted, once;
// a failure is retried at the next event or resync.
func (a *Agent) removeFromDeletedNode() {
	if a.Status().Uninstalled {
		return
	}
	if err := errors.Join(a.removeFiles()...); err != nil {
		a.setStatus(Status{Reason: fmt.Sprintf("the node's Node object is deleted; removing detour from the node failed: %v", err)})
		a.log.Error("removing detour from a deleted node failed; retrying", "node", a.node.name, "err", err)
		return
	}
	a.setStatus(Status{Uninstalled: true, Reason: "the node's Node object is deleted: detour is removed from the node until it registers again"})
	a.log.Info("detour is removed from the node; it is installed again if the node registers again", "node", a.node.name)
}
