package annotations

import (
	"strings"
	"testing"
)

func TestQuote(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"smtp", `"smtp"`},
		{strings.Repeat("a", 64), `"` + strings.Repeat("a", 64) + `"`},
		{strings.Repeat("a", 65), `"` + strings.Repeat("a", 64) + `…" (65 bytes in all)`},
		// A cut inside a multi-byte character moves back to the character's start.
		{strings.Repeat("a", 63) + "é" + "b", `"` + strings.Repeat("a", 63) + `…" (66 bytes in all)`},
	} {
		if got := Quote(tc.in); got != tc.want {
			t.Errorf("Quote(%q) = %s, want %s", tc.in, got, tc.want)
		}
	}
}

// A 1 MiB value is denied with a message of a line, not of a mebibyte.
func TestErrorShortensLongValues(t *testing.T) {
	_, err := ParseInjectMode(strings.Repeat("x", 1<<20))
	if err == nil {
		t.Fatal("a 1 MiB inject value parsed")
	}
	if msg := err.Error(); len(msg) > 250 || !strings.Contains(msg, "(1048576 bytes in all)") || !strings.Contains(msg, `use "enabled" or "disabled"`) {
		t.Errorf("message %.300s... (%d bytes), want the value shortened and the rule", msg, len(msg))
	}
	_, err = ParsePorts(SkipOutboundPorts, strings.Repeat("1,", 1<<19))
	if err == nil || len(err.Error()) > 250 || !strings.Contains(err.Error(), "at most 64 items") {
		t.Errorf("ParsePorts of 512 Ki items: %.300s", err)
	}
}
