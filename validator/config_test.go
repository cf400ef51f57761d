package validator

import "testing"

// A sentinel is accepted only as a unicast address of the asked family, outside the pod, with
// a port; it prints back as what was parsed, and nothing panics.
func FuzzParseSentinel(f *testing.F) {
	for _, s := range []string{DefaultSentinel, DefaultSentinel6, "127.0.0.1:80", "[::ffff:10.0.0.1]:80", "10.0.0.1:0", "[fe80::1%eth0]:80", "x"} {
		f.Add(s, false)
		f.Add(s, true)
	}
	f.Fuzz(func(t *testing.T, value string, six bool) {
		ap, rule := ParseSentinel(value, six)
		if rule != "" {
			return
		}
		a := ap.Addr()
		if a.Is4() == six || a.Is4In6() || a.IsLoopback() || a.IsUnspecified() || a.IsMulticast() || a.Zone() != "" || ap.Port() == 0 {
			t.Fatalf("accepted %q (six %v) as %s", value, six, ap)
		}
		if again, rule := ParseSentinel(ap.String(), six); rule != "" || again != ap {
			t.Fatalf("%s does not parse back: %s, %q", ap, again, rule)
		}
	})
}
