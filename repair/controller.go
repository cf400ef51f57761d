package repair

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"golang.org/x/time/rate"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
)

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
	c.factory = informers.NewSharedInformerFactoryWithOptions(listThenWatch{client}, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = "spec.nodeName=" + cfg.NodeName
			o.Limit = min(o.Limit, podPage) // a watch's 0 stays
		}))
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

// podPage bounds the pod informer's list, which tells the API server's priority and fairness
// how few pods it returns. Its list work estimator (k8s.io/apiserver v0.37.2,
// list_work_estimator.go) charges a list from the watch cache as min(limit, every pod of the
// cluster) objects, at one seat per 100 kB: a node's list without a limit — or a watch that
// sends its initial objects, how client-go lists by default since v0.35, which has no limit —
// costs the maximum 10 seats once the cluster has a few thousand pods, and a rollout of every
// agent at once at 300 and 1,000 nodes was throttled (docs/scale.md). The watch cache ignores
// the limit of the informer's first list (resourceVersion 0), so that list still returns all the
// node's pods in one response; a relist at resourceVersion "" pages.
const podPage = 10

// listThenWatch makes the informers of its client list and then watch from the list's
// resourceVersion (watched from a resourceVersion, a watch costs one seat) instead of opening a
// watch that sends the initial objects (client-go's WatchListClient).
type listThenWatch struct{ kubernetes.Interface }

// IsWatchListSemanticsUnSupported is what client-go's reflector asks the client of an informer
// before it opens a watch that sends the initial objects (watchlist.DoesClientNotSupportWatchListSemantics).
func (listThenWatch) IsWatchListSemanticsUnSupported() bool { return true }

func (c *Controller) enqueue(obj any) {
	pod, ok := obj.(*corev1.Pod)
	if !ok || !NeedsRepair(pod) && !portTaken(pod) {
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
