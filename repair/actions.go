package repair

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/internal/podevent"
	"github.com/detourmesh/detour/validator"
)

// RecreateAnnotation is set on a bare pod (no controller) whose validator found no redirect;
// its value tells people to recreate the pod. The controller never deletes such a pod, and
// acts on it only once: the annotation marks it done.
const RecreateAnnotation = annotations.RecreateRequired

// EventReason is the reason of every Event the controller records, one per action.
const EventReason = "DetourCNIRepair"

// Component is the controller's name in Events and logs.
const Component = "detour-repair"

func (c *Controller) markDone(pod *corev1.Pod) {
	c.mu.Lock()
	c.done[pod.UID] = true
	c.mu.Unlock()
}

// settle handles the API's answer to action (delete, annotate) on pod: a pod deleted or replaced
// meanwhile is done with (skipped, gone); a failure is counted and returned, saying which verb
// the service account needs. It reports whether the action happened.
func (c *Controller) settle(pod *corev1.Pod, err error, action, verb string) (bool, error) {
	switch {
	case apierrors.IsNotFound(err) || apierrors.IsConflict(err):
		c.markDone(pod)
		c.metrics.PodsSkipped.WithLabelValues(SkipGone).Inc()
		return false, nil
	case err != nil:
		c.metrics.Errors.WithLabelValues(action).Inc()
		return false, fmt.Errorf("%s pod %s/%s: %w (the service account needs %s on pods)", action, pod.Namespace, pod.Name, err, verb)
	}
	c.markDone(pod)
	return true, nil
}

// delete deletes a controller-owned pod, only if it is still the pod that failed (UID
// precondition): a StatefulSet may already have replaced it under the same name.
func (c *Controller) delete(ctx context.Context, pod *corev1.Pod, owner *metav1.OwnerReference) error {
	uid := pod.UID
	err := c.client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid}})
	if done, err := c.settle(pod, err, ActionDelete, "delete"); !done {
		return err
	}
	c.deleted(pod, owner)
	c.saveBackoff(ctx)
	c.metrics.PodsDeleted.Inc()
	msg := fmt.Sprintf("%s exited with code %d on node %s: this pod's network namespace has no traffic redirect, because its sandbox was created before detour's CNI configuration was in place. ",
		validator.CheckContainer(pod), validator.ExitNoRedirect, c.cfg.NodeName)
	if ownerKind(owner) == jobKind {
		msg += fmt.Sprintf("The kubelet runs the check again in the same sandbox, where it cannot pass, so the pod would not end as a Job's pod should. Deleted the pod so that its Job %s replaces it with one that gets the redirect; the Job counts the deleted pod as one failure against its backoffLimit.", owner.Name)
	} else {
		msg += fmt.Sprintf("Deleted the pod so that its %s %s recreates it with the redirect.", owner.Kind, owner.Name)
	}
	c.log.Info("deleted pod so its controller recreates it", "pod", pod.Namespace+"/"+pod.Name, "uid", uid, "owner", owner.Kind+"/"+owner.Name)
	c.event(ctx, pod, "Delete", msg)
	return nil
}

// annotate marks a pod that detour does not delete, because nothing would recreate it the way
// it was (a bare pod, or an owner not in --recreating-owners).
func (c *Controller) annotate(ctx context.Context, pod *corev1.Pod) error {
	value := fmt.Sprintf("%s found no traffic redirect (exit code %d): this pod started on node %s before detour's CNI configuration was in place. ",
		validator.CheckContainer(pod), validator.ExitNoRedirect, c.cfg.NodeName)
	skip := SkipNoController
	switch ref := metav1.GetControllerOf(pod); {
	case ref == nil:
		value += "It has no controller, so detour does not delete it: delete it and create it again from its manifest."
	default:
		skip = SkipOwnerNotRecreating
		value += fmt.Sprintf("Its owner %s %s is not known to recreate deleted pods (repair's --recreating-owners), so detour does not delete it: recreate it through its owner (for example rerun the workflow or restart the VM).", ownerKind(ref), ref.Name)
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{
		"uid":         pod.UID, // precondition: the pod that failed, not a namesake
		"annotations": map[string]string{RecreateAnnotation: value},
	}})
	_, err := c.client.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, types.MergePatchType, patch, metav1.PatchOptions{FieldManager: Component})
	if done, err := c.settle(pod, err, ActionAnnotate, "patch"); !done {
		return err
	}
	c.metrics.PodsSkipped.WithLabelValues(skip).Inc()
	c.log.Info("annotated a pod detour does not delete; it must be recreated by hand", "pod", pod.Namespace+"/"+pod.Name, "uid", pod.UID, "reason", skip)
	c.event(ctx, pod, "Annotate", value+" (annotation "+RecreateAnnotation+")")
	return nil
}

// event records one Event for an action on pod. A failure is logged and counted, not retried:
// the action itself happened.
func (c *Controller) event(ctx context.Context, pod *corev1.Pod, action, msg string) {
	now := c.now()
	if err := c.record(ctx, pod, now, EventReason, action, msg, fmt.Sprintf("%x", now.UnixNano())); err != nil {
		c.log.Error("record event (the service account needs create on events)", "pod", pod.Namespace+"/"+pod.Name, "err", err)
	}
}

// record creates a Warning Event on pod at time at, named after the pod and suffix; a failure
// is counted.
func (c *Controller) record(ctx context.Context, pod *corev1.Pod, at time.Time, reason, action, msg, suffix string) error {
	src := podevent.Source{Component: Component, Controller: "detour.dev/repair", Node: c.cfg.NodeName}
	ev := podevent.Warning(src, pod, at, reason, action, msg, suffix)
	ev.InvolvedObject.FieldPath = "spec.initContainers{" + validator.CheckContainer(pod) + "}"
	_, err := c.client.CoreV1().Events(pod.Namespace).Create(ctx, ev, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		c.metrics.Errors.WithLabelValues(ActionEvent).Inc()
	}
	return err
}

// CheckPortEventReason is the reason of the Event recorded on a pod whose check found its own
// port taken (exit 43, [validator.ExitPortInUse]).
const CheckPortEventReason = "DetourCheckPortInUse"

// reportPortInUse records one Warning Event on a pod whose check found its port taken by a
// container of the pod (exit 43), and deletes nothing: a new pod would pass the check at the
// proxy's start only until its proxy restarts again (or, in the validator container, fail the
// same way), hiding a configuration error that people must fix. The Event's name is the pod's
// UID's, so a restarted controller finds it there instead of recording another (the pod is
// counted skipped again: counters start from zero with the process).
func (c *Controller) reportPortInUse(ctx context.Context, pod *corev1.Pod) error {
	c.mu.Lock()
	done := c.done[pod.UID]
	c.mu.Unlock()
	if done {
		return nil
	}
	container := validator.CheckContainer(pod)
	said := validator.FailureMessage(pod)
	if said == "" {
		said = fmt.Sprintf("its message is not in the container's termination message: kubectl -n %s logs %s -c %s --previous", pod.Namespace, pod.Name, container)
	}
	msg := fmt.Sprintf("%s exited with code %d on node %s: %s. ", container, validator.ExitPortInUse, c.cfg.NodeName, said)
	if container == annotations.ProxyContainer {
		port := pod.Annotations[annotations.ValidatorCheckPort]
		if port == "" {
			port = "validator.checkPort"
		}
		msg += fmt.Sprintf("Detour does not recreate the pod: a new one would pass the check only until its proxy restarts again. "+
			"Fix: move the port of the container that listens on the check port (%s), or have the cluster admin set the webhook's validator.checkPort to a port no container of the pod uses; then recreate the pod.", port)
	} else {
		msg += "Detour does not recreate the pod: the port is taken inside the pod, so a new one would fail the same way. " +
			"Fix: keep detour-validator the first init container and its --port the pod's detour.dev/proxy-outbound-port; then recreate the pod."
	}
	err := c.record(ctx, pod, c.now(), CheckPortEventReason, "Report", msg, "check-port-"+string(pod.UID))
	switch {
	case err == nil:
		c.log.Info("the pod's check found its port taken by a container of the pod; recorded an Event, deleting nothing", "pod", pod.Namespace+"/"+pod.Name, "uid", pod.UID, "container", container)
	case apierrors.IsAlreadyExists(err): // recorded before a restart of the controller
	default:
		return fmt.Errorf("record the event of pod %s/%s: %w (the service account needs create on events)", pod.Namespace, pod.Name, err)
	}
	c.markDone(pod)
	c.metrics.PodsSkipped.WithLabelValues(SkipCheckPortInUse).Inc()
	return nil
}
