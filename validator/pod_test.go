package validator_test

import (
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

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
			if tc.annotations != nil {
				// The proxy gated by its startup probe, as the webhook injects it with
				// proxy.startGate probe.
				pod.Spec.InitContainers = []corev1.Container{{Name: annotations.ProxyContainer, StartupProbe: &corev1.Probe{}}}
			}
			code, running, failed := validator.LastFailure(pod)
			if code != tc.code || running != tc.running || failed != tc.failed {
				t.Errorf("LastFailure = %d, running %v, failed %v; want %d, %v, %v", code, running, failed, tc.code, tc.running, tc.failed)
			}
		})
	}
}

// With detour's postStart hook as the proxy's start gate (issue 36) the proxy has no startup
// probe, so the kubelet reports it Started as soon as it runs, while its check may still be
// failing: Started proves nothing then. The check passed once the pod's next container started
// since the proxy's run began (the kubelet starts it only once the hook passed).
func TestLastFailureWithTheHookGate(t *testing.T) {
	at := func(sec int) metav1.Time { return metav1.NewTime(time.Date(2026, 12, 5, 14, 0, sec, 0, time.UTC)) }
	runningSince := func(sec int) corev1.ContainerState {
		return corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: at(sec)}}
	}
	doneAt := func(sec int) corev1.ContainerState {
		return corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{StartedAt: at(sec), FinishedAt: at(sec)}}
	}
	hookPod := func(proxy corev1.ContainerStatus, next ...corev1.ContainerStatus) *corev1.Pod {
		pod := &corev1.Pod{}
		pod.Annotations = imageVolume
		pod.Spec.InitContainers = []corev1.Container{{Name: annotations.ProxyContainer, Lifecycle: &corev1.Lifecycle{PostStart: &corev1.LifecycleHandler{}}}, {Name: "init"}}
		pod.Spec.Containers = []corev1.Container{{Name: "app"}}
		pod.Status.InitContainerStatuses = append([]corev1.ContainerStatus{proxy}, next...)
		return pod
	}
	for _, tc := range []struct {
		name    string
		pod     *corev1.Pod
		code    int32
		running bool
		failed  bool
	}{
		{"the check runs again after 42, Started by the kubelet", hookPod(corev1.ContainerStatus{Name: annotations.ProxyContainer, State: runningSince(10), Started: &started, LastTerminationState: exited(42, noRedirectLog)}),
			42, true, true},
		{"waiting after the check's 42", hookPod(corev1.ContainerStatus{Name: annotations.ProxyContainer, State: crashLoop, Started: &notStarted, LastTerminationState: exited(42, noRedirectLog)}),
			42, false, true},
		{"passed after 42: the init container started since", hookPod(corev1.ContainerStatus{Name: annotations.ProxyContainer, State: runningSince(10), Started: &started, LastTerminationState: exited(42, noRedirectLog)},
			corev1.ContainerStatus{Name: "init", State: doneAt(10)}), 0, true, false},
		{"an init container of an earlier run proves nothing", hookPod(corev1.ContainerStatus{Name: annotations.ProxyContainer, State: runningSince(30), Started: &started, LastTerminationState: exited(42, noRedirectLog)},
			corev1.ContainerStatus{Name: "init", State: doneAt(10)}), 42, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, running, failed := validator.LastFailure(tc.pod)
			if code != tc.code || running != tc.running || failed != tc.failed {
				t.Errorf("LastFailure = %d, running %v, failed %v; want %d, %v, %v", code, running, failed, tc.code, tc.running, tc.failed)
			}
		})
	}
	// The app started since counts too (a pod without init containers of its own).
	pod := hookPod(corev1.ContainerStatus{Name: annotations.ProxyContainer, State: runningSince(10), Started: &started, LastTerminationState: exited(42, noRedirectLog)})
	pod.Status.ContainerStatuses = []corev1.ContainerStatus{{Name: "app", State: runningSince(11)}}
	if _, _, failed := validator.LastFailure(pod); failed {
		t.Errorf("the app runs since the proxy's run began, but LastFailure says its check failed")
	}
}

// FailureMessage is the check's own line in its container's termination message (the log's end)
// — at the proxy's start after whatever the gate printed before it — without "detour: ".
func TestFailureMessage(t *testing.T) {
	const portTaken = "port 4142 is taken by a socket listening on 0.0.0.0:4142 owned by uid 1000, not by the proxy (uid 2102): …"
	for _, tc := range []struct {
		name        string
		annotations map[string]string
		status      corev1.ContainerStatus
		want        string
	}{
		{"the proxy's check: exit 43", imageVolume, corev1.ContainerStatus{Name: annotations.ProxyContainer, State: crashLoop, Started: &notStarted,
			LastTerminationState: exited(43, "detour validate: the start gate's socket: …; a start gate hook only waits for the proxy\ndetour: "+portTaken+"\n")}, portTaken},
		{"the validator container", nil, corev1.ContainerStatus{Name: annotations.ValidatorContainer, State: crashLoop, LastTerminationState: exited(42, noRedirectLog)},
			"no redirect in this pod's network namespace: expected connections to 203.0.113.254:80 to be redirected to port 4140 of this pod"},
		{"no message", nil, corev1.ContainerStatus{Name: annotations.ValidatorContainer, State: crashLoop, LastTerminationState: exited(43, "")}, ""},
		{"passed since", nil, corev1.ContainerStatus{Name: annotations.ValidatorContainer, State: exited(0, ""), LastTerminationState: exited(43, "detour: "+portTaken)}, ""},
		{"the proxy's own exit", imageVolume, corev1.ContainerStatus{Name: annotations.ProxyContainer, State: crashLoop,
			LastTerminationState: exited(1, "redirect in place\n"+validator.StartedMarker+"/proxy\ndetour: fatal\n")}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pod := &corev1.Pod{}
			pod.Annotations = tc.annotations
			pod.Status.InitContainerStatuses = []corev1.ContainerStatus{tc.status}
			if got := validator.FailureMessage(pod); got != tc.want {
				t.Errorf("FailureMessage = %q, want %q", got, tc.want)
			}
		})
	}
}
