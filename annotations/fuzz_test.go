package annotations

import (
	"reflect"
	"testing"
)

// Every parser: no panic on any input, and whatever it accepts formats back to a value it
// parses to the same thing.

func FuzzParsePorts(f *testing.F) {
	for _, s := range []string{"25", "25,3306,8000-8100", " 1 - 2 ", "0", "8100-8000", ",", "65535"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		x, err := ParsePorts(SkipOutboundPorts, s)
		if err != nil {
			return
		}
		y, err := ParsePorts(SkipOutboundPorts, FormatPorts(x))
		if err != nil || !reflect.DeepEqual(x, y) {
			t.Fatalf("ParsePorts(FormatPorts(%v)) = %v, %v", x, y, err)
		}
	})
}

func FuzzParseCIDRs(f *testing.F) {
	for _, s := range []string{"10.0.0.0/8", "fd00::/8,1.2.3.4", "::ffff:1.2.3.4/128", "fe80::1%lo", "1.2.3.4/33"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		x, err := ParseCIDRs(SkipOutboundCIDRs, s)
		if err != nil {
			return
		}
		y, err := ParseCIDRs(SkipOutboundCIDRs, FormatCIDRs(x))
		if err != nil || !reflect.DeepEqual(x, y) {
			t.Fatalf("ParseCIDRs(FormatCIDRs(%v)) = %v, %v", x, y, err)
		}
	})
}

func FuzzParseIDs(f *testing.F) {
	for _, s := range []string{"1000", "1,2,3", "0", "4294967295", "-1", " 7 "} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		x, err := ParseIDs(ExemptUIDs, s)
		if err != nil {
			return
		}
		for _, id := range x {
			if id == 0 {
				t.Fatalf("ParseIDs(%q) accepted 0", s)
			}
		}
		y, err := ParseIDs(ExemptUIDs, FormatIDs(x))
		if err != nil || !reflect.DeepEqual(x, y) {
			t.Fatalf("ParseIDs(FormatIDs(%v)) = %v, %v", x, y, err)
		}
	})
}

func FuzzParseInitEgress(f *testing.F) {
	for _, s := range []string{"*", "none", "a,b", "a,,b", "A"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		x, err := ParseInitEgress(s)
		if err != nil {
			return
		}
		y, err := ParseInitEgress(x.String())
		if err != nil || !reflect.DeepEqual(x, y) {
			t.Fatalf("ParseInitEgress(%q) = %+v, %v; want %+v", x.String(), y, err, x)
		}
	})
}

func FuzzParseRedirect(f *testing.F) {
	a := sampleRedirect().Annotations()
	f.Add(a[Injected], a[ProxyUID], a[ProxyInboundPort], a[ProxyOutboundPort], a[RedirectSkipInboundPorts],
		a[RedirectSkipOutboundPorts], a[RedirectSkipOutboundCIDRs], a[ExemptUIDs], a[ExemptGIDs])
	f.Fuzz(func(t *testing.T, version, uid, in, out, skipIn, skipOut, cidrs, uids, gids string) {
		a := map[string]string{
			Injected: version, ProxyUID: uid, ProxyInboundPort: in, ProxyOutboundPort: out,
			RedirectSkipInboundPorts: skipIn, RedirectSkipOutboundPorts: skipOut,
			RedirectSkipOutboundCIDRs: cidrs, ExemptUIDs: uids, ExemptGIDs: gids,
		}
		x, err := ParseRedirect(a)
		if err != nil {
			return
		}
		y, err := ParseRedirect(x.Annotations())
		if err != nil || !reflect.DeepEqual(x, y) {
			t.Fatalf("ParseRedirect(%v.Annotations()) = %+v, %v", x, y, err)
		}
	})
}

func FuzzParseSentinels(f *testing.F) {
	for _, s := range []string{"203.0.113.254:80", "203.0.113.254:80,[2001:db8::fe]:80", "[::ffff:1.2.3.4]:80", "127.0.0.1:80", "1.2.3.4:0", "[fe80::1%lo]:80"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		x, err := ParseSentinels(ValidatorSentinels, s)
		if err != nil {
			return
		}
		for _, ap := range x {
			if ap.Port() == 0 || ap.Addr().IsLoopback() || ap.Addr().Is4In6() {
				t.Fatalf("ParseSentinels(%q) accepted %s", s, ap)
			}
		}
		y, err := ParseSentinels(ValidatorSentinels, FormatSentinels(x))
		if err != nil || !reflect.DeepEqual(x, y) {
			t.Fatalf("ParseSentinels(FormatSentinels(%v)) = %v, %v", x, y, err)
		}
	})
}
