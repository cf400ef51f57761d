package annotations

import (
	"errors"
	"net/netip"
	"reflect"
	"strings"
	"testing"
)

func TestParsePorts(t *testing.T) {
	for _, tc := range []struct {
		in      string
		want    []PortRange
		wantErr string // substring of the error; empty means success
	}{
		{in: "", want: nil},
		{in: "  ", want: nil},
		{in: "25", want: []PortRange{{25, 25}}},
		{in: "25,3306,8000-8100", want: []PortRange{{25, 25}, {3306, 3306}, {8000, 8100}}},
		{in: " 25 , 8000 - 8100 ", want: []PortRange{{25, 25}, {8000, 8100}}},
		{in: "1,65535", want: []PortRange{{1, 1}, {65535, 65535}}},
		{in: "7-7", want: []PortRange{{7, 7}}},
		{in: "0", wantErr: `"0" is not valid: ports are whole numbers from 1 to 65535`},
		{in: "65536", wantErr: `"65536" is not valid`},
		{in: "-1", wantErr: `"-1" is not valid`},
		{in: "+5", wantErr: `"+5" is not valid`},
		{in: "http", wantErr: `"http" is not valid`},
		{in: "8100-8000", wantErr: "write it as 8000-8100"},
		{in: "1-2-3", wantErr: `"1-2-3" is not valid`},
		{in: "25,,26", wantErr: "empty item"},
		{in: "25,", wantErr: "empty item"},
		{in: strings.Repeat("1,", MaxListItems) + "1", wantErr: "at most 64 items"},
	} {
		got, err := ParsePorts(SkipOutboundPorts, tc.in)
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("ParsePorts(%q) error = %v, want one containing %q", tc.in, err, tc.wantErr)
			}
			if err != nil && !strings.HasPrefix(err.Error(), "annotation detour.dev/skip-outbound-ports: ") {
				t.Errorf("ParsePorts(%q) error %q does not name the annotation", tc.in, err)
			}
			continue
		}
		if err != nil || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("ParsePorts(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
}

func TestParseCIDRs(t *testing.T) {
	for _, tc := range []struct {
		in      string
		want    []string
		wantErr string
	}{
		{in: "", want: nil},
		{in: "10.0.0.0/8", want: []string{"10.0.0.0/8"}},
		{in: "10.0.0.0/8, fd00::/8,192.168.1.7", want: []string{"10.0.0.0/8", "fd00::/8", "192.168.1.7/32"}},
		{in: "2001:db8::1", want: []string{"2001:db8::1/128"}},
		{in: "0.0.0.0/0,::/0", want: []string{"0.0.0.0/0", "::/0"}},
		{in: "10.0.0.1/8", wantErr: "write the network as 10.0.0.0/8"},
		{in: "10.0.0.0/33", wantErr: "a CIDR is an IPv4 or IPv6 network"},
		{in: "fe80::1%eth0", wantErr: "zoned addresses are not allowed"},
		{in: "example.com", wantErr: `"example.com" is not valid`},
		{in: "10.0.0.0/8,,", wantErr: "empty item"},
		// IPv4-mapped IPv6 addresses would reach only the IPv6 rules, so the IPv4 traffic they
		// name would stay redirected.
		{in: "::ffff:169.254.169.254", wantErr: "IPv4-mapped IPv6 addresses reach only the IPv6 rules, so the IPv4 traffic they name would still be redirected; write the IPv4 address 169.254.169.254"},
		{in: "::ffff:10.0.0.0/104", wantErr: "write the IPv4 network 10.0.0.0/8"},
		{in: "::ffff:0:0/96", wantErr: "write the IPv4 network 0.0.0.0/0"},
		{in: "::/0", want: []string{"::/0"}},
	} {
		got, err := ParseCIDRs(SkipOutboundCIDRs, tc.in)
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("ParseCIDRs(%q) error = %v, want one containing %q", tc.in, err, tc.wantErr)
			}
			continue
		}
		var s []string
		for _, p := range got {
			s = append(s, p.String())
		}
		if err != nil || !reflect.DeepEqual(s, tc.want) {
			t.Errorf("ParseCIDRs(%q) = %v, %v; want %v", tc.in, s, err, tc.want)
		}
	}
}

func TestParseIDs(t *testing.T) {
	for _, tc := range []struct {
		in      string
		want    []uint32
		wantErr bool
	}{
		{in: "", want: nil},
		{in: "1000", want: []uint32{1000}},
		{in: "1000, 2601,4294967294", want: []uint32{1000, 2601, 4294967294}},
		{in: "0", wantErr: true},
		{in: "4294967295", wantErr: true},
		{in: "4294967296", wantErr: true},
		{in: "-5", wantErr: true},
		{in: "root", wantErr: true},
		{in: "0x10", wantErr: true},
	} {
		got, err := ParseIDs(ExemptUIDs, tc.in)
		if tc.wantErr {
			var e *Error
			if !errors.As(err, &e) || e.Key != ExemptUIDs || !strings.Contains(e.Rule, "0, root, is never exempt") {
				t.Errorf("ParseIDs(%q) error = %v, want an *Error naming %s and the rule", tc.in, err, ExemptUIDs)
			}
			continue
		}
		if err != nil || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("ParseIDs(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
}

func TestParseInitEgress(t *testing.T) {
	for _, tc := range []struct {
		in      string
		want    InitEgressSelection
		wantErr bool
	}{
		{in: "*", want: InitEgressSelection{All: true}},
		{in: " none ", want: InitEgressSelection{}},
		{in: "migrate", want: InitEgressSelection{Names: []string{"migrate"}}},
		{in: "migrate, fetch,migrate", want: InitEgressSelection{Names: []string{"fetch", "migrate"}}},
		{in: "", wantErr: true},
		{in: "Migrate", wantErr: true},
		{in: "a,*", wantErr: true},
		{in: "-a", wantErr: true},
		{in: strings.Repeat("a", 64), wantErr: true},
	} {
		got, err := ParseInitEgress(tc.in)
		if tc.wantErr != (err != nil) || !tc.wantErr && !reflect.DeepEqual(got, tc.want) {
			t.Errorf("ParseInitEgress(%q) = %+v, %v; want %+v (error: %v)", tc.in, got, err, tc.want, tc.wantErr)
		}
	}
	sel, _ := ParseInitEgress("fetch,migrate")
	if !sel.Selects("fetch") || sel.Selects("other") {
		t.Errorf("selection %v selects the wrong containers", sel)
	}
}

func TestParseModes(t *testing.T) {
	if m, err := ParseInjectMode("enabled"); err != nil || m != InjectEnabled {
		t.Errorf("ParseInjectMode(enabled) = %q, %v", m, err)
	}
	if _, err := ParseInjectMode("true"); err == nil || !strings.Contains(err.Error(), `use "enabled" or "disabled"`) {
		t.Errorf("ParseInjectMode(true) error = %v", err)
	}
	if m, err := ParseSidecarMode("native"); err != nil || m != SidecarNative {
		t.Errorf("ParseSidecarMode(native) = %q, %v", m, err)
	}
	if _, err := ParseSidecarMode("sidecar"); err == nil || !strings.Contains(err.Error(), SidecarMode) {
		t.Errorf("ParseSidecarMode(sidecar) error = %v", err)
	}
	if m, err := ParseStartGate(" hook "); err != nil || m != StartGateHook {
		t.Errorf("ParseStartGate(hook) = %q, %v", m, err)
	}
	if _, err := ParseStartGate("postStart"); err == nil || !strings.Contains(err.Error(), ProxyStartGate) || !strings.Contains(err.Error(), `use "auto", "probe" or "hook"`) {
		t.Errorf("ParseStartGate(postStart) error = %v", err)
	}
}

func sampleRedirect() Redirect {
	return Redirect{
		Version:           "v0.1.0",
		ProxyUID:          2102,
		InboundPort:       4143,
		OutboundPort:      4140,
		SkipInboundPorts:  []PortRange{{4190, 4191}},
		SkipOutboundPorts: []PortRange{{25, 25}, {8000, 8100}},
		SkipOutboundCIDRs: []netip.Prefix{netip.MustParsePrefix("10.96.0.0/12"), netip.MustParsePrefix("fd00::/8")},
		ExemptUIDs:        []uint32{1000},
		ExemptGIDs:        []uint32{2601},
		Sentinels:         []netip.AddrPort{netip.MustParseAddrPort("203.0.113.254:80"), netip.MustParseAddrPort("[2001:db8::fe]:80")},
		CheckPort:         4142,
		InboundListening:  true,
	}
}

func TestRedirectRoundTrip(t *testing.T) {
	r := sampleRedirect()
	a := r.Annotations()
	if a[SkipOutboundPorts] != "" || a[RedirectSkipOutboundPorts] != "25,8000-8100" || a[ExemptGIDs] != "2601" ||
		a[ValidatorSentinels] != "203.0.113.254:80,[2001:db8::fe]:80" {
		t.Fatalf("Annotations() = %v", a)
	}
	got, err := ParseRedirect(a)
	if err != nil || !reflect.DeepEqual(got, r) {
		t.Fatalf("ParseRedirect(Annotations()) = %+v, %v; want %+v", got, err, r)
	}

	if a[ValidatorCheckPort] != "4142" || a[RedirectInbound] != "listening" {
		t.Errorf("Annotations() = %v, want the check port and the inbound capture", a)
	}

	// Empty lists are left out; the inbound capture is always written, so that a pod without it
	// is one injected before it existed.
	empty := Redirect{Version: "dev", ProxyUID: 7, InboundPort: 1, OutboundPort: 2}
	if a := empty.Annotations(); len(a) != 5 || a[RedirectInbound] != "all" {
		t.Errorf("empty lists should be left out and the capture written, got %v", a)
	}
	// A pod injected before the key existed had every inbound connection redirected.
	delete(a, RedirectInbound)
	if got, err := ParseRedirect(a); err != nil || got.InboundListening {
		t.Errorf("ParseRedirect without %s = %+v, %v; want every inbound connection redirected", RedirectInbound, got, err)
	}
	a[RedirectInbound] = "some"
	if _, err := ParseRedirect(a); err == nil || !strings.Contains(err.Error(), RedirectInbound) {
		t.Errorf("ParseRedirect with %s=some: %v, want an error naming the key", RedirectInbound, err)
	}
}

func TestParseRedirectErrors(t *testing.T) {
	for _, tc := range []struct {
		name    string
		mutate  func(map[string]string)
		wantKey string
		wantMsg string
	}{
		{"not injected", func(a map[string]string) { delete(a, Injected) }, Injected, "not injected"},
		{"bad version", func(a map[string]string) { a[Injected] = "v 1" }, Injected, "without spaces"},
		{"missing proxy uid", func(a map[string]string) { delete(a, ProxyUID) }, ProxyUID, `"<missing>"`},
		{"root proxy uid", func(a map[string]string) { a[ProxyUID] = "0" }, ProxyUID, "never exempt"},
		{"bad inbound port", func(a map[string]string) { a[ProxyInboundPort] = "99999" }, ProxyInboundPort, "1 to 65535"},
		{"bad outbound port", func(a map[string]string) { delete(a, ProxyOutboundPort) }, ProxyOutboundPort, "<missing>"},
		{"bad skip ports", func(a map[string]string) { a[RedirectSkipOutboundPorts] = "25,x" }, RedirectSkipOutboundPorts, `"x"`},
		{"bad skip inbound", func(a map[string]string) { a[RedirectSkipInboundPorts] = "9-1" }, RedirectSkipInboundPorts, "1-9"},
		{"bad cidr", func(a map[string]string) { a[RedirectSkipOutboundCIDRs] = "10.1.0.0/8" }, RedirectSkipOutboundCIDRs, "10.0.0.0/8"},
		{"root uid", func(a map[string]string) { a[ExemptUIDs] = "1000,0" }, ExemptUIDs, `"0"`},
		{"root gid", func(a map[string]string) { a[ExemptGIDs] = "0" }, ExemptGIDs, "never exempt"},
		{"sentinel without port", func(a map[string]string) { a[ValidatorSentinels] = "203.0.113.254" }, ValidatorSentinels, "such as 203.0.113.254:80"},
		{"loopback sentinel", func(a map[string]string) { a[ValidatorSentinels] = "127.0.0.1:80" }, ValidatorSentinels, "outside the pod"},
		{"sentinel port 0", func(a map[string]string) { a[ValidatorSentinels] = "[2001:db8::fe]:0" }, ValidatorSentinels, "and a port"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := sampleRedirect().Annotations()
			tc.mutate(a)
			_, err := ParseRedirect(a)
			var e *Error
			if !errors.As(err, &e) || e.Key != tc.wantKey || !strings.Contains(err.Error(), tc.wantMsg) {
				t.Fatalf("ParseRedirect error = %v; want an error naming %s and containing %q", err, tc.wantKey, tc.wantMsg)
			}
		})
	}
}
