package validator

import (
	"strings"

	corev1 "k8s.io/api/core/v1"

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
func LastFailure(pod *corev1.Pod) (code int32, running, failed bool) {
	name := CheckContainer(pod)
	for _, s := range pod.Status.InitContainerStatuses {
		if s.Name != name {
			continue
		}
		if name == annotations.ProxyContainer && s.Started != nil && *s.Started {
			return 0, s.State.Running != nil, false
		}
		t := s.State.Terminated
		if t == nil {
			t = s.LastTerminationState.Terminated
		}
		if !CheckFailed(name, t) {
			return 0, s.State.Running != nil, false
		}
		return t.ExitCode, s.State.Running != nil, true
	}
	return 0, false, false
}

// CheckFailed reports whether t, a termination of container (the one [CheckContainer] names),
// is a failed run of the check: any failure of the validator container; at the proxy's start,
// one whose message is detour's and whose proxy never started.
func CheckFailed(container string, t *corev1.ContainerStateTerminated) bool {
	if t == nil || t.ExitCode == 0 {
		return false
	}
	return container != annotations.ProxyContainer || !strings.Contains(t.Message, StartedMarker) && strings.Contains(t.Message, "detour: ")
}
