package validator_test

import (
	"testing"

	corev1 "k8s.io/api/core/v1"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/validator"
)

// noRedirectLog is the end of the log of a check at the proxy's start that found no redirect.
const noRedirectLog = "detour: no redirect in this pod's network namespace: expected connections to 203.0.113.254:80 to be redirected to port 4140 of this pod\n"

func exited(code int32, message string) corev1.ContainerState {
	return corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: code, Reason: "Error", Message: message}}
}

var (
	running     = corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}
	crashLoop   = corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff"}}
	started     = true
	notStarted  = false
	imageVolume = map[string]string{annotations.Validator: string(annotations.ValidatorImageVolume)}
)

// LastFailure reads a pod's status as `detour check --cluster` and repair need it: the check's
// last run failed and has not passed since. Issue 32.4: a proxy that started passed its check,
// whatever its last termination says (a check that failed before a reboot, then passed in the
// new sandbox).
func TestLastFailure(t *testing.T) {
	for _, tc := range []struct {
		name        string
		annotations map[string]string
		status      corev1.ContainerStatus
		code        int32
		running     bool
		failed      bool
	}{
		{"validator: waiting after 42", nil,
			corev1.ContainerStatus{Name: annotations.ValidatorContainer, State: crashLoop, LastTerminationState: exited(42, "")}, 42, false, true},
		{"validator: running again after 42", nil,
			corev1.ContainerStatus{Name: annotations.ValidatorContainer, State: running, Started: &started, LastTerminationState: exited(42, "")}, 42, true, true},
		{"validator: passed after 42", nil,
			corev1.ContainerStatus{Name: annotations.ValidatorContainer, State: exited(0, ""), LastTerminationState: exited(42, "")}, 0, false, false},
		{"proxy: waiting after the check's 42", imageVolume,
			corev1.ContainerStatus{Name: annotations.ProxyContainer, State: crashLoop, Started: &notStarted, LastTerminationState: exited(42, noRedirectLog)}, 42, false, true},
		{"proxy: the check runs again after 42", imageVolume,
			corev1.ContainerStatus{Name: annotations.ProxyContainer, State: running, Started: &notStarted, LastTerminationState: exited(42, noRedirectLog)}, 42, true, true},
		{"proxy: started after the check's 42", imageVolume,
			corev1.ContainerStatus{Name: annotations.ProxyContainer, State: running, Started: &started, LastTerminationState: exited(42, noRedirectLog)}, 0, true, false},
		{"proxy: started, no earlier termination", imageVolume,
			corev1.ContainerStatus{Name: annotations.ProxyContainer, State: running, Started: &started}, 0, true, false},
		{"proxy: its own exit after it started", imageVolume,
			corev1.ContainerStatus{Name: annotations.ProxyContainer, State: crashLoop, LastTerminationState: exited(1, "redirect in place\n"+validator.StartedMarker+"/proxy\nfatal\n")}, 0, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pod := &corev1.Pod{}
			pod.Annotations = tc.annotations
			pod.Status.InitContainerStatuses = []corev1.ContainerStatus{tc.status}
			code, running, failed := validator.LastFailure(pod)
			if code != tc.code || running != tc.running || failed != tc.failed {
				t.Errorf("LastFailure = %d, running %v, failed %v; want %d, %v, %v", code, running, failed, tc.code, tc.running, tc.failed)
			}
		})
	}
}
