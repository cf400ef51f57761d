package upstream

import (
	"slices"
	"strings"
	"testing"
	"time"
)

func TestSelectNetpol(t *testing.T) {
	list := strings.Join([]string{
		"k8s.io/kubernetes@v1.37.2/test/e2e/network/netpol/network_policy.go:80: [sig-network] Netpol NetworkPolicy between server and client should support a 'default-deny-ingress' policy [Feature:NetworkPolicy]",
		"k8s.io/kubernetes@v1.37.2/test/e2e/network/netpol/network_policy_api.go:52: [sig-network] Netpol API should support creating NetworkPolicy API operations",
		"k8s.io/kubernetes@v1.37.2/test/e2e/network/netpol/network_policy.go:1429: [sig-network] Netpol [Feature:SCTPConnectivity] [LinuxOnly] NetworkPolicy between server and client using SCTP should support a 'default-deny-ingress' policy [Feature:NetworkPolicy]",
		"k8s.io/kubernetes@v1.37.2/test/e2e/network/netpol/network_policy.go:1337: [sig-network] Netpol [LinuxOnly] NetworkPolicy between server and client using UDP should support a 'default-deny-ingress' policy [Feature:NetworkPolicy]",
		"k8s.io/kubernetes@v1.37.2/test/e2e/network/netpol/x.go:1: [sig-network] Netpol should take long [Slow]",
		"k8s.io/kubernetes@v1.37.2/test/e2e/network/service.go:1: [sig-network] Services should serve a basic endpoint from pods [Conformance]",
	}, "\n")
	got := SelectNetpol(list)
	want := []string{
		"[sig-network] Netpol NetworkPolicy between server and client should support a 'default-deny-ingress' policy [Feature:NetworkPolicy]",
		"[sig-network] Netpol API should support creating NetworkPolicy API operations",
		"[sig-network] Netpol [LinuxOnly] NetworkPolicy between server and client using UDP should support a 'default-deny-ingress' policy [Feature:NetworkPolicy]",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("SelectNetpol:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// netpolOutput is the timeline of a 'default-deny-ingress' test that failed with detour, as
// e2e.test's JUnit report has it: x-1 denies all ingress, and the meshed clients' probes into
// it connected (to their own proxies).
const netpolOutput = `  STEP: Creating a kubernetes client - k8s.io/kubernetes/test/e2e/framework/framework.go:224 @ 12/05/26 15:09:50.1
  I1205 15:10:00.900000   4321 test_helper.go:48] Network Policy creating x-1/deny-ingress
  STEP: Validating reachability matrix... - k8s.io/kubernetes/test/e2e/network/netpol/test_helper.go:113 @ 12/05/26 15:10:01.5
  STEP: Validating reachability matrix... (FIRST TRY) - k8s.io/kubernetes/test/e2e/network/netpol/test_helper.go:117 @ 12/05/26 15:10:01.5
  I1205 15:10:01.600000   4321 kubemanager.go:158] Starting probe from pod a to 10.96.0.21
  I1205 15:10:11.000000   4321 kubemanager.go:215]  probe #10 :: connectivity not expected :: x-1/a -> 10.96.0.21
  I1205 15:10:12.000000   4321 probe.go:100] Validation of x-1/a -> x-1/b FAILED !!!
  I1205 15:10:12.000000   4321 probe.go:101] error <nil> 
  I1205 15:10:12.000000   4321 probe.go:105] Expected blocked pod connection was instead ALLOWED --- run 'kubectl exec a -n x-1 -- /agnhost connect 10.96.0.21:80 --timeout=3s --protocol=tcp'
  I1205 15:10:12.000000   4321 probe.go:100] Validation of y-2/a -> x-1/a FAILED !!!
  I1205 15:10:12.000000   4321 probe.go:101] error <nil> 
  I1205 15:10:12.000000   4321 probe.go:105] Expected blocked pod connection was instead ALLOWED --- run 'kubectl exec a -n y-2 -- /agnhost connect 10.96.0.20:80 --timeout=3s --protocol=tcp'
  I1205 15:10:40.000000   4321 reachability.go:180] reachability: correct:4, incorrect:2, result=false
  
  
  I1205 15:10:40.000000   4321 reachability.go:182] expected:
  
  -		x-1/a	x-1/b	y-2/a
  x-1/a	X	X	.	
  x-1/b	X	X	.	
  y-2/a	X	X	.	
  
  
  
  I1205 15:10:40.000000   4321 reachability.go:185] observed:
  
  -		x-1/a	x-1/b	y-2/a
  x-1/a	.	.	.	
  x-1/b	.	.	.	
  y-2/a	.	.	.	
  [FAILED] Had 2 wrong results in reachability matrix
`

func TestParseNetpolStep(t *testing.T) {
	s, err := ParseNetpolStep(netpolOutput)
	if err != nil {
		t.Fatal(err)
	}
	if want := time.Date(2026, 12, 5, 15, 10, 1, 500e6, time.Local); !s.Start.Equal(want) {
		t.Errorf("start %v, want %v", s.Start, want)
	}
	if strings.Join(s.Pods, " ") != "x-1/a x-1/b y-2/a" || s.Port != "80" {
		t.Errorf("pods %v, port %q", s.Pods, s.Port)
	}
	if s.Expected["y-2/a"]["x-1/b"] || !s.Expected["x-1/a"]["y-2/a"] {
		t.Errorf("expected %v", s.Expected)
	}
	if len(s.Wrong) != 2 || s.Wrong[1] != (NetpolProbe{From: "y-2/a", To: "x-1/a", Addr: "10.96.0.20:80", Allowed: true}) {
		t.Errorf("wrong probes %+v", s.Wrong)
	}
}

func TestNetpolWire(t *testing.T) {
	s, err := ParseNetpolStep(netpolOutput)
	if err != nil {
		t.Fatal(err)
	}
	pods := []Pod{{Namespace: "x-1", Name: "a", IP: "10.88.0.10"}, {Namespace: "x-1", Name: "b", IP: "10.88.0.11"}, {Namespace: "y-2", Name: "a", IP: "10.88.1.12"}}
	svcs := []Service{{"x-1", "s-x-1-a", "10.96.0.20"}, {"x-1", "s-x-1-b", "10.96.0.21"}, {"y-2", "s-y-2-a", "10.96.0.22"}}
	at := func(sec int, pod, text string) LogLine {
		return LogLine{Time: s.Start.Add(time.Duration(sec) * time.Second), Pod: pod, Text: text}
	}
	lines := []LogLine{
		// Before the step: the pair was allowed then; it does not count.
		at(-5, "x-1/a", "proxy outbound 10.88.0.10:40000 -> 10.96.0.21:80"),
		at(-5, "x-1/b", "proxy inbound 10.88.0.10:40000 -> 10.88.0.11:80 app 127.0.0.1:80"),
		at(6, "x-1/a", "proxy outbound 10.88.0.10:40001 -> 10.96.0.21:80 failed: dial tcp 10.96.0.21:80: i/o timeout"),
		at(6, "x-1/b", "proxy outbound 10.88.0.11:40002 -> 10.96.0.20:80 failed: dial tcp 10.96.0.20:80: i/o timeout"),
		at(7, "x-1/a", "proxy outbound 10.88.0.10:40003 -> 10.96.0.22:80"),
		at(7, "x-1/b", "proxy outbound 10.88.0.11:40004 -> 10.96.0.22:80"),
		at(8, "y-2/a", "proxy outbound 10.88.1.12:40005 -> 10.96.0.20:80 failed: dial tcp 10.96.0.20:80: i/o timeout"),
		at(9, "y-2/a", "proxy outbound 10.88.1.12:40006 -> 10.96.0.21:80 failed: dial tcp 10.96.0.21:80: i/o timeout"),
		at(9, "y-2/a", "proxy outbound 10.88.1.12:40007 -> 10.96.0.21:80 failed: dial tcp 10.96.0.21:80: i/o timeout"),
	}
	w, err := s.Wire(pods, svcs, lines)
	if err != nil {
		t.Fatal(err)
	}
	if !w.Held() || w.Denied != 4 || w.DeniedAttempts != 5 || w.Allowed != 2 || w.AllowedCarried != 2 {
		t.Errorf("wire %+v: %s", w, w)
	}
	// A denied connection that got through: the server's proxy accepted it.
	leak := append(lines, at(10, "x-1/a", "proxy inbound 10.88.1.12:40008 -> 10.88.0.10:80 app 127.0.0.1:80"))
	if w, _ := s.Wire(pods, svcs, leak); w.Held() || len(w.Leaks) != 1 || !strings.Contains(w.Leaks[0], "y-2/a -> x-1/a") {
		t.Errorf("with a leak: %s", w)
	}
	// The policy in force only after the step began (Cilium allocating a relabelled pod's
	// identity): the server's proxy accepted y-2/a before the last SYN of y-2/a's first failed
	// dial (logged at 9 s, it began at 4 s and sent its last SYN at 7 s), none after. Held, and
	// the pair is named as converging.
	early := append(slices.Clone(lines), at(6, "x-1/b", "proxy inbound 10.88.1.12:40010 -> 10.88.0.11:80 app 127.0.0.1:80"))
	if w, _ := s.Wire(pods, svcs, early); !w.Held() || strings.Join(w.Converging, ",") != "y-2/a -> x-1/b (1)" {
		t.Errorf("accepted before the policy was in force: %s", w)
	}
	// Accepted after that SYN, while the failing dial was still under way: the policy was in
	// force, a leak.
	during := append(slices.Clone(lines), at(8, "x-1/b", "proxy inbound 10.88.1.12:40014 -> 10.88.0.11:80 app 127.0.0.1:80"))
	if w, _ := s.Wire(pods, svcs, during); w.Held() || len(w.Leaks) != 1 || !strings.Contains(w.Leaks[0], "y-2/a -> x-1/b") {
		t.Errorf("accepted during a failing dial: %s", w)
	}
	// Never seen in force: the server's proxy accepted up to the client's last connection, and
	// the client's proxy never failed. Not held, and not a leak either: the wire cannot tell
	// a policy that does not hold from one not enforced yet.
	never := []LogLine{lines[2], lines[3], lines[4], lines[5], at(8, "y-2/a", "proxy outbound 10.88.1.12:40011 -> 10.96.0.20:80"),
		at(8, "x-1/a", "proxy inbound 10.88.1.12:40012 -> 10.88.0.10:80 app 127.0.0.1:80"), lines[7], lines[8]}
	if w, _ := s.Wire(pods, svcs, never); w.Held() || len(w.Leaks) != 0 || strings.Join(w.NotInForce, ",") != "y-2/a -> x-1/a (1 accepted, the last 8s after the step began; the client's proxy never failed)" {
		t.Errorf("never in force: %s", w)
	}
	// The same, then a connection of the client that the server's proxy never accepted (half
	// open): the policy came into force between the two. Held, converging.
	later := append(slices.Clone(never), at(12, "y-2/a", "proxy outbound 10.88.1.12:40015 -> 10.96.0.20:80"))
	if w, _ := s.Wire(pods, svcs, later); !w.Held() || strings.Join(w.Converging, ",") != "y-2/a -> x-1/a (1)" {
		t.Errorf("in force after the last accepted connection: %s", w)
	}
	// Half-open: the client's proxy saw its connection complete (a SYN-ACK came back) but no
	// server's proxy accepted it: the rest of the handshake was dropped. Held.
	half := append(slices.Clone(lines), at(9, "y-2/a", "proxy outbound 10.88.1.12:40013 -> 10.96.0.20:80"))
	if w, _ := s.Wire(pods, svcs, half); !w.Held() || w.HalfOpen != 1 || w.DeniedAttempts != 6 {
		t.Errorf("half-open: %+v %s", w, w)
	}
	// y-2/a's proxy logged nothing: its denied pairs were never tried.
	if w, _ := s.Wire(pods, svcs, lines[:6]); w.Held() || strings.Join(w.Untried, ",") != "y-2/a -> x-1/a,y-2/a -> x-1/b" {
		t.Errorf("without y-2/a's lines: %s", w)
	}
	// An allowed pair the proxy never carried.
	if w, _ := s.Wire(pods, svcs, append(lines[:4:4], lines[5:]...)); w.Held() || strings.Join(w.Missing, ",") != "x-1/a -> y-2/a" {
		t.Errorf("without x-1/a's connection to y-2/a: %s", w)
	}
}

func TestParseNetpolRetry(t *testing.T) {
	// The end of a step that passed after its second round, as e2e.test v1.37.2 writes it.
	passed := `  STEP: Validating reachability matrix... (FIRST TRY) - k8s.io/kubernetes/test/e2e/network/netpol/test_helper.go:117 @ 12/05/26 20:17:41.728
  I1205 20:17:52.087135   15230 kubemanager.go:215]  probe #12 :: connectivity not expected :: netpol-y-9598/a -> 10.96.0.121
  I1205 20:17:52.087193   15230 probe.go:100] Validation of netpol-y-9598/a -> netpol-x-7268/a FAILED !!!
  I1205 20:17:52.257400   15230 test_helper.go:122] failed first probe 1 wrong results ... retrying (SECOND TRY)
  I1205 20:18:06.645506   15230 test_helper.go:134] VALIDATION SUCCESSFUL
`
	r, err := ParseNetpolRetry(netpolOutput[:strings.Index(netpolOutput, "  STEP: Validating reachability matrix... (FIRST TRY)")] + passed)
	if err != nil || !r.Retried || r.Took != 24917506*time.Microsecond {
		t.Errorf("retried step: %+v, %v; want retried, 24.917506s", r, err)
	}
	first := strings.Replace(passed, "retrying (SECOND TRY)", "", 1)
	if r, err := ParseNetpolRetry(first); err != nil || r.Retried {
		t.Errorf("step without a second round: %+v, %v", r, err)
	}
	if _, err := ParseNetpolRetry(netpolOutput); err == nil {
		t.Error("a step that failed read as passed")
	}
}

// A row is late only when nothing but pairs not seen in force keeps the wire from holding and
// the same step without detour needed its second round.
func TestNetpolRowLate(t *testing.T) {
	row := NetpolRow{Row: Row{Without: Result{Status: StatusPassed}, With: Result{Status: StatusFailed}},
		Step: &NetpolStep{}, Wire: NetpolWire{Denied: 1, NotInForce: []string{"y/a -> x/a"}}}
	if row.Late() || !row.Regression() {
		t.Errorf("without a second round without detour: late %v, regression %v", row.Late(), row.Regression())
	}
	row.WithoutStep = NetpolRetry{Retried: true, Took: 25 * time.Second}
	if !row.Late() || row.Regression() {
		t.Errorf("second round without detour: late %v, regression %v", row.Late(), row.Regression())
	}
	leak := row
	leak.Wire.Leaks = []string{"y/a -> x/b"}
	if leak.Late() || !leak.Regression() {
		t.Errorf("with a leak too: late %v, regression %v", leak.Late(), leak.Regression())
	}
}
