package annotations

import (
	"strings"
	"testing"
)

func TestUnknown(t *testing.T) {
	many := map[string]string{}
	for _, c := range "abcdefghij" {
		many[Prefix+"zz-"+string(c)] = ""
	}
	for _, tc := range []struct {
		name string
		m    map[string]string
		want string
	}{
		{"none", nil, ""},
		{"known keys of every writer", map[string]string{Inject: "enabled", ExemptUIDs: "1000", RecreateRequired: "x", "example.com/a": "b"}, ""},
		{"a misspelt user key", map[string]string{Prefix + "skip-outbound-port": "25", Inject: "enabled"},
			`"detour.dev/skip-outbound-port" (did you mean detour.dev/skip-outbound-ports?)`},
		{"a typo in inject", map[string]string{Prefix + "injet": "enabled"}, `"detour.dev/injet" (did you mean detour.dev/inject?)`},
		{"nothing close", map[string]string{Prefix + "proxy-image": "x"}, `"detour.dev/proxy-image"`},
		{"a webhook key's typo suggests no webhook key", map[string]string{Prefix + "exempt-uid": "1000"}, `"detour.dev/exempt-uid"`},
		{"at most 8", many, `"detour.dev/zz-a", "detour.dev/zz-b", "detour.dev/zz-c", "detour.dev/zz-d", "detour.dev/zz-e", "detour.dev/zz-f", "detour.dev/zz-g", "detour.dev/zz-h", and 2 more`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := Unknown(tc.m); got != tc.want {
				t.Errorf("Unknown(%v) = %s, want %s", tc.m, got, tc.want)
			}
		})
	}
}

func TestUnknownLongKey(t *testing.T) {
	got := Unknown(map[string]string{Prefix + strings.Repeat("k", 1<<20): ""})
	if len(got) > 200 || !strings.Contains(got, "bytes in all") {
		t.Errorf("Unknown of a 1 MiB key = %.300s (%d bytes), want it shortened", got, len(got))
	}
}
