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

// restoreFaults runs the iptables tools for real but fails restores as told: refuseSocket
// fails every input with the socket match the way iptables-restore does on a kernel without
// xt_socket; failFirst fails that many restores of any input with an error that is not the
// lock's; lock fails every restore with the xtables lock's timeout.
type restoreFaults struct {
	refuseSocket bool
	lock         bool
	mu           sync.Mutex
	failFirst    int
}

func (r *restoreFaults) Run(ctx context.Context, name string, args []string, stdin []byte) ([]byte, error) {
	if strings.Contains(name, "restore") {
		r.mu.Lock()
		first := r.failFirst > 0
		r.failFirst--
		r.mu.Unlock()
		switch {
		case r.lock:
			return nil, &iptables.ExecError{Name: name, Args: args, Err: errors.New("exit status 4"), Stderr: "Another app is currently holding the xtables lock."}
		case first:
			return nil, &iptables.ExecError{Name: name, Args: args, Err: errors.New("exit status 1"), Stderr: "iptables-restore: line 3 failed: Resource temporarily unavailable"}
		case r.refuseSocket && strings.Contains(string(stdin), "-m socket"):
			return nil, &iptables.ExecError{Name: name, Args: args, Err: errors.New("exit status 2"),
				Stderr: "iptables-restore v1.8.9: Couldn't load match `socket':No such file or directory\n\nError occurred at line: 5"}
		}
	}
	return iptables.ExecRunner{}.Run(ctx, name, args, stdin)
}

// Issue 42.3a: ADD falls back to redirecting every inbound connection only where the kernel
// refuses the socket lookup itself — not for a held xtables lock, nor for an error that goes
// away — and both checks read the fallback from the rules, whatever the kernel does by then.
func TestIntegrationApplyWithInboundFallback(t *testing.T) {
	testenv.Privileged(t)
	r := annotations.Redirect{Version: "v1", ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140, InboundListening: true}
	rulesets, err := iptables.BuildFamilies(r, iptables.IPv4, iptables.IPv6)
	if err != nil {
		t.Fatal(err)
	}
	fallback, _ := iptables.InboundFallback(rulesets)
	for _, backend := range []iptables.Backend{iptables.BackendLegacy, iptables.BackendNFT} {
		for _, tc := range []struct {
			name     string
			faults   *restoreFaults
			fellBack bool
			lock     bool // Apply's error is the lock's
			failed   bool // Apply's error is another
		}{
			{"the kernel refuses the lookup", &restoreFaults{refuseSocket: true}, true, false, false},
			{"the xtables lock is held", &restoreFaults{lock: true}, false, true, false},
			{"one restore fails and the next passes", &restoreFaults{failFirst: 1}, false, false, false},
			{"every restore fails", &restoreFaults{failFirst: 1000}, false, false, true},
		} {
			t.Run(string(backend)+"/"+tc.name, func(t *testing.T) {
				ns := testenv.NewNetNS(t)
				ctx := context.Background()
				exec := iptables.NewExecutor(iptables.WithBackend(backend), iptables.WithRunner(tc.faults))
				refused, err := exec.ApplyWithInboundFallback(ctx, ns.Path, rulesets...)
				switch {
				case (refused != nil) != tc.fellBack:
					t.Fatalf("refused = %v, want a fallback: %v (err %v)", refused, tc.fellBack, err)
				case tc.fellBack && !strings.Contains(refused.Error(), "Couldn't load match `socket'"):
					t.Errorf("refused = %v, want the tool's refusal of the socket match", refused)
				case iptables.IsLockTimeout(err) != tc.lock:
					t.Errorf("err = %v, want a lock timeout: %v", err, tc.lock)
				case (err != nil && !tc.lock) != tc.failed:
					t.Errorf("err = %v, want a failure: %v", err, tc.failed)
				}
				// What is in the namespace, read by the real tools: the fallback, the listening
				// rules, or nothing.
				check := iptables.NewExecutor(iptables.WithBackend(backend))
				how, cerr := check.CheckInstalled(ctx, ns.Path, rulesets...)
				switch {
				case tc.fellBack && (cerr != nil || how != iptables.InboundFallbackInstalled):
					t.Errorf("CheckInstalled = %v, %v; want the fallback accepted", how, cerr)
				case tc.fellBack && check.Check(ctx, ns.Path, fallback...) != nil:
					t.Errorf("the namespace does not hold the fallback: %v", check.Check(ctx, ns.Path, fallback...))
				case !tc.fellBack && err == nil && (cerr != nil || how != iptables.AsBuilt):
					t.Errorf("CheckInstalled = %v, %v; want the listening rules", how, cerr)
				case err != nil && cerr == nil:
					t.Errorf("Apply failed (%v) but the namespace holds rules", err)
				}
			})
		}
	}
}
