package iptables

import (
	"fmt"
	"slices"
	"strings"
)

// table is the part of an iptables-save dump of the nat table that detour cares about.
type table struct {
	chains map[string]bool // every chain declared, built-in or not
	rules  []Rule          // every rule, in the order printed
}

// parseSave reads iptables-save output of the nat table.
func parseSave(out string) table {
	t := table{chains: map[string]bool{}}
	inNat := false
	for line := range strings.Lines(out) {
		line = strings.TrimRight(line, "\n")
		switch {
		case strings.HasPrefix(line, "*"):
			inNat = line == "*nat"
		case !inNat:
		case strings.HasPrefix(line, ":"):
			name, _, _ := strings.Cut(line[1:], " ")
			t.chains[name] = true
		case strings.HasPrefix(line, "-A "):
			chain, spec, _ := strings.Cut(line[3:], " ")
			t.rules = append(t.rules, Rule{Chain: chain, Spec: spec})
		}
	}
	return t
}

// hasRules reports whether the dump holds any rule at all, detour's or anyone's.
func (t table) hasRules() bool { return len(t.rules) > 0 }

// ours reports whether the dump holds any trace of detour: its chains or a jump to them.
func (t table) ours() bool {
	for _, c := range Chains() {
		if t.chains[c] {
			return true
		}
	}
	return slices.ContainsFunc(t.rules, refersToOurs)
}

// refersToOurs reports whether r, a rule of another chain, jumps or goes to one of detour's
// chains: detour's hooks, or a rule someone else added. Removing detour's chains removes it too,
// as the kernel refuses to delete a chain that is still referred to.
func refersToOurs(r Rule) bool {
	if slices.Contains(Chains(), r.Chain) {
		return false
	}
	for _, c := range Chains() {
		if strings.HasSuffix(r.Spec, " -j "+c) || strings.HasSuffix(r.Spec, " -g "+c) || r.Spec == "-j "+c || r.Spec == "-g "+c {
			return true
		}
	}
	return false
}

func (t table) count(r Rule) int {
	n := 0
	for _, have := range t.rules {
		if have == r {
			n++
		}
	}
	return n
}

// applyInput is the iptables-restore --noflush input that turns t into a table holding rs and
// nothing else of detour's: its chains are declared (and so flushed) and refilled, and only the
// hooks t lacks are added, so applying twice changes nothing.
func applyInput(rs Ruleset, t table) string {
	var b strings.Builder
	b.WriteString("*nat\n")
	for _, c := range Chains() {
		b.WriteString(":" + c + " - [0:0]\n")
	}
	for _, h := range rs.Hooks {
		if t.count(h) == 0 {
			b.WriteString(h.String() + "\n")
		}
	}
	for _, r := range rs.Rules {
		b.WriteString(r.String() + "\n")
	}
	b.WriteString("COMMIT\n")
	return b.String()
}

// removeInput is the iptables-restore --noflush input that deletes every rule that jumps or
// goes to detour's chains and then the chains; empty when t holds nothing of detour's.
func removeInput(t table) string {
	if !t.ours() {
		return ""
	}
	var b strings.Builder
	b.WriteString("*nat\n")
	for _, r := range t.rules {
		if refersToOurs(r) {
			b.WriteString("-D " + r.Chain + " " + r.Spec + "\n")
		}
	}
	for _, c := range Chains() {
		if t.chains[c] {
			b.WriteString("-F " + c + "\n-X " + c + "\n")
		}
	}
	b.WriteString("COMMIT\n")
	return b.String()
}

// installedRemoveInput is the removal input for a table that holds detour's rules exactly as
// Apply leaves them: each jump once and both chains. Restore applies it all or nothing, so
// trying it on any other table changes nothing.
func installedRemoveInput() string {
	t := table{chains: map[string]bool{InboundChain: true, OutboundChain: true}, rules: hooks()}
	return removeInput(t)
}

// diff compares the live table with rs and describes the first difference in words, or returns
// nil when the table holds exactly rs's hooks (once each) and chain rules (in order).
func diff(rs Ruleset, t table) error {
	fam := rs.Family.String()
	for _, h := range rs.Hooks {
		switch n := t.count(h); {
		case n == 0:
			return fmt.Errorf("%s nat table: the jump %q is missing", fam, h.String())
		case n > 1:
			return fmt.Errorf("%s nat table: the jump %q is there %d times, expected once", fam, h.String(), n)
		}
	}
	for _, chain := range Chains() {
		if !t.chains[chain] {
			return fmt.Errorf("%s nat table: chain %s is missing", fam, chain)
		}
		want := rulesOf(rs.Rules, chain)
		have := rulesOf(t.rules, chain)
		for i := range max(len(want), len(have)) {
			switch {
			case i < len(have) && i < len(want) && want[i] == have[i]:
			case i < len(want) && (i >= len(have) || !slices.Contains(have, want[i])):
				return fmt.Errorf("%s nat table: chain %s lacks rule %d, %q", fam, chain, i+1, want[i].String())
			case i >= len(want) || !slices.Contains(want, have[i]):
				return fmt.Errorf("%s nat table: chain %s has an unexpected rule %d, %q", fam, chain, i+1, have[i].String())
			default:
				return fmt.Errorf("%s nat table: chain %s rule %d is %q, expected %q (rules out of order)", fam, chain, i+1, have[i].String(), want[i].String())
			}
		}
	}
	return nil
}

func rulesOf(rules []Rule, chain string) []Rule {
	var out []Rule
	for _, r := range rules {
		if r.Chain == chain {
			out = append(out, r)
		}
	}
	return out
}
