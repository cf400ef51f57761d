package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/detourmesh/detour/annotations"
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
// before — a Forbidden answer (the uninstall that deletes the DaemonSet deletes the RBAC right
// after it) or an Unauthorized one that [Agent.ownTokenRefused] confirms. A DaemonSet of the
// same name but another UID replaced it: the new one's agent takes over, nothing is removed.
// Any other error keeps everything in place (the safe side: a rollout must not open a window
// without the plugin).
func (a *Agent) ownerGone(ctx context.Context) (bool, string) {
	o := a.owner
	if o == nil || o.uid == "" {
		return false, ""
	}
	ds, err := a.client.AppsV1().DaemonSets(o.namespace).Get(ctx, o.name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return true, fmt.Sprintf("DaemonSet %s/%s is deleted", o.namespace, o.name)
	case apierrors.IsForbidden(err) && o.readable:
		return true, fmt.Sprintf("the agent may no longer read DaemonSet %s/%s (%v): its RBAC is being deleted with it", o.namespace, o.name, err)
	case apierrors.IsUnauthorized(err) && o.readable:
		return a.ownTokenRefused(ctx, err)
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

// ownTokenRefused tells what the API server's refusal of the agent's own token means. The
// uninstall that deletes the DaemonSet deletes the agent's service account, and the plugin's,
// right after it. But the agent's token is also bound to its pod: the API server refuses it
// once the pod object is gone, or a minute after the pod's grace period ended — which a SIGTERM
// delayed by a slow or restarting kubelet can come after, when the pod alone was deleted. The
// plugin's token, bound to no object, tells the two apart: still accepted, the release's
// service accounts exist and nothing is uninstalled. Without one to ask with (the plugin shares
// the agent's token, or its own has expired), the refusal counts as the uninstall; when the API
// server cannot be asked, everything stays, as for any answer that is not a clear one. (The API
// server remembers a token it accepted for 10 s: a plugin token used in the 10 s before an
// uninstall still reads as accepted. The plugin uses it only for pods whose annotations the
// runtime does not pass, never on containerd 2.x.)
func (a *Agent) ownTokenRefused(ctx context.Context, refused error) (bool, string) {
	gone := fmt.Sprintf("the API server no longer accepts the agent's token (%v): its service account is being deleted with the DaemonSet", refused)
	token, ok := a.ownPluginToken()
	if !ok {
		a.log.Warn("the API server refuses the agent's token, and there is no token of the plugin's own to tell why with; taking it as detour's uninstall")
		return true, gone
	}
	accepted, err := a.tokenAccepted(ctx, token)
	switch {
	case err != nil:
		a.log.Warn("the API server refuses the agent's token, and asking it about the plugin's failed; leaving detour in place", "err", err)
		return false, ""
	case accepted:
		a.log.Info("the API server refuses the agent's token but accepts the plugin's: the agent's pod is gone, not detour's service accounts; leaving detour in place", "err", refused)
		return false, ""
	}
	return true, gone + "; the plugin's is refused too"
}

// ownPluginToken is the plugin's own token, while the agent holds one that has not expired.
func (a *Agent) ownPluginToken() (string, bool) {
	t := a.tokens
	if t == nil || a.tokenClient == nil || t.token == nil || !a.now().Before(t.expires) {
		return "", false
	}
	return string(t.token), true
}

// tokenAccepted asks the API server who token belongs to (a SelfSubjectReview): false when it
// answers 401 Unauthorized, true for any other answer of its own — it authenticated the token
// before it could refuse the request (403) or not know the API (404, before Kubernetes 1.28).
// An error means no answer came.
func (a *Agent) tokenAccepted(ctx context.Context, token string) (bool, error) {
	client, err := a.tokenClient(token)
	if err != nil {
		return false, fmt.Errorf("build an API client with the plugin's token: %w", err)
	}
	_, err = client.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if _, answered := errors.AsType[*apierrors.StatusError](err); err == nil || answered {
		return !apierrors.IsUnauthorized(err), nil
	}
	return false, fmt.Errorf("ask the API server about the plugin's token for %s: %w", a.tokens.account(), err)
}

// stopping runs when Run's context ends (SIGTERM): it uninstalls detour from the node when the
// agent's DaemonSet is going away, and leaves everything in place otherwise.
func (a *Agent) stopping() {
	ctx, cancel := context.WithTimeout(context.Background(), ownerCheckTimeout)
	defer cancel()
	// A SIGTERM right after the start (helm uninstall during a rollout) can come before the
	// first look at the agent's own pod finished.
	a.resolveOwner(ctx)
	if a.owner == nil || a.owner.uid == "" {
		a.log.Info("stopping; detour's CNI configuration stays in place")
		return
	}
	a.log.Info("SIGTERM: reading the agent's DaemonSet to tell a rollout from an uninstall", "daemonset", a.owner.namespace+"/"+a.owner.name)
	gone, why := a.ownerGone(ctx)
	if !gone {
		a.log.Info("stopping; the DaemonSet stays, so detour's CNI configuration stays in place")
		return
	}
	a.log.Info("stopping and uninstalling detour from this node: "+why, "node", a.cfg.NodeName)
	switch err := a.Uninstall(ctx); {
	case err != nil && onlyLabelFailed(err):
		// The uninstall deleted the agent's RBAC or service account too.
		a.log.Warn("detour is uninstalled from this node, but the node keeps its ready label: the agent may no longer patch the node",
			"err", err, "fix", fmt.Sprintf("kubectl label node %s %s-; kubectl annotate node %s %s-", a.cfg.NodeName, annotations.CNIReadyLabel, a.cfg.NodeName, annotations.CNIReadyBootAnnotation))
		return
	case err != nil:
		a.log.Error("uninstall at SIGTERM failed; run detour install-cni --uninstall on the node", "err", err)
		return
	}
	a.log.Info("detour is uninstalled from this node")
}
