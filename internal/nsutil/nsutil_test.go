package nsutil_test

import (
	"testing"

	"github.com/vishvananda/netns"

	"github.com/detourmesh/detour/internal/nsutil"
	"github.com/detourmesh/detour/test/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// Do runs fn in the namespace and comes back, also when fn panics.
func TestIntegrationDo(t *testing.T) {
	ns := testenv.NewNetNS(t)
	target, err := netns.GetFromPath(ns.Path)
	if err != nil {
		t.Fatal(err)
	}
	defer target.Close()
	origin, _ := netns.Get()
	defer origin.Close()

	inside := false
	if err := nsutil.Do(ns.Path, func() error {
		cur, _ := netns.Get()
		defer cur.Close()
		inside = cur.Equal(target)
		return nil
	}); err != nil || !inside {
		t.Fatalf("Do: inside=%v, %v", inside, err)
	}

	func() {
		defer func() { recover() }()
		nsutil.Do(ns.Path, func() error { panic("boom") })
	}()
	cur, _ := netns.Get()
	defer cur.Close()
	if !cur.Equal(origin) {
		t.Fatal("after a panic in fn the goroutine is still in the pod's namespace")
	}
	if err := nsutil.Do("/nonexistent/netns", func() error { return nil }); err == nil {
		t.Fatal("Do with a missing namespace succeeded")
	}
}
