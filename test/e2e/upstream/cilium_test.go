package upstream

import (
	"strings"
	"testing"
)

// From the with-detour run of "should allow egress access to server in CIDR block" on
// 2026-12-06 (netpol-cilium, cilium-dbg monitor on e2e-node-b): the client x/a (10.88.1.188)
// dials y/b (10.88.1.56, identity 36997; the policy's CIDR 10.88.1.56/32 got the CIDR identity
// 16777218) and y/a (10.88.0.69, identity 62088) through its proxy; Cilium denies both, judging
// each server by its pod's identity.
const ciliumMonitorLog = `Press Ctrl-C to quit
time=2026-12-06T22:29:06.618063617Z level=info msg="Initializing dissection cache..."
xx drop (Unsupported L3 protocol) flow 0x0 to endpoint 0, ifindex 19, file bpf_lxc.c:1841, , identity 34827->0: :: -> ff02::16 icmp 143(0)
Policy verdict log: flow 0x398af451 local EP ID 1283, remote ID 62088, proto 6, egress, action deny, auth: disabled, match none, 10.88.1.188:33674 -> 10.88.0.69:80 tcp SYN
xx drop (Policy denied) flow 0xddbcc2b7 to endpoint 0, ifindex 19, file bpf_lxc.c:1663, , identity 34827->36997: 10.88.1.188:43348 -> 10.88.1.56:80 tcp SYN
Policy verdict log: flow 0xddbcc2b7 local EP ID 1283, remote ID 36997, proto 6, egress, action deny, auth: disabled, match none, 10.88.1.188:43348 -> 10.88.1.56:80 tcp SYN
Policy verdict log: flow 0x45336c04 local EP ID 1283, remote ID 36997, proto 6, egress, action deny, auth: disabled, match none, 10.88.1.188:43348 -> 10.88.1.56:80 tcp SYN
`

func TestParseCiliumVerdicts(t *testing.T) {
	v := ParseCiliumVerdicts(ciliumMonitorLog)
	if len(v) != 3 {
		t.Fatalf("%d verdicts, want 3: %+v", len(v), v)
	}
	if got := v[1]; got.Remote != 36997 || !got.Egress || got.Action != "deny" || got.Src.String() != "10.88.1.188:43348" || got.Dst.String() != "10.88.1.56:80" || got.ByCIDR() {
		t.Errorf("verdict %+v", got)
	}
	if !(CiliumVerdict{Remote: 16777218}).ByCIDR() {
		t.Error("identity 16777218 (a CIDR's) is not ByCIDR")
	}
}

// An allowed pair never carried through the proxies, whose connections Cilium denied judging the
// server as its pod, is Cilium's own verdict, not a regression; allowed once, or judged by the
// CIDR, it is not explained.
func TestNetpolReadCilium(t *testing.T) {
	pods := []Pod{{Namespace: "x", Name: "a", IP: "10.88.1.188"}, {Namespace: "y", Name: "b", IP: "10.88.1.56"}, {Namespace: "y", Name: "a", IP: "10.88.0.69"}}
	step := &NetpolStep{Port: "80"}
	row := func(log string) NetpolRow {
		w := NetpolWire{Denied: 1, DeniedTried: 1, Allowed: 1, Missing: []string{"x/a -> y/b"}}
		step.ReadCilium(&w, pods, ParseCiliumVerdicts(log))
		return NetpolRow{Row: Row{Without: Result{Status: StatusPassed}, With: Result{Status: StatusFailed}}, Step: step, Wire: w}
	}
	r := row(ciliumMonitorLog)
	if !r.Wire.CiliumsOwn() || r.Regression() || len(r.Wire.CiliumDenied) != 1 ||
		!strings.Contains(r.Wire.String(), "x/a -> y/b (2 SYNs of 10.88.1.188 to 10.88.1.56:80 denied, the server judged as identity 36997)") {
		t.Errorf("Cilium's denial by the pod's identity: own %v, regression %v, %s", r.Wire.CiliumsOwn(), r.Regression(), r.Wire)
	}
	allowed := ciliumMonitorLog + "Policy verdict log: flow 0x1 local EP ID 1283, remote ID 36997, proto 6, egress, action allow, auth: disabled, match L3-Only, 10.88.1.188:40540 -> 10.88.1.56:80 tcp SYN\n"
	byCIDR := ciliumMonitorLog + "Policy verdict log: flow 0x2 local EP ID 1283, remote ID 16777218, proto 6, egress, action deny, auth: disabled, match none, 10.88.1.188:40550 -> 10.88.1.56:80 tcp SYN\n"
	for name, log := range map[string]string{"allowed once": allowed, "judged by the CIDR": byCIDR, "no verdict": ""} {
		if r := row(log); r.Wire.CiliumsOwn() || !r.Regression() {
			t.Errorf("%s: own %v, regression %v; want a regression", name, r.Wire.CiliumsOwn(), r.Regression())
		}
	}
	leak := row(ciliumMonitorLog)
	leak.Wire.Leaks = []string{"x/a -> y/a"}
	if leak.Wire.CiliumsOwn() || !leak.Regression() {
		t.Error("a leak beside Cilium's denial is still a regression")
	}
}
