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

// Usable reports whether detour can write rules for family f on this node, and why not: for
// the nftables backend, whether the kernel answers nf_tables requests; for auto, that or the
// iptables tools on PATH (pods whose namespace holds legacy rules need the tools); for legacy and
// nft, their tools on PATH.
func (e *Executor) Usable(f Family) error {
	switch e.backend {
	case BackendNFTables:
		return NFTablesUsable()
	case BackendAuto:
		nftErr := NFTablesUsable()
		if nftErr == nil {
			return nil
		}
		if err := e.tools(f).err; err != nil {
			return errors.Join(nftErr, err)
		}
		return nil
	}
	return e.tools(f).err
}

// Backend returns the backend the Executor was configured with (auto unless pinned).
func (e *Executor) Backend() Backend { return e.backend }

// pick is the backend for the calling thread's network namespace: the pinned one, or auto's
// choice there (BackendAuto standing for the iptables tools). Call it inside nsutil.Do.
func (e *Executor) pick(families ...Family) Backend {
	if e.backend != BackendAuto {
		return e.backend
	}
	return autoChoice(families)
}

// rulesetFamilies are the families of rulesets, in order.
func rulesetFamilies(rulesets []Ruleset) []Family {
	fs := make([]Family, len(rulesets))
	for i, rs := range rulesets {
		fs[i] = rs.Family
	}
	return fs
}

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
// whatever detour had installed there before: with the nftables backend one netlink
// transaction for all families, with the iptables tools one iptables-restore per family.
func (e *Executor) Apply(ctx context.Context, nsPath string, rulesets ...Ruleset) error {
	unlock, err := lockNamespace(nsPath)
	if err != nil {
		return err
	}
	defer unlock()
	return nsutil.Do(nsPath, func() error {
		if e.pick(rulesetFamilies(rulesets)...) == BackendNFTables {
			want, err := nftRuleset(rulesets)
			if err == nil {
				err = nftApply(want)
			}
			if err != nil {
				return fmt.Errorf("apply %s rules in %s (nftables backend): %w", familyList(rulesetFamilies(rulesets)), nsPath, err)
			}
			return nil
		}
		for _, rs := range rulesets {
			s, err := e.inspect(ctx, rs.Family)
			if err != nil {
				return fmt.Errorf("apply %s rules in %s: %w", rs.Family, nsPath, err)
			}
			if err := e.restore(ctx, s, applyInput(rs, s.table)); err != nil {
				if nsutil.OwnUserNamespace(nsPath) {
					err = fmt.Errorf("%w; the pod's network namespace belongs to its own user namespace (hostUsers: false), where the kernel refuses iptables' owner matches written from the host: set iptablesBackend to auto or nftables", err)
				}
				return fmt.Errorf("apply %s rules in %s: %w", rs.Family, nsPath, err)
			}
		}
		return nil
	})
}

// Remove deletes detour's rules in the namespace at nsPath, whatever the configured backend
// and whichever wrote them — detour's nftables table, and its chains and jumps of each family in
// the nat tables of both iptables backends — leaving other rules alone, so a pod set up before
// the node changed backends is cleaned too. Removing from a namespace without detour's rules
// succeeds.
func (e *Executor) Remove(ctx context.Context, nsPath string, families ...Family) error {
	unlock, err := lockNamespace(nsPath)
	if err != nil {
		return err
	}
	defer unlock()
	return nsutil.Do(nsPath, func() error {
		// One dump answers for detour's table and both families' iptables-nft nat tables; a
		// kernel that does not answer has no nf_tables rules to remove (its tools may still).
		tables, listErr := nftTables()
		if tables[detourTable] {
			if err := nftDeleteTable(); err != nil {
				return fmt.Errorf("remove rules in %s: %w", nsPath, err)
			}
		}
		for _, f := range families {
			if err := e.remove(ctx, f, tables, listErr); err != nil {
				return fmt.Errorf("remove %s rules in %s: %w", f, nsPath, err)
			}
		}
		return nil
	})
}

// remove removes family f's iptables rules in the current namespace. A backend without a nat
// table holds nothing. nf_tables is asked over netlink, which needs no tool; should that fail,
// and for the legacy backend, the removal of the rules as Apply installs them is tried first,
// which is one tool run in the usual case, and the table is read only when that fails. Without
// the legacy tools the legacy table cannot be read, and nothing of detour's can be in it on a
// node that never had them.
func (e *Executor) remove(ctx context.Context, f Family, tables map[nfTable]bool, listErr error) error {
	for _, b := range []Backend{BackendNFT, BackendLegacy} {
		var netlinkErr error
		if b == BackendNFT {
			switch {
			case listErr == nil && !tables[nfTable{nftFamily(f), "nat"}]:
				continue
			case listErr == nil:
				if netlinkErr = nftRemove(f); netlinkErr == nil {
					continue
				}
				netlinkErr = fmt.Errorf("over netlink: %w; then with the tools", netlinkErr)
			}
			// listErr != nil: the kernel does not answer nf_tables requests; its tools may.
		} else if !natTableExists(b, f) {
			continue
		}
		t, err := lookupTools(b, f)
		if err != nil {
			if netlinkErr != nil {
				return errors.Join(netlinkErr, err)
			}
			continue
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
	return nsutil.Do(nsPath, func() error {
		if e.pick(rulesetFamilies(rulesets)...) == BackendNFTables {
			want, err := nftRuleset(rulesets)
			if err == nil {
				var have NFTRuleset
				if have, err = nftRead(); err == nil {
					err = nftDiff(want, have)
				}
			}
			if err != nil {
				return fmt.Errorf("check %s rules in %s (nftables backend): %w", familyList(rulesetFamilies(rulesets)), nsPath, err)
			}
			return nil
		}
		for _, rs := range rulesets {
			s, err := e.inspect(ctx, rs.Family)
			if err != nil {
				return fmt.Errorf("check %s rules in %s: %w", rs.Family, nsPath, err)
			}
			if err := diff(rs, s.table); err != nil {
				return fmt.Errorf("check %s rules in %s (%s backend): %w", rs.Family, nsPath, s.tools.backend, err)
			}
		}
		return nil
	})
}

// Save returns the nat table of family f in the namespace at nsPath as iptables-save prints it,
// from the backend detour uses there; for diagnostics and tests.
// The nftables backend returns detour's whole table in `nft list` syntax, "" when there is none.
func (e *Executor) Save(ctx context.Context, nsPath string, f Family) (text string, backend Backend, err error) {
	err = nsutil.Do(nsPath, func() error {
		if e.pick(f) == BackendNFTables {
			backend = BackendNFTables
			have, err := nftRead()
			switch {
			case errors.Is(err, errNoNFTTable):
				return nil
			case err != nil:
				return err
			}
			text = have.String()
			return nil
		}
		s, err := e.inspect(ctx, f)
		text, backend = s.raw, s.tools.backend
		return err
	})
	return text, backend, err
}

// familyList names families for a message: "ipv4", "ipv4 and ipv6".
func familyList(fs []Family) string {
	names := make([]string, len(fs))
	for i, f := range fs {
		names[i] = f.String()
	}
	return strings.Join(names, " and ")
}
