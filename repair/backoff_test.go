package repair

import (
	"context"
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/cache"
)

// Pods that failed together are repaired at once; a replacement that fails again waits for
// its owner's backoff, which doubles, and is per owner.
func TestSyncOwnerBackoff(t *testing.T) {
	other := rsOwner("api")
	other.UID = "rs-api"
	f := newFixture(t, DefaultFlags(), true, failedPod("a", rsOwner("web")), failedPod("b", rsOwner("web")), failedPod("x", other))
	t0 := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	now := t0
	f.c.now = func() time.Time { return now }
	// replace creates a failing pod of the web ReplicaSet after the fact, as its controller would.
	replace := func(name string) {
		t.Helper()
		p := failedPod(name, rsOwner("web"))
		if _, err := f.client.CoreV1().Pods("shop").Create(context.Background(), p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			if _, err := f.c.pods.Pods("shop").Get(name); err == nil {
				return
			} else if time.Now().After(deadline) {
				t.Fatalf("the cache did not see pod %s", name)
			}
		}
	}
	sync := func(name string, wantDeleted bool, wantWait time.Duration) {
		t.Helper()
		before := len(f.actions("delete"))
		wait, err := f.sync(t, name)
		if err != nil {
			t.Fatal(err)
		}
		if deleted := len(f.actions("delete")) > before; deleted != wantDeleted || wait != wantWait {
			t.Errorf("at %s, sync %s: deleted %v, wait %s; want %v, %s", now.Sub(t0), name, deleted, wait, wantDeleted, wantWait)
		}
	}
	sync("a", true, 0)
	replace("c")       // a's replacement
	sync("b", true, 0) // failed together with a: not a replacement
	now = t0.Add(2 * time.Second)
	sync("c", false, 28*time.Second)
	sync("x", true, 0) // another owner has no backoff
	now = t0.Add(31 * time.Second)
	sync("c", true, 0)
	replace("d")
	now = t0.Add(33 * time.Second)
	sync("d", false, 58*time.Second) // doubled
	if got := value(f.c.metrics.PodsDeferred.WithLabelValues(DeferOwnerBackoff)); got != 2 {
		t.Errorf("deferred{owner-backoff} = %v, want 2", got)
	}
	// Half an hour without a deletion: the owner starts again, and the pods it has then are
	// not replacements.
	now = t0.Add(time.Hour)
	sync("d", true, 0)
	replace("e")
	now = t0.Add(time.Hour + time.Second)
	sync("e", false, 29*time.Second) // from the base again
}

// Issue 15.6: the owner backoff survives the controller's restart (it is saved on the node).
func TestOwnerBackoffSurvivesRestart(t *testing.T) {
	f := newFixture(t, DefaultFlags(), true, failedPod("a", rsOwner("web")), failedPod("b", rsOwner("web")))
	t0 := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	now := t0
	f.c.now = func() time.Time { return now }
	if _, err := f.sync(t, "a"); err != nil || len(f.actions("delete")) != 1 {
		t.Fatalf("first deletion: %v, %v", err, f.actions("delete"))
	}
	// The replacement fails too; the controller restarts before it comes to it.
	if _, err := f.client.CoreV1().Pods("shop").Create(context.Background(), failedPod("c", rsOwner("web")), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	flags := DefaultFlags()
	flags.NodeName = "node-1"
	cfg, err := flags.Parse()
	if err != nil {
		t.Fatal(err)
	}
	c, err := New(f.client, cfg, WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))), WithMetrics(NewMetrics(prometheus.NewRegistry())))
	if err != nil {
		t.Fatal(err)
	}
	c.now = func() time.Time { return now }
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	c.factory.Start(ctx.Done())
	cache.WaitForCacheSync(ctx.Done(), c.synced)
	c.loadBackoff(ctx)

	now = t0.Add(2 * time.Second)
	before := len(f.actions("delete"))
	wait, err := c.sync(ctx, "shop/c")
	if err != nil || wait != 28*time.Second || len(f.actions("delete")) != before {
		t.Errorf("restarted controller on the replacement: wait %s, %v, deleted %v; want the saved backoff (28s)", wait, err, len(f.actions("delete")) > before)
	}
	// b failed together with a (known when a was deleted): no backoff after the restart either.
	if wait, err := c.sync(ctx, "shop/b"); err != nil || wait != 0 || len(f.actions("delete")) != before+1 {
		t.Errorf("sibling b: wait %s, %v", wait, err)
	}
	node, _ := f.client.CoreV1().Nodes().Get(ctx, "node-1", metav1.GetOptions{})
	if !strings.Contains(node.Annotations[BackoffAnnotation], `"rs-uid"`) {
		t.Errorf("node annotation %q", node.Annotations[BackoffAnnotation])
	}
}
