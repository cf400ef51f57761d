package validator

import (
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/annotations"
)

// CheckContainer names the container whose exit code is the check's in an injected pod: the
// detour-validator init container, or detour-proxy where the check runs at the proxy's start
// (detour.dev/validator: image-volume). Both are init containers.
func CheckContainer(pod *corev1.Pod) string {
	if annotations.ValidatorModeValue(pod.Annotations[annotations.Validator]) == annotations.ValidatorImageVolume {
		return annotations.ProxyContainer
	}
	return annotations.ValidatorContainer
}

// StartedMarker begins the line `detour validate` prints when it execs the command after a check
// that passed: a termination whose log holds it is the proxy's, not the check's.
const StartedMarker = "detour validate: starting "

// LastFailure returns the exit code of the check's last run in pod when that run failed — the
// container's current termination, or its last one while it waits to restart or runs again —
// and whether the container runs again now. At the proxy's start a termination is the check's
// only when its message (the log's end, as the injected containers' terminationMessagePolicy
// FallbackToLogsOnError makes it) is detour's and the proxy was never started: the proxy's own
// exit, or the pod's end (a Job's sidecar stopped), is not a failure of the check. A proxy that
// has started (its status says Started: its startup probe passed, which only the proxy the
// check execs after passing can make happen) has passed its check, whatever its last
// termination says: a check that failed once and then passed in a new sandbox is no failure.
// Where detour's postStart hook is the proxy's start gate (no startup probe), Started proves
// nothing — the kubelet reports a container without a startup probe started as soon as it
// runs — and the pod's next container started since the proxy's run began proves it instead
// ([proxyPassed]).
func LastFailure(pod *corev1.Pod) (code int32, running, failed bool) {
	t, running := lastFailure(pod)
	if t == nil {
		return 0, running, false
	}
	return t.ExitCode, running, true
}

// lastFailure is [LastFailure]'s termination (nil when the last run did not fail), and whether
// the check runs again now.
func lastFailure(pod *corev1.Pod) (*corev1.ContainerStateTerminated, bool) {
	name := CheckContainer(pod)
	for i, s := range pod.Status.InitContainerStatuses {
		if s.Name != name {
			continue
		}
		if name == annotations.ProxyContainer && proxyPassed(pod, i) {
			return nil, s.State.Running != nil
		}
		t := s.State.Terminated
		if t == nil {
			t = s.LastTerminationState.Terminated
		}
		if !CheckFailed(name, t) {
			return nil, s.State.Running != nil
		}
		return t, s.State.Running != nil
	}
	return nil, false
}

// FailureMessage returns the message of the check's last failed run in pod ([LastFailure]) as
// `detour validate` printed it, without its "detour: " prefix: the last such line of the
// container's termination message (the log's end, as FallbackToLogsOnError makes it). It is ""
// when the run did not fail or its message does not hold the line (cut off, or another
// terminationMessagePolicy with nothing written to the termination log).
func FailureMessage(pod *corev1.Pod) string {
	t, _ := lastFailure(pod)
	if t == nil {
		return ""
	}
	lines := strings.Split(strings.TrimRight(t.Message, "\n"), "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if msg, ok := strings.CutPrefix(strings.TrimSpace(lines[i]), failurePrefix); ok {
			return msg
		}
	}
	return ""
}

// failurePrefix begins the line `detour` prints to standard error when a command fails (the
// check's one-line message).
const failurePrefix = "detour: "

// CheckFailed reports whether t, a termination of container (the one [CheckContainer] names),
// is a failed run of the check: any failure of the validator container; at the proxy's start,
// one whose message is detour's and whose proxy never started.
func CheckFailed(container string, t *corev1.ContainerStateTerminated) bool {
	if t == nil || t.ExitCode == 0 {
		return false
	}
	return container != annotations.ProxyContainer || !strings.Contains(t.Message, StartedMarker) && strings.Contains(t.Message, failurePrefix)
}

// ProxyPassed reports whether the check at the start of pod's proxy passed in the proxy's
// current run ([proxyPassed]); false where the check runs in the validator init container.
func ProxyPassed(pod *corev1.Pod) bool {
	if CheckContainer(pod) != annotations.ProxyContainer {
		return false
	}
	i := slices.IndexFunc(pod.Status.InitContainerStatuses, func(s corev1.ContainerStatus) bool { return s.Name == annotations.ProxyContainer })
	return i >= 0 && proxyPassed(pod, i)
}

// proxyPassed reports whether the proxy, the init container whose status is the i-th, has passed
// the check of its current run. Its status must say Started; with a startup probe (or a proxy
// the pod's spec does not show) that is proof enough: only the proxy the check execs answers
// the probe. Without one — detour's postStart hook alone is the start gate, as development builds
// before the probe stayed beside it injected — the kubelet starts the pod's next container only
// once the hook passed, so the proof is a container after the proxy that started (API times
// have whole seconds: at the same second or later) since the proxy's current run began.
func proxyPassed(pod *corev1.Pod, i int) bool {
	s := pod.Status.InitContainerStatuses[i]
	if s.Started == nil || !*s.Started {
		return false
	}
	j := slices.IndexFunc(pod.Spec.InitContainers, func(c corev1.Container) bool { return c.Name == s.Name })
	if j < 0 || pod.Spec.InitContainers[j].StartupProbe != nil {
		return true
	}
	if s.State.Running == nil {
		return false
	}
	since := s.State.Running.StartedAt
	later := slices.Concat(pod.Status.InitContainerStatuses[i+1:], pod.Status.ContainerStatuses)
	return slices.ContainsFunc(later, func(c corev1.ContainerStatus) bool {
		var at metav1.Time
		switch {
		case c.State.Running != nil:
			at = c.State.Running.StartedAt
		case c.State.Terminated != nil:
			at = c.State.Terminated.StartedAt
		}
		return !at.IsZero() && !at.Before(&since)
	})
}
