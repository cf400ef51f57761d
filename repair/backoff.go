package repair

import (
	"context"
	"encoding/json"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"

	"github.com/detourmesh/detour/annotations"
)

// Owner backoff. A pod that replaces one the controller deleted, and fails the same way, means
// that recreating does not help on this node (a broken node, a sentinel address the network
// routes): the owner's next deletion then waits ownerBackoffBase, doubling with each such round
// up to ownerBackoffMax, so the controller never turns kubelet's CrashLoopBackOff into a
// delete-recreate loop. Pods that failed together (a fresh node's first pods) are not
// replacements and are repaired at once. An owner without a deletion for ownerBackoffReset
// starts again.
const (
	ownerBackoffBase  = 30 * time.Second
	ownerBackoffMax   = 10 * time.Minute
	ownerBackoffReset = 30 * time.Minute
)

// ownerState is the backoff of one owner. known are the owner's pods on this node when the
// round began (its first deletion); any other pod came later, so it is a replacement. Pods are
// told apart by UID, which no clock can confuse.
type ownerState struct {
	known   map[types.UID]bool
	deleted time.Time // the last deletion, on this node's clock
	delay   time.Duration
}

// ownerWait is how long the deletion of pod must wait for its owner's backoff.
func (c *Controller) ownerWait(pod *corev1.Pod, owner *metav1.OwnerReference) time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.owners[owner.UID]
	if s == nil || s.known[pod.UID] || c.now().Sub(s.deleted) > ownerBackoffReset {
		return 0
	}
	return s.deleted.Add(s.delay).Sub(c.now())
}

// deleted records a deletion of one of owner's pods for the backoff.
func (c *Controller) deleted(pod *corev1.Pod, owner *metav1.OwnerReference) {
	now := c.now()
	var known map[types.UID]bool
	c.mu.Lock()
	s := c.owners[owner.UID]
	fresh := s == nil || now.Sub(s.deleted) > ownerBackoffReset
	c.mu.Unlock()
	if fresh {
		known = c.ownerPods(pod.Namespace, owner.UID)
		known[pod.UID] = true
	}

	c.mu.Lock()
	defer c.mu.Unlock()
	for uid, st := range c.owners {
		if now.Sub(st.deleted) > ownerBackoffReset {
			delete(c.owners, uid)
		}
	}
	switch {
	case fresh:
		s = &ownerState{known: known, delay: ownerBackoffBase}
		c.owners[owner.UID] = s
	case !s.known[pod.UID]:
		s.delay = min(2*s.delay, ownerBackoffMax)
	}
	s.deleted = now
}

// ownerPods are the UIDs of the pods of namespace ns that owner controls, in the cache.
func (c *Controller) ownerPods(ns string, owner types.UID) map[types.UID]bool {
	uids := map[types.UID]bool{}
	pods, _ := c.pods.Pods(ns).List(labels.Everything()) // the lister never fails
	for _, p := range pods {
		if ref := metav1.GetControllerOf(p); ref != nil && ref.UID == owner {
			uids[p.UID] = true
		}
	}
	return uids
}

// BackoffAnnotation on the node holds the owner backoff (below), so that it survives the
// controller's restart: a restarted controller that forgot it would delete a failing
// replacement at once, and a crash-looping controller would delete in a loop.
const BackoffAnnotation = annotations.Prefix + "repair-backoff"

// savedOwner is one owner's backoff as the node annotation holds it.
type savedOwner struct {
	Deleted time.Time   `json:"deleted"`
	Delay   string      `json:"delay"`
	Known   []types.UID `json:"known"`
}

// loadBackoff reads the owner backoff a previous run saved on the node. A failure is logged:
// the controller then starts without it, as before there was one.
func (c *Controller) loadBackoff(ctx context.Context) {
	node, err := c.client.CoreV1().Nodes().Get(ctx, c.cfg.NodeName, metav1.GetOptions{})
	if err != nil {
		c.log.Warn("could not read the saved owner backoff; starting without it", "node", c.cfg.NodeName, "err", err)
		return
	}
	raw, ok := node.Annotations[BackoffAnnotation]
	if !ok {
		return
	}
	var saved map[types.UID]savedOwner
	if err := json.Unmarshal([]byte(raw), &saved); err != nil {
		c.log.Warn("the saved owner backoff is not valid; starting without it", "annotation", BackoffAnnotation, "err", err)
		return
	}
	now := c.now()
	c.mu.Lock()
	defer c.mu.Unlock()
	for uid, o := range saved {
		delay, err := time.ParseDuration(o.Delay)
		if err != nil || now.Sub(o.Deleted) > ownerBackoffReset {
			continue
		}
		known := map[types.UID]bool{}
		for _, k := range o.Known {
			known[k] = true
		}
		c.owners[uid] = &ownerState{known: known, deleted: o.Deleted, delay: min(delay, ownerBackoffMax)}
	}
	if len(c.owners) > 0 {
		c.log.Info("restored the owner backoff saved on the node", "owners", len(c.owners))
	}
}

// saveBackoff writes the owner backoff into the node annotation (a merge patch of that one
// key). A failure is logged and counted: the backoff still holds in memory.
func (c *Controller) saveBackoff(ctx context.Context) {
	c.mu.Lock()
	saved := make(map[types.UID]savedOwner, len(c.owners))
	for uid, s := range c.owners {
		o := savedOwner{Deleted: s.deleted, Delay: s.delay.String()}
		for k := range s.known {
			o.Known = append(o.Known, k)
		}
		slices.Sort(o.Known)
		saved[uid] = o
	}
	c.mu.Unlock()
	var value any // null removes the annotation
	if len(saved) > 0 {
		b, _ := json.Marshal(saved)
		value = string(b)
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]any{BackoffAnnotation: value}}})
	if _, err := c.client.CoreV1().Nodes().Patch(ctx, c.cfg.NodeName, types.MergePatchType, patch, metav1.PatchOptions{FieldManager: Component}); err != nil {
		c.metrics.Errors.WithLabelValues(ActionSaveBackoff).Inc()
		c.log.Error("save the owner backoff on the node (the service account needs patch on nodes)", "node", c.cfg.NodeName, "err", err)
	}
}
