package repair

import (
	"context"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/validator"
)

// Caught reports whether pod is an injected pod, not being deleted and not terminal, whose
// validator check's last run terminated with [validator.ExitNoRedirect] and has not passed
// since — in its current state, or in its last one while it waits to restart
// (Init:CrashLoopBackOff) or runs again — in the detour-validator init container or at the start
// of the detour-proxy container ([validator.LastFailure]). A check that finds no redirect spends
// its whole timeout running, so a run under way does not hide the last one's result (as
// `detour check --cluster` reads it): the pod stays caught through its retries. A Failed or
// Succeeded pod is not caught: its controller already replaced it, or it is done.
func Caught(pod *corev1.Pod) bool {
	caught, _ := caughtRunning(pod)
	return caught
}

// caughtRunning reports [Caught], and whether the check runs again now.
func caughtRunning(pod *corev1.Pod) (caught, running bool) {
	if pod.DeletionTimestamp != nil || !annotations.IsInjected(pod.Annotations) ||
		pod.Status.Phase == corev1.PodFailed || pod.Status.Phase == corev1.PodSucceeded {
		return false, false
	}
	code, running, failed := validator.LastFailure(pod)
	return failed && code == validator.ExitNoRedirect, running
}

// portTaken reports whether pod is an injected pod, not being deleted and not terminal, whose
// check's last run failed with [validator.ExitPortInUse] and has not passed since: a container
// of the pod holds the check's port. Repair reports it (an Event) and deletes nothing.
func portTaken(pod *corev1.Pod) bool {
	if pod.DeletionTimestamp != nil || !annotations.IsInjected(pod.Annotations) ||
		pod.Status.Phase == corev1.PodFailed || pod.Status.Phase == corev1.PodSucceeded {
		return false
	}
	code, _, failed := validator.LastFailure(pod)
	return failed && code == validator.ExitPortInUse
}

// NeedsRepair reports whether pod is [Caught] and its check is not running again: in a new
// sandbox a check that runs may pass, so the pod is not deleted before it can.
func NeedsRepair(pod *corev1.Pod) bool {
	caught, running := caughtRunning(pod)
	return caught && !running
}

// ownerKind is an owner reference as group/Kind.
func ownerKind(ref *metav1.OwnerReference) string {
	group, _, _ := strings.Cut(ref.APIVersion, "/")
	if !strings.Contains(ref.APIVersion, "/") {
		group = "" // the core group: "v1"
	}
	return group + "/" + ref.Kind
}

// jobKind is a Job's group/Kind.
const jobKind = "batch/Job"

// checkRunsAgain reports whether the kubelet runs pod's failed check again in the same sandbox,
// where it cannot pass: at the proxy's start (a restartable init container, which the kubelet
// restarts whatever the pod's restartPolicy, so that a restartPolicy Never pod never fails and
// its Job waits for ever), or in the validator init container of a pod whose restartPolicy is
// not Never (OnFailure: each restart counts against its Job's backoffLimit, and none can pass).
// A restartPolicy Never pod whose validator init container failed is Failed at once (the
// kubelet's pod phase) and its Job replaces it: nothing to repair.
func checkRunsAgain(pod *corev1.Pod) bool {
	return validator.CheckContainer(pod) == annotations.ProxyContainer || pod.Spec.RestartPolicy != corev1.RestartPolicyNever
}

// sync handles one pod; it returns a delay after which to look again, or an error to retry.
func (c *Controller) sync(ctx context.Context, key string) (time.Duration, error) {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return 0, nil
	}
	pod, err := c.pods.Pods(ns).Get(name)
	switch {
	case apierrors.IsNotFound(err):
		return 0, nil
	case err != nil:
		return 0, err
	case portTaken(pod):
		return 0, c.reportPortInUse(ctx, pod)
	case !NeedsRepair(pod):
		return 0, nil
	}
	c.mu.Lock()
	if c.done[pod.UID] {
		c.mu.Unlock()
		return 0, nil
	}
	if !c.seen[pod.UID] {
		c.seen[pod.UID] = true
		c.metrics.PodsSeen.Inc()
		c.log.Info("pod's validator found no redirect", "pod", key, "uid", pod.UID)
	}
	c.mu.Unlock()

	owner := metav1.GetControllerOf(pod)
	switch {
	case owner == nil || c.cfg.RecreatingOwners[ownerKind(owner)]:
	case ownerKind(owner) == jobKind:
		// A Job replaces a pod that fails, and counts a deleted one as failed. A pod whose
		// check runs again in its sandbox never fails (at the proxy's start) or only once
		// its restarts have used up the Job's backoffLimit: deleted, it is one failure, and
		// its replacement gets the redirect. A pod the kubelet fails by itself needs nothing.
		if !checkRunsAgain(pod) {
			c.markDone(pod)
			c.metrics.PodsSkipped.WithLabelValues(SkipJob).Inc()
			c.log.Info("a Job's pod fails by itself (restartPolicy Never); its Job replaces it", "pod", key, "job", owner.Name)
			return 0, nil
		}
	default:
		owner = nil // nothing recreates it when deleted: annotated like a bare pod
	}
	if owner == nil {
		if _, ok := pod.Annotations[RecreateAnnotation]; ok {
			c.markDone(pod)
			c.metrics.PodsSkipped.WithLabelValues(SkipAlreadyAnnotated).Inc()
			return 0, nil
		}
	}
	if c.cfg.RequireCNIReady {
		ready, err := c.nodeReady(ctx)
		if err != nil {
			c.metrics.Errors.WithLabelValues(ActionReadNode).Inc()
			return 0, err
		}
		if !ready {
			c.metrics.PodsDeferred.WithLabelValues(DeferNodeNotReady).Inc()
			return nodeCheckInterval, nil
		}
	}
	if owner != nil {
		if wait := c.ownerWait(pod, owner); wait > 0 {
			c.metrics.PodsDeferred.WithLabelValues(DeferOwnerBackoff).Inc()
			c.log.Info("a replacement pod failed again; backing off before deleting it", "pod", key, "owner", owner.Kind+"/"+owner.Name, "wait", wait.Round(time.Second))
			return wait, nil
		}
	}
	if !c.limiter.Allow() {
		c.metrics.PodsDeferred.WithLabelValues(DeferRateLimited).Inc()
		return time.Duration(float64(time.Second) / float64(c.cfg.Rate)), nil
	}
	if owner == nil {
		return 0, c.annotate(ctx, pod)
	}
	return 0, c.delete(ctx, pod, owner)
}

// nodeCheckInterval is how long a read of the node's ready label is trusted.
const nodeCheckInterval = 5 * time.Second

// nodeReady reports whether the node carries the ready label, reading it at most every
// nodeCheckInterval.
func (c *Controller) nodeReady(ctx context.Context) (bool, error) {
	c.mu.Lock()
	now := c.now()
	if now.Sub(c.checkedAt) < nodeCheckInterval {
		ready := c.readyAt.Equal(c.checkedAt)
		c.mu.Unlock()
		return ready, nil
	}
	c.mu.Unlock()
	node, err := c.client.CoreV1().Nodes().Get(ctx, c.cfg.NodeName, metav1.GetOptions{})
	if err != nil {
		return false, fmt.Errorf("read node %s: %w (the service account needs get on nodes)", c.cfg.NodeName, err)
	}
	// A label from before the node's last reboot is stale until the node agent, started again,
	// has put detour's entry back and marked this boot (the kubelet reports the new boot ID).
	boot := node.Status.NodeInfo.BootID
	ready := node.Labels[annotations.CNIReadyLabel] == "true" && (boot == "" || node.Annotations[annotations.CNIReadyBootAnnotation] == boot)
	c.mu.Lock()
	c.checkedAt = now
	if ready {
		c.readyAt = now
	}
	c.mu.Unlock()
	if !ready {
		c.log.Info("waiting for the node's CNI config before repairing pods", "node", c.cfg.NodeName, "label", annotations.CNIReadyLabel+"=true")
	}
	return ready, nil
}
