package cniplugin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/test/testenv"
)

// restoreFaults runs the iptables tools for real but fails restores as told: lockFirst fails
// that many restores with the xtables lock's timeout; refuseSocket fails every input with the
// socket match as iptables-restore does on a kernel without xt_socket.
type restoreFaults struct {
	mu           sync.Mutex
	lockFirst    int
	refuseSocket bool
}

func (r *restoreFaults) Run(ctx context.Context, name string, args []string, stdin []byte) ([]byte, error) {
	if strings.Contains(name, "restore") {
		r.mu.Lock()
		lock := r.lockFirst > 0
		r.lockFirst--
		r.mu.Unlock()
		switch {
		case lock:
			return nil, &iptables.ExecError{Name: name, Args: args, Err: errors.New("exit status 4"), Stderr: "Another app is currently holding the xtables lock."}
		case r.refuseSocket && strings.Contains(string(stdin), "-m socket"):
			return nil, &iptables.ExecError{Name: name, Args: args, Err: errors.New("exit status 2"),
				Stderr: "iptables-restore v1.8.9: Couldn't load match `socket':No such file or directory\n\nError occurred at line: 5"}
		}
	}
	return iptables.ExecRunner{}.Run(ctx, name, args, stdin)
}

// Issue 42.3: the inbound fallback is taken only where the kernel refuses the socket lookup (a
// held xtables lock is "try again later", not a permanent every-connection redirect); a pod
// that fell back is recorded for the node agent, counted, passes CHECK, and DEL forgets it.
func TestIntegrationAddInboundFallback(t *testing.T) {
	testenv.Privileged(t)
	ann := annotations.Redirect{Version: "v1", ProxyUID: 2102, InboundPort: 4143, OutboundPort: 4140, InboundListening: true}.Annotations()
	rc, _ := json.Marshal(map[string]any{PodAnnotationsCapability: ann})
	stdin := conf(t, `,"iptablesBackend":"legacy","runtimeConfig":`+string(rc))
	for _, tc := range []struct {
		name     string
		faults   *restoreFaults
		fellBack bool
		code     uint // the CNI error code of a failed ADD
	}{
		{"the kernel refuses the lookup", &restoreFaults{refuseSocket: true}, true, 0},
		{"another program holds the xtables lock", &restoreFaults{lockFirst: 1}, false, types.ErrTryAgainLater},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ns := testenv.NewNetNS(t)
			state := t.TempDir()
			var out, log bytes.Buffer
			p := &Plugin{Stdout: &out, Stderr: &log, StateDir: state,
				NewExecutor: func(c *Config) *iptables.Executor {
					return iptables.NewExecutor(iptables.WithBackend(c.IPTablesBackend), iptables.WithRunner(tc.faults))
				},
				NewPodGetter: func(*Config) (PodGetter, error) { return nil, errors.New("no API in this test") },
			}
			args := cmdArgs(stdin, podArgs)
			args.Netns = ns.Path
			err := p.Add(args)
			var cniErr *types.Error
			switch {
			case tc.code == 0 && err != nil:
				t.Fatalf("ADD: %v\n%s", err, log.String())
			case tc.code != 0 && (!errors.As(err, &cniErr) || cniErr.Code != tc.code):
				t.Fatalf("ADD = %v, want CNI error code %d\n%s", err, tc.code, log.String())
			}
			records, rerr := ReadFallbacks(state)
			if rerr != nil {
				t.Fatal(rerr)
			}
			stats, _ := ReadAddStats(filepath.Join(state, StatsFileName))
			if !tc.fellBack {
				if len(records) != 0 || stats.InboundFallbacks != 0 || strings.Contains(log.String(), "refused the socket lookup") {
					t.Errorf("a pod that did not fall back: records %+v, %d counted, log\n%s", records, stats.InboundFallbacks, log.String())
				}
				if save, _, _ := iptables.NewExecutor(iptables.WithBackend(iptables.BackendLegacy)).Save(context.Background(), ns.Path, iptables.IPv4); strings.Contains(save, "DETOUR") {
					t.Errorf("rules installed although ADD failed:\n%s", save)
				}
				return
			}
			if len(records) != 1 || records[0].Namespace != "shop" || records[0].Name != "web" || records[0].UID != "u-1" || records[0].ContainerID != "c1" ||
				!strings.Contains(records[0].Refusal, "Couldn't load match `socket'") {
				t.Errorf("fallback records %+v, want shop/web's with the kernel's refusal", records)
			}
			if stats.InboundFallbacks != 1 || !strings.Contains(log.String(), `"level":"WARN"`) || !strings.Contains(log.String(), "refused the socket lookup") {
				t.Errorf("counted %d fallbacks, log\n%s", stats.InboundFallbacks, log.String())
			}
			// CHECK reads the fallback from the rules, with tools that would do the lookup now
			// (an admin loaded the module since).
			p.NewExecutor = func(c *Config) *iptables.Executor {
				return iptables.NewExecutor(iptables.WithBackend(c.IPTablesBackend))
			}
			log.Reset()
			if err := p.Check(args); err != nil || !strings.Contains(log.String(), "the inbound fallback ADD installed") {
				t.Errorf("CHECK of the fallback = %v\n%s", err, log.String())
			}
			if err := p.Del(args); err != nil {
				t.Fatal(err)
			}
			if records, _ := ReadFallbacks(state); len(records) != 0 {
				t.Errorf("records after DEL: %+v", records)
			}
		})
	}
}
