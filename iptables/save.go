package iptables

import (
	"fmt"
	"slices"
	"strconv"
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

// DiffError is how the live rules differ from the wanted ones: [Executor.Check]'s error when
// it could read them, the first difference in words.
type DiffError struct {
	// Missing is true when a part the redirect cannot work without is absent: detour's
	// nf_tables table, one of its chains, a jump into them, or a chain's redirect to a proxy
	// port. False means the rules differ in ways a release that installs other rules may
	// explain: a rule more or less, another form, another order.
	Missing bool
	msg     string
}

func (e *DiffError) Error() string { return e.msg }

// missing and differs make DiffErrors.
func missing(format string, args ...any) error {
	return &DiffError{Missing: true, msg: fmt.Sprintf(format, args...)}
}

func differs(format string, args ...any) error {
	return &DiffError{msg: fmt.Sprintf(format, args...)}
}

// chainDiff is compareChain's difference between a chain's wanted and live rules as a
// DiffError, prefix before its words: Missing when a redirect the chain should make is made by
// none of its live rules — none with the same verdict and the same detour/... comment, which
// says what the rule is for (the main outbound redirect and the validator's sentinel both go to
// the outbound port).
func chainDiff(prefix, chain string, want, have []chainRule) error {
	msg := compareChain(chain, want, have)
	if msg == "" {
		return nil
	}
	for _, w := range want {
		same := func(h chainRule) bool { return h.verdict == w.verdict && ruleComment(h.text) == ruleComment(w.text) }
		if isRedirect(w.verdict) && !slices.ContainsFunc(have, same) {
			return missing("%s%s (no rule of chain %s makes the %s redirect)", prefix, msg, chain, ruleComment(w.text))
		}
	}
	return differs("%s%s", prefix, msg)
}

// ruleComment is the detour/... comment in a rule's text, "" when it has none.
func ruleComment(text string) string {
	i := strings.Index(text, `"detour/`)
	if i < 0 {
		return ""
	}
	rest := text[i+1:]
	if j := strings.IndexByte(rest, '"'); j >= 0 {
		return rest[:j]
	}
	return rest
}

// isRedirect reports whether a rule's verdict sends the packet to a port of the pod: iptables'
// "-j REDIRECT --to-ports N", nftables' "redirect to :N".
func isRedirect(verdict string) bool {
	return strings.Contains(verdict, "-j REDIRECT") || strings.Contains(verdict, "redirect to")
}

// diff compares the live table with rs and describes the first difference in words, or returns
// nil when the table holds rs's hooks (once each) and chain rules that do what rs's do (see
// compareChain).
func diff(rs Ruleset, t table) error {
	fam := rs.Family.String()
	for _, h := range rs.Hooks {
		switch n := t.count(h); {
		case n == 0:
			return missing("%s nat table: the jump %q is missing", fam, h.String())
		case n > 1:
			return differs("%s nat table: the jump %q is there %d times, expected once", fam, h.String(), n)
		}
	}
	for _, chain := range Chains() {
		if !t.chains[chain] {
			return missing("%s nat table: chain %s is missing", fam, chain)
		}
		if err := chainDiff(fam+" nat table: ", chain, chainRules(rulesOf(rs.Rules, chain)), chainRules(rulesOf(t.rules, chain))); err != nil {
			return err
		}
	}
	return nil
}

// chainRules are rules as compareChain sees them: their text, and their target as the verdict.
func chainRules(rules []Rule) []chainRule {
	out := make([]chainRule, len(rules))
	for i, r := range rules {
		out[i] = chainRule{text: r.String(), verdict: r.Spec}
		if j := strings.LastIndex(" "+r.Spec, " -j "); j >= 0 {
			out[i].verdict = r.Spec[j:]
		}
	}
	return out
}

// chainRule is one rule of a chain as CHECK compares it: its text, and what it does to a packet
// it matches (its verdict: RETURN, a REDIRECT to a port).
type chainRule struct{ text, verdict string }

// compareChain compares the live rules of a chain with the wanted ones by what they do, not by
// one release's byte order: first match wins, so rules that end in the same verdict may come in
// any order among themselves as long as no rule with another verdict stands between them. The
// rules are cut into runs of one verdict; the runs must follow each other in the same order,
// each holding the same rules (as a multiset). A pod whose rules an older detour installed in
// another order of its exemptions or skip lists thus passes CHECK after an upgrade; where an
// order does change what a packet meets (a sentinel redirect before or after a RETURN), the
// ruleset for that pod is built as it was (Build reads what the pod's annotations ask for).
// It returns the first difference in words, "" when there is none.
func compareChain(chain string, want, have []chainRule) string {
	wantRuns, haveRuns := runs(want), runs(have)
	pos := 0 // index in want and have of the current runs' first rules
	for i := range max(len(wantRuns), len(haveRuns)) {
		var w, h []chainRule
		if i < len(wantRuns) {
			w = wantRuns[i]
		}
		if i < len(haveRuns) {
			h = haveRuns[i]
		}
		if sameRules(w, h) {
			pos += len(w)
			continue
		}
		for k, r := range w {
			if countText(h, r.text) < countText(w, r.text) && countText(have, r.text) < countText(want, r.text) {
				return fmt.Sprintf("chain %s lacks rule %d, %q", chain, pos+k+1, r.text)
			}
		}
		for k, r := range h {
			if countText(have[:pos+k+1], r.text) > countText(want, r.text) {
				return fmt.Sprintf("chain %s has an unexpected rule %d, %q", chain, pos+k+1, r.text)
			}
		}
		for k := pos; ; k++ {
			if k >= len(have) || k >= len(want) || have[k].text != want[k].text {
				got, expected := "nothing", "nothing"
				if k < len(have) {
					got = strconv.Quote(have[k].text)
				}
				if k < len(want) {
					expected = strconv.Quote(want[k].text)
				}
				return fmt.Sprintf("chain %s rule %d is %s, expected %s (rules out of order)", chain, k+1, got, expected)
			}
		}
	}
	return ""
}

// runs cuts rules into maximal runs of one verdict.
func runs(rules []chainRule) [][]chainRule {
	var out [][]chainRule
	for i, r := range rules {
		if i == 0 || r.verdict != rules[i-1].verdict {
			out = append(out, nil)
		}
		out[len(out)-1] = append(out[len(out)-1], r)
	}
	return out
}

// sameRules reports whether two runs hold the same rules, in any order, with one verdict.
func sameRules(a, b []chainRule) bool {
	if len(a) != len(b) || len(a) > 0 && a[0].verdict != b[0].verdict {
		return false
	}
	for _, r := range a {
		if countText(a, r.text) != countText(b, r.text) {
			return false
		}
	}
	return true
}

func countText(rules []chainRule, text string) int {
	n := 0
	for _, r := range rules {
		if r.text == text {
			n++
		}
	}
	return n
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
