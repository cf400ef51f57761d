// Package podevent builds the Warning Events detour's node-side parts record on pods.
package podevent

import (
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// maxName is the longest name an Event may have.
const maxName = 253

// Source is the part of detour that records an Event and the node it runs on.
type Source struct {
	// Component is the Event's source component, e.g. detour-repair.
	Component string
	// Controller is the Event's reporting controller, e.g. detour.dev/repair.
	Controller string
	// Node is the node's name.
	Node string
}

// Warning returns a Warning Event of src on pod at time at, named after the pod and suffix: the
// pod's name, cut so that the whole name fits (and ends in a letter or digit), a dot, then suffix. A suffix that identifies what
// happened (a sandbox, a pod's UID) makes a second create of the same Event fail with
// AlreadyExists instead of recording it twice.
func Warning(src Source, pod *corev1.Pod, at time.Time, reason, action, msg, suffix string) *corev1.Event {
	// A name cut short must still end in a letter or digit, as an Event's name must.
	prefix := strings.TrimRight(pod.Name[:min(len(pod.Name), max(0, maxName-1-len(suffix)))], "-.")
	t := metav1.NewTime(at)
	return &corev1.Event{
		ObjectMeta: metav1.ObjectMeta{Name: prefix + "." + suffix, Namespace: pod.Namespace},
		InvolvedObject: corev1.ObjectReference{
			Kind: "Pod", APIVersion: "v1", Namespace: pod.Namespace, Name: pod.Name, UID: pod.UID,
		},
		Reason:              reason,
		Message:             msg,
		Type:                corev1.EventTypeWarning,
		Source:              corev1.EventSource{Component: src.Component, Host: src.Node},
		FirstTimestamp:      t,
		LastTimestamp:       t,
		Count:               1,
		Action:              action,
		ReportingController: src.Controller,
		ReportingInstance:   src.Component + "-" + src.Node,
	}
}
