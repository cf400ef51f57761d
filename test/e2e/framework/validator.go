package framework

import (
	"context"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/validator"
)

// CheckExit is the outcome of p's validator check wherever it runs: 0 once it passed, the exit
// code of its last failed run, or -1 while no run has ended. In the detour-validator init
// container that is the container's last termination; at the proxy's start, the check passed
// as validator.ProxyPassed says (its startup probe passed, or, with detour's postStart hook as
// the start gate, the pod's next container started), and failed as validator.LastFailure says.
func CheckExit(p *corev1.Pod) int {
	if validator.CheckContainer(p) == annotations.ValidatorContainer {
		return InitExit(p, annotations.ValidatorContainer)
	}
	code, running, failed := validator.LastFailure(p)
	if failed && !running {
		return int(code)
	}
	if validator.ProxyPassed(p) {
		return 0
	}
	if failed { // a new run under way after a failed one
		return int(code)
	}
	return -1
}

// ChecksAtProxyStart reports whether p's validator check runs at its proxy's start (the
// webhook's validator mode image-volume), not in the detour-validator init container.
func ChecksAtProxyStart(p *corev1.Pod) bool {
	return p.Annotations[annotations.Validator] == string(annotations.ValidatorImageVolume)
}

// InitExit returns the exit code of init container name's last termination, or -1.
func InitExit(p *corev1.Pod, name string) int {
	for _, s := range p.Status.InitContainerStatuses {
		if s.Name != name {
			continue
		}
		if s.State.Terminated != nil {
			return int(s.State.Terminated.ExitCode)
		}
		if s.LastTerminationState.Terminated != nil {
			return int(s.LastTerminationState.Terminated.ExitCode)
		}
	}
	return -1
}

// PodWatcher follows the pods of a namespace: how many were created, and how many of them
// had a validator fail (exit 42).
type PodWatcher struct {
	mu      sync.Mutex
	created map[types.UID]bool
	caught  map[types.UID]bool
	cancel  context.CancelFunc
}

// WatchPods starts a [PodWatcher] on ns; it runs until ctx ends or [PodWatcher.Stop].
func (e *Env) WatchPods(ctx context.Context, ns string) *PodWatcher {
	ctx, cancel := context.WithCancel(ctx)
	w := &PodWatcher{created: map[types.UID]bool{}, caught: map[types.UID]bool{}, cancel: cancel}
	go func() {
		for ctx.Err() == nil {
			if pods, err := e.Pods(ctx, ns, ""); err == nil {
				w.mu.Lock()
				for _, p := range pods {
					w.created[p.UID] = true
					if CheckExit(&p) == 42 {
						w.caught[p.UID] = true
					}
				}
				w.mu.Unlock()
			}
			SleepCtx(ctx, 250*time.Millisecond)
		}
	}()
	return w
}

// Stop ends the watch.
func (w *PodWatcher) Stop() { w.cancel() }

// Result returns how many pods of the namespace had a validator fail (exit 42), and how many
// were created, while the watch ran.
func (w *PodWatcher) Result() (caught, created int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.caught), len(w.created)
}
