package annotations

import (
	"fmt"
	"slices"
	"strings"
)

// maxUnknownListed bounds how many unknown keys [Unknown] names.
const maxUnknownListed = 8

// Unknown describes the detour.dev/ keys of m that no part of detour reads — typically a
// misspelt user key, whose setting then silently does not apply — each with the user key it
// was probably meant to be, e.g. `detour.dev/skip-outbound-port (did you mean
// detour.dev/skip-outbound-ports?)`; "" when there are none. It names at most 8 keys, in sorted
// order, and says how many more there are.
func Unknown(m map[string]string) string {
	var unknown []string
	for k := range m {
		if strings.HasPrefix(k, Prefix) && !known(k) {
			unknown = append(unknown, k)
		}
	}
	if len(unknown) == 0 {
		return ""
	}
	slices.Sort(unknown)
	var parts []string
	for _, k := range unknown[:min(len(unknown), maxUnknownListed)] {
		part := Quote(k)
		if s := suggest(k); s != "" {
			part += " (did you mean " + s + "?)"
		}
		parts = append(parts, part)
	}
	if n := len(unknown) - maxUnknownListed; n > 0 {
		parts = append(parts, fmt.Sprintf("and %d more", n))
	}
	return strings.Join(parts, ", ")
}

func known(k string) bool {
	return k == RecreateRequired || k == InboundFallback || slices.Contains(userKeys, k) || slices.Contains(WebhookKeys, k)
}

// suggest returns the user key closest to k (at most 3 edits between the names after the
// prefix), or "".
func suggest(k string) string {
	name := strings.TrimPrefix(k, Prefix)
	if len(name) > 64 {
		return ""
	}
	best, bestDist := "", 4
	for _, u := range userKeys {
		if d := editDistance(name, strings.TrimPrefix(u, Prefix)); d < bestDist {
			best, bestDist = u, d
		}
	}
	return best
}

// editDistance is the Levenshtein distance between a and b, by bytes.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
