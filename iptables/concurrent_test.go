package iptables_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/test/testenv"
)

// Issue 15.9: concurrent ADDs in one namespace (a pod with two networks, a runtime retrying)
// must not duplicate the jumps into detour's chains (check-then-append), or CHECK fails.
func TestIntegrationConcurrentApply(t *testing.T) {
	testenv.Privileged(t)
	r := annotations.Redirect{Version: "v1", ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140}
	for _, backend := range []iptables.Backend{iptables.BackendLegacy, iptables.BackendNFT} {
		t.Run(string(backend), func(t *testing.T) {
			rs, err := iptables.Build(iptables.ConfigFromRedirect(r, iptables.IPv4))
			if err != nil {
				t.Fatal(err)
			}
			for round := range 5 {
				ns := testenv.NewNetNS(t)
				var wg sync.WaitGroup
				errs := make([]error, 6)
				for i := range errs {
					wg.Go(func() {
						// One executor per ADD, as each plugin run is its own process.
						errs[i] = iptables.NewExecutor(iptables.WithBackend(backend)).Apply(context.Background(), ns.Path, rs)
					})
				}
				wg.Wait()
				if err := errors.Join(errs...); err != nil {
					t.Fatalf("round %d: concurrent Apply: %v", round, err)
				}
				if err := iptables.NewExecutor(iptables.WithBackend(backend)).Check(context.Background(), ns.Path, rs); err != nil {
					save, _, _ := iptables.NewExecutor(iptables.WithBackend(backend)).Save(context.Background(), ns.Path, iptables.IPv4)
					t.Fatalf("round %d: after concurrent Apply: %v\n%s", round, err, save)
				}
			}
		})
	}
}

// failingRestore fails every iptables-restore run the way the tool does.
type failingRestore struct{}

func (failingRestore) Run(ctx context.Context, name string, args []string, stdin []byte) ([]byte, error) {
	if strings.Contains(name, "restore") {
		return nil, &iptables.ExecError{Name: name, Args: args, Err: errors.New("exit status 4"), Stderr: "Another app is currently holding the xtables lock."}
	}
	return iptables.ExecRunner{}.Run(ctx, name, args, stdin)
}

// Issue 15.11: a failed restore names the tool once ("iptables-legacy-restore-restore" before),
// and is recognised as a lock timeout.
func TestIntegrationRestoreError(t *testing.T) {
	testenv.Privileged(t)
	ns := testenv.NewNetNS(t)
	rs, _ := iptables.Build(iptables.ConfigFromRedirect(annotations.Redirect{Version: "v1", ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140}, iptables.IPv4))
	err := iptables.NewExecutor(iptables.WithBackend(iptables.BackendLegacy), iptables.WithRunner(failingRestore{})).Apply(context.Background(), ns.Path, rs)
	if err == nil || strings.Contains(err.Error(), "-restore-restore") || !strings.Contains(err.Error(), "legacy backend: ") || !iptables.IsLockTimeout(err) {
		t.Errorf("Apply = %v", err)
	}
}
