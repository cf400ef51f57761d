package e2e

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/test/e2e/framework"
	"github.com/detourmesh/detour/validator"
)

// watchPods follows every soak pod with an informer (it relists after an API server restart)
// and hands the ones to check to the workers.
func (s *soak) watchPods(ctx context.Context) {
	factory := informers.NewSharedInformerFactoryWithOptions(s.e.Node.Client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = soakLabel }))
	inf := factory.Core().V1().Pods().Informer()
	inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { s.observe(obj) },
		UpdateFunc: func(_, obj any) { s.observe(obj) },
	})
	s.podInformer = inf
	factory.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		s.t.Fatal("the soak's pod informer did not sync")
	}
}

// lister returns the soak pods of ns with a label selector of the form "key" or "key=value".
func (s *soak) lister(ns, selector string) []*corev1.Pod {
	key, value, hasValue := strings.Cut(selector, "=")
	var out []*corev1.Pod
	for _, obj := range s.podInformer.GetStore().List() {
		p := obj.(*corev1.Pod)
		if p.Namespace != ns {
			continue
		}
		if v, ok := p.Labels[key]; !ok || (hasValue && v != value) {
			continue
		}
		out = append(out, p)
	}
	return out
}

// validatorFailure returns the exit code and message of the check's last failed run, in the
// validator container or at the proxy's start (validator.CheckFailed).
func validatorFailure(p *corev1.Pod) (int32, string, bool) {
	name := validator.CheckContainer(p)
	for _, st := range p.Status.InitContainerStatuses {
		if st.Name != name {
			continue
		}
		for _, term := range []*corev1.ContainerStateTerminated{st.State.Terminated, st.LastTerminationState.Terminated} {
			if validator.CheckFailed(name, term) {
				return term.ExitCode, strings.TrimSpace(term.Message), true
			}
		}
	}
	return 0, "", false
}

// validatorPassed returns the container ID of the check's run that passed, in the pod's current
// sandbox: the validator container that exited 0, or the proxy that started after its check
// (validator.ProxyPassed: with detour's postStart hook as the start gate, Started alone is no
// proof).
func validatorPassed(p *corev1.Pod) (string, bool) {
	for _, st := range p.Status.InitContainerStatuses {
		switch {
		case st.Name == annotations.ValidatorContainer && !framework.ChecksAtProxyStart(p) && st.State.Terminated != nil && st.State.Terminated.ExitCode == 0:
			return st.State.Terminated.ContainerID, st.State.Terminated.ContainerID != ""
		case st.Name == annotations.ProxyContainer && framework.ChecksAtProxyStart(p) && st.State.Running != nil && validator.ProxyPassed(p):
			return st.ContainerID, st.ContainerID != ""
		}
	}
	return "", false
}

// checkKey names one capture check of p: its current validator run, or its completion.
func checkKey(p *corev1.Pod) (string, bool) {
	if p.Status.Phase == corev1.PodSucceeded {
		return string(p.UID) + "/completed", true
	}
	id, ok := validatorPassed(p)
	return string(p.UID) + "/" + id, ok
}

func (s *soak) checked(p *corev1.Pod) bool {
	key, ok := checkKey(p)
	if !ok {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	v := s.checks[key]
	return v != "" && v != "pending"
}

// observe records what a pod's new state shows and queues its capture check.
func (s *soak) observe(obj any) {
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	sp := s.seen[p.UID]
	if sp == nil {
		sp = &soakPod{ns: p.Namespace, name: p.Name, kind: p.Labels[soakLabel], created: p.CreationTimestamp.Time, injected: annotations.IsInjected(p.Annotations), folded: framework.ChecksAtProxyStart(p)}
		s.seen[p.UID] = sp
		if !sp.injected {
			s.uninjected[p.UID] = p.Namespace + "/" + p.Name
		}
	}
	if code, msg, bad := validatorFailure(p); bad {
		switch {
		case code == validator.ExitNoRedirect:
			if _, known := s.caught[p.UID]; !known {
				s.caught[p.UID] = caughtPod{name: p.Namespace + "/" + p.Name, at: time.Now(), message: msg}
				s.logf("pod %s/%s: its validator found no redirect: %s", p.Namespace, p.Name, msg)
			}
		case code >= 128:
			// Killed (137, 143) or never started (128), or its container lost in a reboot
			// (255): the validator did not get to its verdict; a new run follows.
			if _, known := s.interrupted[p.UID]; !known {
				s.interrupted[p.UID] = fmt.Sprintf("%s/%s exit %d", p.Namespace, p.Name, code)
			}
		default:
			if _, known := s.otherFailures[p.UID]; !known {
				s.otherFailures[p.UID] = fmt.Sprintf("%s/%s exit %d: %s", p.Namespace, p.Name, code, msg)
			}
		}
	}
	if !sp.injected || p.DeletionTimestamp != nil {
		return
	}
	job := p.Labels[soakLabel] == kindJob
	if job && p.Status.Phase != corev1.PodSucceeded || !job && !framework.PodReady(p) {
		return
	}
	key, ok := checkKey(p)
	if !ok || s.checks[key] != "" {
		return
	}
	s.checks[key] = "pending"
	select {
	case s.queue <- checkItem{pod: *p.DeepCopy(), key: key, job: job}:
	default:
		delete(s.checks, key) // the queue is full: the next update queues it again
	}
}

// checkWorker proves each queued pod captured: a Ready pod's app must see the inbound
// connection come from the proxy (127.0.0.1 or ::1), a completed Job pod's proxy must have
// carried its app's dial.
func (s *soak) checkWorker(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case item := <-s.queue:
			verdict := s.checkCapture(ctx, item)
			s.mu.Lock()
			s.checks[item.key] = verdict
			if strings.HasPrefix(verdict, "bypassed") {
				s.bypassed = append(s.bypassed, item.pod.Namespace+"/"+item.pod.Name+": "+verdict)
			}
			s.mu.Unlock()
			if strings.HasPrefix(verdict, "bypassed") {
				s.logf("pod %s/%s ran without the redirect while its validator passed: %s", item.pod.Namespace, item.pod.Name, verdict)
			}
		}
	}
}

func (s *soak) checkCapture(ctx context.Context, item checkItem) string {
	p := item.pod
	if item.job {
		// The proxy's log as the kubelet wrote it on the node: asking the API server for it
		// goes through the kubelet and containerd, and while either restarts the answer can
		// be empty (eight false alarms in one run, each pod's log on disk showing its
		// connection).
		files, _ := filepath.Glob(filepath.Join(s.e.Node.Dir, "pod-logs",
			p.Namespace+"_"+p.Name+"_"+string(p.UID), annotations.ProxyContainer, "*.log"))
		var log strings.Builder
		for _, f := range files {
			log.WriteString(framework.ReadFile(f))
		}
		switch {
		case strings.Contains(log.String(), "-> "+s.e.Server):
			return "captured"
		case !strings.Contains(log.String(), "proxy outbound listening"):
			return fmt.Sprintf("unverified: no log of the proxy's start on the node (%d files)", len(files))
		}
		return "bypassed: the proxy carried no connection to " + s.e.Server
	}
	deadline := time.Now().Add(30 * time.Second)
	for ctx.Err() == nil && time.Now().Before(deadline) {
		reply, err := s.inbound(ctx, p.Status.PodIP)
		switch {
		case err == nil && s.e.Proxy.Proxied(reply):
			return "captured"
		case err == nil:
			return "bypassed: the app saw " + strings.TrimSpace(reply)
		}
		// The pod may be gone, or a new sandbox may be on its way (a check per sandbox).
		cur, exists, _ := s.podInformer.GetStore().Get(&p)
		if !exists {
			return "unverified: deleted before its app answered"
		}
		if key, _ := checkKey(cur.(*corev1.Pod)); key != item.key || !framework.PodReady(cur.(*corev1.Pod)) {
			return "unverified: its sandbox changed before its app answered"
		}
		framework.SleepCtx(ctx, time.Second)
	}
	return "unverified: no answer from its app within 30s"
}

// inbound connects from the node to the app's port and returns its greeting.
func (s *soak) inbound(ctx context.Context, ip string) (string, error) {
	return s.e.Node.Greeting(ctx, ip+":8080")
}
