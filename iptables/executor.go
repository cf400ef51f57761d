package iptables

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"syscall"

	"github.com/detourmesh/detour/internal/nsutil"
)

// lockWait is how long the tools wait for the xtables lock ("-w"), shared with every other
// iptables user on the node.
const lockWait = "5"

// Executor applies, removes and checks detour's rules inside network namespaces. It is the only
// code in detour that changes iptables state.
type Executor struct {
	runner  Runner
	backend Backend

	mu     sync.Mutex
	prefer Backend                 // the backend used where none holds rules; set on first use
	fams   map[Family]*familyTools // looked up on first use, per family
}

// familyTools are the tools found on PATH for one family, or why there are none.
type familyTools struct {
	found map[Backend]tools
	err   error
}

// Option configures an Executor.
type Option func(*Executor)

// WithRunner makes the Executor run its commands through r (default ExecRunner).
func WithRunner(r Runner) Option { return func(e *Executor) { e.runner = r } }

// WithBackend pins the backend instead of detecting it (default BackendAuto).
func WithBackend(b Backend) Option { return func(e *Executor) { e.backend = b } }

// NewExecutor returns an Executor; it looks the tools up on PATH on first use.
func NewExecutor(opts ...Option) *Executor {
	e := &Executor{runner: ExecRunner{}, backend: BackendAuto}
	for _, o := range opts {
		o(e)
	}
	return e
}

// tools returns the tools of family f, looking them up on the first call for f.
func (e *Executor) tools(f Family) *familyTools {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.prefer == "" {
		e.prefer = e.backend
		if e.backend == BackendAuto {
			e.prefer = hostDefault()
		}
		e.fams = map[Family]*familyTools{}
	}
	if ft, ok := e.fams[f]; ok {
		return ft
	}
	ft := &familyTools{found: map[Backend]tools{}}
	var errs []error
	for _, b := range []Backend{e.prefer, e.prefer.other()} {
		if e.backend != BackendAuto && b != e.backend {
			continue
		}
		t, err := lookupTools(b, f)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		ft.found[b] = t
	}
	if len(ft.found) == 0 {
		ft.err = fmt.Errorf("no usable %s iptables backend: %w; install iptables (1.8 or later) on the node", f, errors.Join(errs...))
	}
	e.fams[f] = ft
	return ft
}

// Usable reports whether the tools for family f are on PATH, and why not; for the nftables
// backend, whether the kernel answers nf_tables requests.
func (e *Executor) Usable(f Family) error {
	if e.backend == BackendNFTables {
		return nftUsable()
	}
	return e.tools(f).err
}

// Backend returns the backend the Executor was configured with (auto unless pinned).
func (e *Executor) Backend() Backend { return e.backend }

// nftRuleset is the nftables table for rulesets, one per family.
func nftRuleset(rulesets []Ruleset) (NFTRuleset, error) {
	configs := make([]Config, len(rulesets))
	for i, rs := range rulesets {
		configs[i] = rs.Config
	}
	return BuildNFT(configs...)
}

// state is one family's backend in a namespace and what its nat table holds.
type state struct {
	tools tools
	raw   string // the iptables-save output
	table table
}

// inspect picks the backend for family f in the current namespace — the one that already holds
// rules, else the preferred one — and returns its nat table. Call it inside nsutil.Do.
func (e *Executor) inspect(ctx context.Context, f Family) (state, error) {
	ft := e.tools(f)
	if ft.err != nil {
		return state{}, ft.err
	}
	var first *state
	for _, b := range []Backend{e.prefer, e.prefer.other()} {
		t, ok := ft.found[b]
		if !ok {
			continue
		}
		s := state{tools: t}
		// A fresh pod namespace has no nat table in either backend; asking the kernel directly
		// saves running the tools there.
		if natTableExists(b, f) {
			out, err := e.runner.Run(ctx, t.save, []string{"-t", "nat"}, nil)
			if err != nil {
				return state{}, fmt.Errorf("read the %s nat table: %w", f, err)
			}
			s.raw, s.table = string(out), parseSave(string(out))
		}
		if s.table.hasRules() {
			return s, nil
		}
		if first == nil {
			first = &s
		}
	}
	return *first, nil
}

func (e *Executor) restore(ctx context.Context, s state, input string) error {
	if _, err := e.runner.Run(ctx, s.tools.restore, []string{"--noflush", "-w", lockWait}, []byte(input)); err != nil {
		return fmt.Errorf("%s backend: %w", s.tools.backend, err)
	}
	return nil
}

// lockNamespace takes an exclusive flock on the network namespace file at nsPath, which every
// detour-cni process working on that namespace opens, whatever path it names it by (the lock
// belongs to the namespace's inode). Apply reads the nat table and then writes what is missing,
// so two runs at once (a pod with two networks, a runtime retrying) would both add the jumps;
// under the lock the second finds them. The xtables lock the tools take covers only one write.
func lockNamespace(nsPath string) (unlock func(), err error) {
	f, err := os.Open(nsPath)
	if err != nil {
		return nil, fmt.Errorf("open network namespace %s: %w", nsPath, err)
	}
	for {
		err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX)
		if err != syscall.EINTR {
			break
		}
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("lock network namespace %s: %w", nsPath, err)
	}
	return func() { f.Close() }, nil // closing the file releases the lock
}

// Apply installs each ruleset (one per family) in the network namespace at nsPath, replacing
// whatever detour had installed there before, with one iptables-restore per family.
func (e *Executor) Apply(ctx context.Context, nsPath string, rulesets ...Ruleset) error {
	unlock, err := lockNamespace(nsPath)
	if err != nil {
		return err
	}
	defer unlock()
	if e.backend == BackendNFTables {
		want, err := nftRuleset(rulesets)
		if err != nil {
			return fmt.Errorf("apply rules in %s: %w", nsPath, err)
		}
		return nsutil.Do(nsPath, func() error {
			if err := nftApply(want); err != nil {
				return fmt.Errorf("apply %s rules in %s: %w", familyList(want.Families), nsPath, err)
			}
			return nil
		})
	}
	return nsutil.Do(nsPath, func() error {
		for _, rs := range rulesets {
			s, err := e.inspect(ctx, rs.Family)
			if err != nil {
				return fmt.Errorf("apply %s rules in %s: %w", rs.Family, nsPath, err)
			}
			if err := e.restore(ctx, s, applyInput(rs, s.table)); err != nil {
				return fmt.Errorf("apply %s rules in %s: %w", rs.Family, nsPath, err)
			}
		}
		return nil
	})
}

// Remove deletes every chain and jump of detour's for each family in the namespace at nsPath,
// from whichever backends hold them, leaving other rules alone. Removing from a namespace
// without detour's rules succeeds. The nftables backend deletes detour's whole table, whatever
// the families.
func (e *Executor) Remove(ctx context.Context, nsPath string, families ...Family) error {
	unlock, err := lockNamespace(nsPath)
	if err != nil {
		return err
	}
	defer unlock()
	if e.backend == BackendNFTables {
		return nsutil.Do(nsPath, func() error {
			if err := nftRemoveTable(); err != nil {
				return fmt.Errorf("remove rules in %s: %w", nsPath, err)
			}
			return nil
		})
	}
	return nsutil.Do(nsPath, func() error {
		for _, f := range families {
			if err := e.remove(ctx, f); err != nil {
				return fmt.Errorf("remove %s rules in %s: %w", f, nsPath, err)
			}
		}
		return nil
	})
}

// remove removes family f's rules in the current namespace. A backend without a nat table holds
// nothing. nf_tables is asked over netlink, which needs no tool; should that fail, and for the
// legacy backend, the removal of the rules as Apply installs them is tried first, which is one
// tool run in the usual case, and the table is read only when that fails.
func (e *Executor) remove(ctx context.Context, f Family) error {
	for _, t := range e.tools(f).found {
		if !natTableExists(t.backend, f) {
			continue
		}
		var netlinkErr error
		if t.backend == BackendNFT {
			if netlinkErr = nftRemove(f); netlinkErr == nil {
				continue
			}
			netlinkErr = fmt.Errorf("over netlink: %w; then with the tools", netlinkErr)
		}
		s := state{tools: t}
		if e.restore(ctx, s, installedRemoveInput()) == nil {
			continue
		}
		out, err := e.runner.Run(ctx, t.save, []string{"-t", "nat"}, nil)
		if err != nil {
			return errors.Join(netlinkErr, fmt.Errorf("read the %s nat table: %w", f, err))
		}
		if input := removeInput(parseSave(string(out))); input != "" {
			if err := e.restore(ctx, s, input); err != nil {
				return errors.Join(netlinkErr, err)
			}
		}
	}
	return nil
}

// Check compares the live rules in the namespace at nsPath with the rulesets and returns the
// first difference in words, or nil when they match.
func (e *Executor) Check(ctx context.Context, nsPath string, rulesets ...Ruleset) error {
	if e.backend == BackendNFTables {
		want, err := nftRuleset(rulesets)
		if err != nil {
			return fmt.Errorf("check rules in %s: %w", nsPath, err)
		}
		return nsutil.Do(nsPath, func() error {
			have, err := nftRead()
			if err == nil {
				err = nftDiff(want, have)
			}
			if err != nil {
				return fmt.Errorf("check %s rules in %s (nftables backend): %w", familyList(want.Families), nsPath, err)
			}
			return nil
		})
	}
	return nsutil.Do(nsPath, func() error {
		for _, rs := range rulesets {
			s, err := e.inspect(ctx, rs.Family)
			if err != nil {
				return fmt.Errorf("check %s rules in %s: %w", rs.Family, nsPath, err)
			}
			if err := diff(rs, s.table); err != nil {
				return fmt.Errorf("check rules in %s (%s backend): %w", nsPath, s.tools.backend, err)
			}
		}
		return nil
	})
}

// Save returns the nat table of family f in the namespace at nsPath as iptables-save prints it,
// from the backend detour uses there; for diagnostics and tests.
// The nftables backend returns detour's whole table in `nft list` syntax, "" when there is none.
func (e *Executor) Save(ctx context.Context, nsPath string, f Family) (string, Backend, error) {
	if e.backend == BackendNFTables {
		var text string
		err := nsutil.Do(nsPath, func() error {
			have, err := nftRead()
			switch {
			case errors.Is(err, errNoNFTTable):
				return nil
			case err != nil:
				return err
			}
			text = have.String()
			return nil
		})
		return text, BackendNFTables, err
	}
	var s state
	err := nsutil.Do(nsPath, func() (err error) {
		s, err = e.inspect(ctx, f)
		return err
	})
	return s.raw, s.tools.backend, err
}

// familyList names families for a message: "ipv4", "ipv4 and ipv6".
func familyList(fs []Family) string {
	names := make([]string, len(fs))
	for i, f := range fs {
		names[i] = f.String()
	}
	return strings.Join(names, " and ")
}
