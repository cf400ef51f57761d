package upstream

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/detourmesh/detour/annotations"
)

// LogLine is one line of a container's log (a proxy's, or the relabel run's client's), with
// the time the kubelet stamped it with.
type LogLine struct {
	Time time.Time
	// Pod is the container's pod, namespace/name.
	Pod  string
	Text string
}

// ProxyLogs follows the log of detour's proxy in every injected pod created, while it runs, in
// a namespace that did not exist when it started (the tests' namespaces), from the proxy's
// start to the pod's end: the tests delete their namespaces, and the logs with them, as each
// test ends. The test proxy logs one line per connection it carries or fails to carry
// (test/images/testprog's proxy.go): what went through the proxies, whatever the tests' own
// probes concluded.
type ProxyLogs struct {
	client kubernetes.Interface
	pods   cache.Store // the informer's: what running reads
	before map[string]bool
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu        sync.Mutex
	following map[string]bool // by pod UID
	lines     []LogLine
	errs      []string
	resumed   int
}

// FollowProxyLogs starts following; Stop ends it.
func FollowProxyLogs(ctx context.Context, client kubernetes.Interface) (*ProxyLogs, error) {
	nss, err := client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list the namespaces there before the tests: %w", err)
	}
	l := &ProxyLogs{client: client, before: map[string]bool{}, following: map[string]bool{}}
	for _, ns := range nss.Items {
		l.before[ns.Name] = true
	}
	l.ctx, l.cancel = context.WithCancel(context.Background())
	factory := informers.NewSharedInformerFactory(client, 0)
	inf := factory.Core().V1().Pods().Informer()
	l.pods = inf.GetStore()
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: l.seen, UpdateFunc: func(_, obj any) { l.seen(obj) },
	}); err != nil {
		return nil, err
	}
	factory.Start(l.ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		l.cancel()
		return nil, fmt.Errorf("the pod informer did not sync: %w", ctx.Err())
	}
	return l, nil
}

// seen starts following a pod's proxy once the proxy has started.
func (l *ProxyLogs) seen(obj any) {
	p, ok := obj.(*corev1.Pod)
	if !ok || !annotations.IsInjected(p.Annotations) || !proxyStarted(p) {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.before[p.Namespace] || l.following[string(p.UID)] || l.ctx.Err() != nil {
		return
	}
	l.following[string(p.UID)] = true
	l.wg.Add(1)
	go l.follow(p.Namespace, p.Name)
}

// proxyStarted reports whether the pod's proxy container (a container, or a native sidecar
// among the init containers) has started.
func proxyStarted(p *corev1.Pod) bool {
	for _, s := range append(append([]corev1.ContainerStatus{}, p.Status.InitContainerStatuses...), p.Status.ContainerStatuses...) {
		if s.Name == annotations.ProxyContainer && (s.State.Running != nil || s.State.Terminated != nil || s.RestartCount > 0) {
			return true
		}
	}
	return false
}

// follow reads the proxy's log until the pod ends. The kubelet may end a follow while the
// container still runs: it stops when it cannot watch the log file (fsnotify's watcher, an
// inotify instance, of which a user has 128 by default) or when the runtime's answer to its
// status call is an error other than Unavailable (k8s.io/cri-client's logs.ReadLogs). A stream
// that ends while the pod is there is opened again from its last line's time, the lines
// already read skipped; one that cannot be opened is tried again each second while the pod is
// there (a proxy waiting to restart has no log to serve).
func (l *ProxyLogs) follow(ns, name string) {
	defer l.wg.Done()
	pod := ns + "/" + name
	var last time.Time
	for opened := false; ; {
		opts := &corev1.PodLogOptions{Container: annotations.ProxyContainer, Follow: true, Timestamps: true}
		if !last.IsZero() {
			// SinceTime goes in whole seconds: the lines of last's second come again.
			opts.SinceTime = &metav1.Time{Time: last}
		}
		stream, err := l.client.CoreV1().Pods(ns).GetLogs(name, opts).Stream(l.ctx)
		if err != nil && !opened {
			l.mu.Lock()
			l.errs = append(l.errs, fmt.Sprintf("%s: %v", pod, err))
			l.mu.Unlock()
			return
		}
		if err == nil {
			var n int
			last, n = l.read(pod, stream, last)
			stream.Close()
			if opened && n > 0 {
				l.mu.Lock()
				l.resumed++
				l.mu.Unlock()
			}
			opened = true
		}
		if l.ctx.Err() != nil || !l.running(ns, name) {
			return
		}
		select {
		case <-l.ctx.Done():
			return
		case <-time.After(time.Second):
		}
	}
}

// read adds the stream's lines stamped after since (those before were read from an earlier
// stream), and returns the latest stamp read and how many lines it added.
func (l *ProxyLogs) read(pod string, stream io.Reader, since time.Time) (time.Time, int) {
	last, n := since, 0
	sc := bufio.NewScanner(stream)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		line, ok := ParseLogLine(pod, sc.Text())
		if !ok || !line.Time.After(since) {
			continue
		}
		if line.Time.After(last) {
			last = line.Time
		}
		n++
		l.mu.Lock()
		l.lines = append(l.lines, line)
		l.mu.Unlock()
	}
	return last, n
}

// running reports whether the pod is there and may still log: not gone, not ended (as the
// informer has it, rather than a GET each time a stream ends).
func (l *ProxyLogs) running(ns, name string) bool {
	obj, ok, err := l.pods.GetByKey(ns + "/" + name)
	if err != nil || !ok {
		return false
	}
	p := obj.(*corev1.Pod)
	return p.Status.Phase != corev1.PodSucceeded && p.Status.Phase != corev1.PodFailed
}

// ParseLogLine reads one line of a log the kubelet serves with timestamps ("2026-12-05T14:03:45.123456789Z
// text").
func ParseLogLine(pod, s string) (LogLine, bool) {
	stamp, text, ok := strings.Cut(s, " ")
	if !ok {
		return LogLine{}, false
	}
	t, err := time.Parse(time.RFC3339Nano, stamp)
	if err != nil {
		return LogLine{}, false
	}
	return LogLine{Time: t, Pod: pod, Text: text}, true
}

// Stop ends the following (the logs of pods that still run end there) and waits for it.
func (l *ProxyLogs) Stop() {
	l.mu.Lock()
	l.cancel()
	l.mu.Unlock()
	l.wg.Wait()
}

// Lines returns the lines read so far, and the pods whose log could not be followed.
func (l *ProxyLogs) Lines() ([]LogLine, []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]LogLine(nil), l.lines...), append([]string(nil), l.errs...)
}

// Resumed is how many times a proxy's log stream ended while the proxy went on logging: the
// stream opened again had lines the first had not.
func (l *ProxyLogs) Resumed() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.resumed
}

// Followed is the number of proxies followed.
func (l *ProxyLogs) Followed() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.following)
}
