package repair

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"golang.org/x/time/rate"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/validator"
)

// ownerKind is an owner reference as group/Kind.
func ownerKind(ref *metav1.OwnerReference) string {
	group, _, _ := strings.Cut(ref.APIVersion, "/")
	if !strings.Contains(ref.APIVersion, "/") {
		group = "" // the core group: "v1"
	}
	return group + "/" + ref.Kind
}

// Caught reports whether pod is an injected pod, not being deleted and not terminal, whose
// validator check's last run terminated with [validator.ExitNoRedirect] and has not passed
// since — in its current state, or in its last one while it waits to restart
// (Init:CrashLoopBackOff) or runs again — in the detour-validator init container or at the start
// of the detour-proxy container ([validator.LastFailure]). A check that finds no redirect spends
// its whole timeout running, so a run under way does not hide the last one's result (as
// `detour check --cluster` reads it): the pod stays caught through its retries. A Failed or
// Succeeded pod is not caught: its controller already replaced it, or it is done.
func Caught(pod *corev1.Pod) bool {
	caught, _ := caughtRunning(pod)
	return caught
}

// caughtRunning reports [Caught], and whether the check runs again now.
func caughtRunning(pod *corev1.Pod) (caught, running bool) {
	if pod.DeletionTimestamp != nil || !annotations.IsInjected(pod.Annotations) ||
		pod.Status.Phase == corev1.PodFailed || pod.Status.Phase == corev1.PodSucceeded {
		return false, false
	}
	code, running, failed := validator.LastFailure(pod)
	return failed && code == validator.ExitNoRedirect, running
}

// NeedsRepair reports whether pod is [Caught] and its check is not running again: in a new
// sandbox a check that runs may pass, so the pod is not deleted before it can.
func NeedsRepair(pod *corev1.Pod) bool {
	caught, running := caughtRunning(pod)
	return caught && !running
}

// jobKind is a Job's group/Kind.
const jobKind = "batch/Job"

// checkRunsAgain reports whether the kubelet runs pod's failed check again in the same sandbox,
// where it cannot pass: at the proxy's start (a restartable init container, which the kubelet
// restarts whatever the pod's restartPolicy, so that a restartPolicy Never pod never fails and
// its Job waits for ever), or in the validator init container of a pod whose restartPolicy is
// not Never (OnFailure: each restart counts against its Job's backoffLimit, and none can pass).
// A restartPolicy Never pod whose validator init container failed is Failed at once (the
// kubelet's pod phase) and its Job replaces it: nothing to repair.
func checkRunsAgain(pod *corev1.Pod) bool {
	return validator.CheckContainer(pod) == annotations.ProxyContainer || pod.Spec.RestartPolicy != corev1.RestartPolicyNever
}

// Controller repairs the pods of one node.
type Controller struct {
	client  kubernetes.Interface
	cfg     Config
	log     *slog.Logger
	metrics *Metrics
	limiter *rate.Limiter
	queue   workqueue.TypedRateLimitingInterface[string]
	factory informers.SharedInformerFactory
	pods    corelisters.PodLister
	synced  cache.InformerSynced
	// nsFactory and namespaces cache the cluster's namespaces (their opt-in annotation), for
	// the pods-by-state gauge; nsSynced reports when that cache is filled.
	nsFactory  informers.SharedInformerFactory
	namespaces corelisters.NamespaceLister
	nsSynced   cache.InformerSynced
	now        func() time.Time

	mu        sync.Mutex
	seen      map[types.UID]bool // pods counted in pods_seen
	done      map[types.UID]bool // pods acted on (one action, one Event each)
	readyAt   time.Time          // when the node was last found ready
	checkedAt time.Time          // when the node was last read
	owners    map[types.UID]*ownerState
}

// Option configures a Controller.
type Option func(*Controller)

// WithLogger sets the logger (default slog.Default()).
func WithLogger(l *slog.Logger) Option { return func(c *Controller) { c.log = l } }

// WithMetrics sets the metrics (default: new ones, registered nowhere).
func WithMetrics(m *Metrics) Option { return func(c *Controller) { c.metrics = m } }

// nodeCheckInterval is how long a read of the node's ready label is trusted.
const nodeCheckInterval = 5 * time.Second

// New returns a Controller for cfg's node. Its cache holds only that node's pods: the list and
// watch carry the field selector spec.nodeName=<node>.
func New(client kubernetes.Interface, cfg Config, opts ...Option) (*Controller, error) {
	c := &Controller{
		client:  client,
		cfg:     cfg,
		log:     slog.Default(),
		limiter: rate.NewLimiter(cfg.Rate, cfg.Burst),
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.DefaultTypedControllerRateLimiter[string](),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "detour-repair"}),
		now:    time.Now,
		seen:   map[types.UID]bool{},
		done:   map[types.UID]bool{},
		owners: map[types.UID]*ownerState{},
	}
	for _, o := range opts {
		o(c)
	}
	if c.metrics == nil {
		c.metrics = NewMetrics(nil)
	}
	c.factory = informers.NewSharedInformerFactoryWithOptions(client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.FieldSelector = "spec.nodeName=" + cfg.NodeName }))
	podInformer := c.factory.Core().V1().Pods()
	inf := podInformer.Informer()
	if err := inf.SetTransform(func(obj any) (any, error) {
		if pod, ok := obj.(*corev1.Pod); ok {
			pod.ManagedFields = nil
		}
		return obj, nil
	}); err != nil {
		return nil, fmt.Errorf("set up the pod informer: %w", err)
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    c.enqueue,
		UpdateFunc: func(_, obj any) { c.enqueue(obj) },
		DeleteFunc: c.forget,
	}); err != nil {
		return nil, fmt.Errorf("watch the node's pods: %w", err)
	}
	c.pods, c.synced = podInformer.Lister(), inf.HasSynced
	c.nsFactory = informers.NewSharedInformerFactory(client, 0)
	nsInformer := c.nsFactory.Core().V1().Namespaces()
	if err := nsInformer.Informer().SetTransform(func(obj any) (any, error) {
		if ns, ok := obj.(*corev1.Namespace); ok {
			ns.ManagedFields = nil
		}
		return obj, nil
	}); err != nil {
		return nil, fmt.Errorf("set up the namespace informer: %w", err)
	}
	c.namespaces, c.nsSynced = nsInformer.Lister(), nsInformer.Informer().HasSynced
	return c, nil
}

func (c *Controller) enqueue(obj any) {
	pod, ok := obj.(*corev1.Pod)
	if !ok || !NeedsRepair(pod) {
		return
	}
	if key, err := cache.MetaNamespaceKeyFunc(pod); err == nil {
		c.queue.Add(key)
	}
}

func (c *Controller) forget(obj any) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	if pod, ok := obj.(*corev1.Pod); ok {
		c.mu.Lock()
		delete(c.seen, pod.UID)
		delete(c.done, pod.UID)
		c.mu.Unlock()
	}
}

// HasSynced reports whether the controller's cache has the node's pods.
func (c *Controller) HasSynced() bool { return c.synced() }

// Run watches the node's pods and repairs them until ctx ends.
func (c *Controller) Run(ctx context.Context) error {
	defer c.queue.ShutDown()
	c.factory.Start(ctx.Done())
	defer c.factory.Shutdown()
	c.nsFactory.Start(ctx.Done())
	defer c.nsFactory.Shutdown()
	if !cache.WaitForCacheSync(ctx.Done(), c.synced) {
		if ctx.Err() != nil {
			return nil
		}
		return errors.New("the pod cache did not sync")
	}
	c.loadBackoff(ctx)
	c.log.Info("watching the node's pods", "node", c.cfg.NodeName)
	go func() {
		<-ctx.Done()
		c.queue.ShutDown()
	}()
	for c.processNext(ctx) {
	}
	return nil
}

func (c *Controller) processNext(ctx context.Context) bool {
	key, quit := c.queue.Get()
	if quit {
		return false
	}
	defer c.queue.Done(key)
	retry, err := c.sync(ctx, key)
	switch {
	case err != nil:
		c.log.Error("repair failed; retrying", "pod", key, "err", err)
		c.queue.AddRateLimited(key)
	case retry > 0:
		c.queue.Forget(key)
		c.queue.AddAfter(key, retry)
	default:
		c.queue.Forget(key)
	}
	return true
}

// sync handles one pod; it returns a delay after which to look again, or an error to retry.
func (c *Controller) sync(ctx context.Context, key string) (time.Duration, error) {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return 0, nil
	}
	pod, err := c.pods.Pods(ns).Get(name)
	if apierrors.IsNotFound(err) || (err == nil && !NeedsRepair(pod)) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	c.mu.Lock()
	if c.done[pod.UID] {
		c.mu.Unlock()
		return 0, nil
	}
	if !c.seen[pod.UID] {
		c.seen[pod.UID] = true
		c.metrics.PodsSeen.Inc()
		c.log.Info("pod's validator found no redirect", "pod", key, "uid", pod.UID)
	}
	c.mu.Unlock()

	owner := metav1.GetControllerOf(pod)
	switch {
	case owner == nil || c.cfg.RecreatingOwners[ownerKind(owner)]:
	case ownerKind(owner) == jobKind:
		// A Job replaces a pod that fails, and counts a deleted one as failed. A pod whose
		// check runs again in its sandbox never fails (at the proxy's start) or only once
		// its restarts have used up the Job's backoffLimit: deleted, it is one failure, and
		// its replacement gets the redirect. A pod the kubelet fails by itself needs nothing.
		if !checkRunsAgain(pod) {
			c.markDone(pod)
			c.metrics.PodsSkipped.WithLabelValues(SkipJob).Inc()
			c.log.Info("a Job's pod fails by itself (restartPolicy Never); its Job replaces it", "pod", key, "job", owner.Name)
			return 0, nil
		}
	default:
		owner = nil // nothing recreates it when deleted: annotated like a bare pod
	}
	if owner == nil {
		if _, ok := pod.Annotations[RecreateAnnotation]; ok {
			c.markDone(pod)
			c.metrics.PodsSkipped.WithLabelValues(SkipAlreadyAnnotated).Inc()
			return 0, nil
		}
	}
	if c.cfg.RequireCNIReady {
		ready, err := c.nodeReady(ctx)
		if err != nil {
			c.metrics.Errors.WithLabelValues(ActionReadNode).Inc()
			return 0, err
		}
		if !ready {
			c.metrics.PodsDeferred.WithLabelValues(DeferNodeNotReady).Inc()
			return nodeCheckInterval, nil
		}
	}
	if owner != nil {
		if wait := c.ownerWait(pod, owner); wait > 0 {
			c.metrics.PodsDeferred.WithLabelValues(DeferOwnerBackoff).Inc()
			c.log.Info("a replacement pod failed again; backing off before deleting it", "pod", key, "owner", owner.Kind+"/"+owner.Name, "wait", wait.Round(time.Second))
			return wait, nil
		}
	}
	if !c.limiter.Allow() {
		c.metrics.PodsDeferred.WithLabelValues(DeferRateLimited).Inc()
		return time.Duration(float64(time.Second) / float64(c.cfg.Rate)), nil
	}
	if owner == nil {
		return 0, c.annotate(ctx, pod)
	}
	return 0, c.delete(ctx, pod, owner)
}

// nodeReady reports whether the node carries the ready label, reading it at most every
// nodeCheckInterval.
func (c *Controller) nodeReady(ctx context.Context) (bool, error) {
	c.mu.Lock()
	now := c.now()
	if now.Sub(c.checkedAt) < nodeCheckInterval {
		ready := c.readyAt.Equal(c.checkedAt)
		c.mu.Unlock()
		return ready, nil
	}
	c.mu.Unlock()
	node, err := c.client.CoreV1().Nodes().Get(ctx, c.cfg.NodeName, metav1.GetOptions{})
	if err != nil {
		return false, fmt.Errorf("read node %s: %w (the service account needs get on nodes)", c.cfg.NodeName, err)
	}
	// A label from before the node's last reboot is stale until the node agent, started again,
	// has put detour's entry back and marked this boot (the kubelet reports the new boot ID).
	boot := node.Status.NodeInfo.BootID
	ready := node.Labels[annotations.CNIReadyLabel] == "true" && (boot == "" || node.Annotations[annotations.CNIReadyBootAnnotation] == boot)
	c.mu.Lock()
	c.checkedAt = now
	if ready {
		c.readyAt = now
	}
	c.mu.Unlock()
	if !ready {
		c.log.Info("waiting for the node's CNI config before repairing pods", "node", c.cfg.NodeName, "label", annotations.CNIReadyLabel+"=true")
	}
	return ready, nil
}
