package nodeagent

import (
	"context"
	"fmt"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// ownerCheckTimeout bounds the look at the agent's DaemonSet at SIGTERM, and the uninstall that
// may follow, within the pod's termination grace period (10s in the chart).
const ownerCheckTimeout = 7 * time.Second

// ownDaemonSet is the DaemonSet that runs the agent, found through the agent's own pod, so that
// at SIGTERM the agent can tell a rollout or a drain (the DaemonSet stays: leave everything in
// place) from the DaemonSet's deletion (helm uninstall, kubectl delete: remove detour from the
// node, or its entry would outlive the plugin's service account and the agent that keeps it).
type ownDaemonSet struct {
	namespace, pod string
	name           string
	uid            types.UID
	// readable: the agent could read its DaemonSet once, so a Forbidden answer at SIGTERM means
	// its RBAC was removed since — by the same uninstall that deletes the DaemonSet.
	readable bool
}

// resolveOwner finds the DaemonSet that controls the agent's pod and checks that the agent may read
// it. It is retried at every resync until it succeeds.
func (a *Agent) resolveOwner(ctx context.Context) {
	o := a.owner
	if o == nil || o.uid != "" || a.client == nil {
		return
	}
	pod, err := a.client.CoreV1().Pods(o.namespace).Get(ctx, o.pod, metav1.GetOptions{})
	if err != nil {
		a.log.Warn("cannot read the agent's own pod yet; uninstall on the DaemonSet's deletion waits for it", "pod", o.namespace+"/"+o.pod, "err", err)
		return
	}
	ref := metav1.GetControllerOf(pod)
	if ref == nil || ref.Kind != "DaemonSet" {
		a.log.Warn("the agent's pod is not run by a DaemonSet; it will not uninstall detour at SIGTERM", "pod", o.namespace+"/"+o.pod)
		a.owner = nil
		return
	}
	o.name, o.uid = ref.Name, ref.UID
	_, err = a.client.AppsV1().DaemonSets(o.namespace).Get(ctx, o.name, metav1.GetOptions{})
	o.readable = err == nil
	if err != nil {
		a.log.Warn("cannot read the agent's DaemonSet; at SIGTERM only its absence makes the agent uninstall (the agent's service account needs get on daemonsets)", "daemonset", o.namespace+"/"+o.name, "err", err)
	}
}

// ownerGone reports whether the agent's DaemonSet is being deleted or is gone, and why: not
// found, or marked for deletion (foreground deletion), or — when the agent could read it
// before — a Forbidden or Unauthorized answer: the uninstall that deletes the DaemonSet deletes
// the RBAC and the service account right after it. A DaemonSet of the same name but another UID
// replaced it: the new one's agent takes over, nothing is removed. Any other error keeps
// everything in place (the safe side: a rollout must not open a window without the plugin).
func (a *Agent) ownerGone(ctx context.Context) (bool, string) {
	o := a.owner
	if o == nil || o.uid == "" {
		return false, ""
	}
	ds, err := a.client.AppsV1().DaemonSets(o.namespace).Get(ctx, o.name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return true, fmt.Sprintf("DaemonSet %s/%s is deleted", o.namespace, o.name)
	case (apierrors.IsForbidden(err) || apierrors.IsUnauthorized(err)) && o.readable:
		return true, fmt.Sprintf("the agent may no longer read DaemonSet %s/%s (%v): its RBAC or service account is being deleted with it", o.namespace, o.name, err)
	case err != nil:
		a.log.Warn("cannot tell whether the agent's DaemonSet is being deleted; leaving detour in place", "daemonset", o.namespace+"/"+o.name, "err", err)
		return false, ""
	case ds.UID != o.uid:
		return false, ""
	case ds.DeletionTimestamp != nil:
		return true, fmt.Sprintf("DaemonSet %s/%s is being deleted", o.namespace, o.name)
	}
	return false, ""
}

// stopping runs when Run's context ends (SIGTERM): it uninstalls detour from the node when the
// agent's DaemonSet is going away, and leaves everything in place otherwise.
func (a *Agent) stopping() {
	if a.owner == nil || a.owner.uid == "" {
		a.log.Info("stopping; detour's CNI configuration stays in place")
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), ownerCheckTimeout)
	defer cancel()
	gone, why := a.ownerGone(ctx)
	if !gone {
		a.log.Info("stopping; the DaemonSet stays, so detour's CNI configuration stays in place")
		return
	}
	a.log.Info("stopping and uninstalling detour from this node: "+why, "node", a.cfg.NodeName)
	if err := a.Uninstall(ctx); err != nil {
		a.log.Error("uninstall at SIGTERM failed; run detour install-cni --uninstall on the node", "err", err)
		return
	}
	a.log.Info("detour is uninstalled from this node")
}
