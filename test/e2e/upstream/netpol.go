package upstream

import (
	"fmt"
	"net"
	"net/netip"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
)

// The NetworkPolicy tests of e2e.test (test/e2e/network/netpol) build a few pods in three
// namespaces (x/a, x/b, y/a, ...), each with its own Service, apply policies and probe every pair
// (`agnhost connect <ClusterIP>:<port>` exec'd in the client pod), comparing what connects with
// a truth table of what the policies allow. A client in the mesh connects to its own proxy,
// which accepts at once and only then dials the destination: the probe sees every TCP
// connection succeed, whatever the policy says, as any sidecar proxy's client does. What the
// policy decides is what the proxy's own connection meets, and the proxies' logs say it
// (ProxyLogs): NetpolWire reads, for the step a test failed at, the truth table it expected
// and what the proxies carried, pair by pair.

// excludedNetpol marks NetworkPolicy tests netpol-cilium leaves out: those that need a serial
// cluster, take long on purpose, break the cluster or are flaky, and SCTP's, which Cilium runs
// without (its chart's sctp.enabled is false).
var excludedNetpol = regexp.MustCompile(`\[(Serial|Slow|Disruptive|Flaky|Feature:SCTPConnectivity)\]`)

// SelectNetpol picks, from e2e.test --list-tests, Kubernetes' NetworkPolicy tests: the
// "[sig-network] Netpol" and "[sig-network] NetworkPolicy" tests that are not excluded.
func SelectNetpol(list string) []string {
	var out []string
	seen := map[string]bool{}
	for line := range strings.SplitSeq(list, "\n") {
		_, name, ok := strings.Cut(strings.TrimSpace(line), ": ")
		if !ok || seen[name] || excludedNetpol.MatchString(name) {
			continue
		}
		if strings.HasPrefix(name, "[sig-network] Netpol") || strings.HasPrefix(name, "[sig-network] NetworkPolicy") {
			seen[name] = true
			out = append(out, name)
		}
	}
	return out
}

// NetpolStep is the step of a NetworkPolicy test that failed, as the test's output shows it.
type NetpolStep struct {
	// Start is when the step's first round of probes began.
	Start time.Time
	// Pods are the pods of the truth table (namespace/name), in its order.
	Pods []string
	// Expected is the truth table: Expected[from][to] is whether the policies allow it.
	Expected map[string]map[string]bool
	// Addr is each pod's address the probes connect to (its Service's ClusterIP and the
	// step's port), from the commands of the probes that went wrong.
	Port string
	// Wrong are the pairs whose probe contradicted the truth table, with what it saw.
	Wrong []NetpolProbe
}

// NetpolProbe is one probe that contradicted the truth table.
type NetpolProbe struct {
	From, To string
	// Addr is the address probed (ClusterIP:port).
	Addr string
	// Allowed: the probe connected where the policies deny it (else it did not where they
	// allow it).
	Allowed bool
}

var (
	stepRE       = regexp.MustCompile(`STEP: Validating reachability matrix\.\.\. \(FIRST TRY\) .*@ (\d\d/\d\d/\d\d \d\d:\d\d:\d\d(\.\d+)?)`)
	validationRE = regexp.MustCompile(`Validation of (\S+) -> (\S+) FAILED !!!`)
	wrongRE      = regexp.MustCompile(`Expected (allowed|blocked) pod connection was instead (BLOCKED|ALLOWED) --- run '.*?/agnhost connect (\S+) `)
)

// ParseNetpolStep reads the output of a failed NetworkPolicy test (its JUnit timeline) for the
// step it failed at: the last one whose probes began, with the truth table it printed.
func ParseNetpolStep(output string) (*NetpolStep, error) {
	start, rest, err := lastStep(output)
	if err != nil {
		return nil, err
	}
	step := &NetpolStep{Start: start}
	var from, to string
	for line := range strings.SplitSeq(rest, "\n") {
		if m := validationRE.FindStringSubmatch(line); m != nil {
			from, to = m[1], m[2]
			continue
		}
		if m := wrongRE.FindStringSubmatch(line); m != nil && from != "" {
			step.Wrong = append(step.Wrong, NetpolProbe{From: from, To: to, Addr: m[3], Allowed: m[2] == "ALLOWED"})
			if _, port, err := net.SplitHostPort(m[3]); err == nil {
				step.Port = port
			}
			from, to = "", ""
		}
	}
	i := strings.LastIndex(rest, "expected:")
	if i < 0 {
		return nil, fmt.Errorf("the test printed no truth table for its last step")
	}
	if step.Pods, step.Expected, err = parseTruthTable(rest[i+len("expected:"):]); err != nil {
		return nil, err
	}
	return step, nil
}

// lastStep finds the last step whose probes began in a test's output: when, and the output
// from there on.
func lastStep(output string) (time.Time, string, error) {
	starts := stepRE.FindAllStringSubmatchIndex(output, -1)
	if len(starts) == 0 {
		return time.Time{}, "", fmt.Errorf("no step of probes in the test's output")
	}
	last := starts[len(starts)-1]
	start, err := time.ParseInLocation("01/02/06 15:04:05.999", output[last[2]:last[3]], time.Local)
	if err != nil {
		return time.Time{}, "", fmt.Errorf("the step's time: %w", err)
	}
	return start, output[last[0]:], nil
}

// parseTruthTable reads a table as netpol's TruthTable.PrettyPrint writes it: a header row
// "-" and the pods, then a row per pod, "." connected and "X" not.
func parseTruthTable(s string) ([]string, map[string]map[string]bool, error) {
	var pods []string
	values := map[string]map[string]bool{}
	for line := range strings.SplitSeq(s, "\n") {
		fields := strings.Fields(line)
		if len(fields) == 0 {
			if len(pods) > 0 && len(values) == len(pods) {
				break
			}
			continue
		}
		if pods == nil {
			if fields[0] != "-" {
				continue
			}
			pods = fields[1:]
			continue
		}
		if len(fields) != len(pods)+1 || !strings.Contains(fields[0], "/") {
			break
		}
		row := map[string]bool{}
		for j, mark := range fields[1:] {
			row[pods[j]] = mark == "."
		}
		values[fields[0]] = row
	}
	if len(pods) == 0 || len(values) != len(pods) {
		return nil, nil, fmt.Errorf("no complete truth table (%d pods, %d rows)", len(pods), len(values))
	}
	return pods, values, nil
}

// NetpolRetry is how the last step of a NetworkPolicy test that passed went: whether its
// policies needed the test's second round of probes, and when it passed.
type NetpolRetry struct {
	// Retried: some pair other than a pod to itself was wrong after the first round (each probe
	// retried for up to 10 s), so the primary CNI enforced the policy only after it.
	Retried bool
	// Took is from the step's start to the test's "VALIDATION SUCCESSFUL".
	Took time.Duration
}

var (
	secondTryRE = regexp.MustCompile(`retrying \(SECOND TRY\)`)
	successRE   = regexp.MustCompile(`I(\d\d\d\d \d\d:\d\d:\d\d\.\d+) .*VALIDATION SUCCESSFUL`)
)

// ParseNetpolRetry reads the output of a NetworkPolicy test for its last step.
func ParseNetpolRetry(output string) (NetpolRetry, error) {
	start, rest, err := lastStep(output)
	if err != nil {
		return NetpolRetry{}, err
	}
	r := NetpolRetry{Retried: secondTryRE.MatchString(rest)}
	m := successRE.FindStringSubmatch(rest)
	if m == nil {
		return r, fmt.Errorf("the step did not pass")
	}
	// klog's stamp has no year: the step's.
	done, err := time.ParseInLocation("2006 0102 15:04:05.999999", fmt.Sprintf("%d %s", start.Year(), m[1]), time.Local)
	if err != nil {
		return r, fmt.Errorf("the step's end: %w", err)
	}
	r.Took = done.Sub(start)
	return r, nil
}

// NetpolWire is what the proxies carried in a step: pair by pair, the connections the
// client's proxy made to the server's address, and those the server's proxy accepted from the
// client.
type NetpolWire struct {
	// Denied are the pairs the policies deny; Allowed those they allow (loopback left out, as
	// the tests leave it out).
	Denied, Allowed int
	// DeniedTried are the denied pairs whose client's proxy tried to connect, and
	// DeniedAttempts the proxy's attempts to them.
	DeniedTried, DeniedAttempts int
	// Leaks are the denied pairs that got through: the server's proxy accepted a connection
	// from the client after the policy was in force — from the last SYN of the client's
	// proxy's first failed dial (NetpolLastSYN).
	Leaks []string
	// NotInForce are the denied pairs the policy was never seen acting on in the step: the
	// client's proxy never failed, and the server's proxy accepted its connections up to the
	// last one. Either the policy does not hold for them, or the primary CNI had not enforced
	// it yet when the step ended; the wire alone cannot tell which (NetpolRow.Late).
	NotInForce []string
	// Converging are the denied pairs whose server's proxy accepted connections from the client
	// only before the client's first failure: the primary CNI enforced the policy some time
	// after the step began (Cilium allocates a relabelled pod's identity first), which the
	// test's own probes wait for by retrying.
	Converging []string
	// HalfOpen counts the denied pairs whose client's proxy saw its connection complete while no
	// server's proxy ever accepted one: the SYN reached the server and its SYN-ACK came back,
	// but the rest of the handshake was dropped, so no connection reached the server.
	HalfOpen int
	// AllowedCarried are the allowed pairs the client's proxy connected at least once; Missing
	// the allowed pairs it never did, and Untried the denied pairs it never tried.
	AllowedCarried   int
	Missing, Untried []string
	// CiliumDenied are the Missing pairs whose client's connections Cilium denied, judging the
	// server as the endpoint it manages (its pod's identity), in its policy verdicts: a policy
	// that allows the pair only by ipBlock never selects a pod Cilium manages
	// (cilium/cilium#19601), whoever in the client's pod connects (NetpolStep.ReadCilium).
	CiliumDenied []string
}

// NetpolDialTimeout is how long the e2e's test proxy waits for its own connection to a
// destination (testprog.Proxy's DialTimeout): a dial it logs as failed began that long before.
const NetpolDialTimeout = 5 * time.Second

// NetpolLastSYN is when, after a dial's start, Linux sends its last SYN within
// NetpolDialTimeout: the first at once, again after the initial retransmission timeout of 1 s
// and after 2 s more (the next would be 4 s later). A dial that timed out had that SYN
// dropped, so the policy was in force then at the latest; it may have begun before the policy
// existed (a run read with the dial's start as the moment counted a connection accepted
// 110 ms after the policy was created as a leak).
const NetpolLastSYN = 3 * time.Second

// Held reports whether the policies held through the proxies exactly as the truth table says:
// no denied pair got through, every denied pair was tried and failed, every allowed pair
// connected.
func (w NetpolWire) Held() bool {
	return len(w.Leaks) == 0 && len(w.NotInForce) == 0 && len(w.Untried) == 0 && len(w.Missing) == 0 && w.Denied > 0
}

// String is the wire's verdict in a line.
func (w NetpolWire) String() string {
	verdict := "held"
	if !w.Held() {
		verdict = "NOT held"
	}
	s := fmt.Sprintf("%s: %d denied pairs (%d connection attempts through the client's proxy), none reached the server's proxy once the policy was in force; %d of %d allowed pairs carried",
		verdict, w.Denied, w.DeniedAttempts, w.AllowedCarried, w.Allowed)
	if w.HalfOpen > 0 {
		s += fmt.Sprintf("; %d denied pairs half-open only (the client's proxy saw a SYN-ACK, the server never accepted)", w.HalfOpen)
	}
	if len(w.Converging) > 0 {
		s += "; accepted only before the policy was in force: " + strings.Join(w.Converging, ", ")
	}
	if len(w.Leaks) > 0 {
		s += "; LEAKED: " + strings.Join(w.Leaks, ", ")
	}
	if len(w.NotInForce) > 0 {
		s += "; not seen in force by the step's end: " + strings.Join(w.NotInForce, ", ")
	}
	if len(w.Untried) > 0 {
		s += "; denied pairs never tried: " + strings.Join(w.Untried, ", ")
	}
	if len(w.Missing) > 0 {
		s += "; allowed pairs never carried: " + strings.Join(w.Missing, ", ")
	}
	if len(w.CiliumDenied) > 0 {
		s += "; of them denied by Cilium, which judged the server by its pod's identity (an ipBlock does not select a pod Cilium manages, cilium/cilium#19601): " + strings.Join(w.CiliumDenied, ", ")
	}
	return s
}

// CiliumsOwn reports whether what keeps the wire from showing the policies holding is only
// allowed pairs that Cilium itself denied as endpoints (CiliumDenied): the same verdict it gives
// the client's own connections, with or without a proxy in the pod.
func (w NetpolWire) CiliumsOwn() bool {
	return len(w.Missing) > 0 && len(w.CiliumDenied) == len(w.Missing) &&
		len(w.Leaks) == 0 && len(w.NotInForce) == 0 && len(w.Untried) == 0
}

// ReadCilium sets w.CiliumDenied from Cilium's policy verdicts of the run: for each allowed pair
// never carried, whether Cilium denied every connection from the client's pod to the server's pod
// on the step's port, judging the server by its pod's identity. The verdicts carry no time; a
// pair's two pod IPs and port are the test's own while its pods live.
func (s *NetpolStep) ReadCilium(w *NetpolWire, pods []Pod, verdicts []CiliumVerdict) {
	w.CiliumDenied = nil
	port, err := strconv.ParseUint(s.Port, 10, 16)
	if err != nil {
		return
	}
	ipOf := map[string]netip.Addr{}
	for _, p := range pods {
		if a, err := netip.ParseAddr(p.IP); err == nil {
			ipOf[p.Namespace+"/"+p.Name] = a
		}
	}
	for _, pair := range w.Missing {
		from, to, _ := strings.Cut(pair, " -> ")
		src, ok1 := ipOf[from]
		dst, ok2 := ipOf[to]
		if !ok1 || !ok2 {
			continue
		}
		if remote, n, ok := ciliumDeniedByIdentity(verdicts, src, dst, uint16(port)); ok {
			w.CiliumDenied = append(w.CiliumDenied, fmt.Sprintf("%s (%d SYNs of %s to %s denied, the server judged as identity %d)", pair, n, src, netip.AddrPortFrom(dst, uint16(port)), remote))
		}
	}
}

// Wire checks a step against the proxies' logs: pods and services are the Recorder's (for
// the pods' IPs and their Services' ClusterIPs), lines the proxies'. A probe's address is its
// Service's ClusterIP (s-<namespace>-<pod>, as netpol's model names it) and the step's port.
func (s *NetpolStep) Wire(pods []Pod, services []Service, lines []LogLine) (NetpolWire, error) {
	var w NetpolWire
	if s.Port == "" {
		return w, fmt.Errorf("the step's port is unknown (no probe's command in the output)")
	}
	ipOf := map[string]string{}
	for _, p := range pods {
		ipOf[p.Namespace+"/"+p.Name] = p.IP
	}
	addrOf := map[string]string{}
	for _, sv := range services {
		addrOf[sv.Namespace+"/"+sv.Name] = net.JoinHostPort(sv.ClusterIP, s.Port)
	}
	byPod := map[string][]LogLine{}
	for _, l := range lines {
		if !l.Time.Before(s.Start) {
			byPod[l.Pod] = append(byPod[l.Pod], l)
		}
	}
	for _, from := range s.Pods {
		for _, to := range s.Pods {
			if from == to {
				continue
			}
			ns, name, _ := strings.Cut(to, "/")
			addr := addrOf[ns+"/s-"+ns+"-"+name]
			if addr == "" || ipOf[from] == "" {
				return w, fmt.Errorf("pair %s -> %s: no recorded address (service %q, client IP %q)", from, to, addr, ipOf[from])
			}
			// "proxy outbound 10.88.0.5:40112 -> 10.96.0.77:80" and " failed: ..." when it failed
			// (both logged when the proxy's dial has ended).
			ok, failed := 0, 0
			var firstFail, lastOK time.Time
			for _, l := range byPod[from] {
				if !strings.HasPrefix(l.Text, "proxy outbound "+ipOf[from]+":") || !strings.Contains(l.Text, " -> "+addr) {
					continue
				}
				rest := l.Text[strings.Index(l.Text, " -> "+addr)+len(" -> "+addr):]
				if strings.HasPrefix(rest, " failed") {
					if failed == 0 || l.Time.Before(firstFail) {
						firstFail = l.Time
					}
					failed++
				} else if rest == "" {
					ok++
					lastOK = l.Time
				}
			}
			// The policy was in force by the first failed dial's last SYN: its line comes when
			// the dial timed out.
			inForce := firstFail.Add(-NetpolDialTimeout + NetpolLastSYN)
			accepted, acceptedAfter := 0, 0
			var lastAccepted time.Time
			for _, l := range byPod[to] {
				if strings.HasPrefix(l.Text, "proxy inbound "+ipOf[from]+":") && !strings.Contains(l.Text, " failed") {
					accepted++
					lastAccepted = l.Time
					if failed > 0 && l.Time.After(inForce) {
						acceptedAfter++
					}
				}
			}
			pair := from + " -> " + to
			if s.Expected[from][to] {
				w.Allowed++
				if ok > 0 {
					w.AllowedCarried++
				} else {
					w.Missing = append(w.Missing, pair)
				}
				continue
			}
			w.Denied++
			switch {
			case acceptedAfter > 0:
				w.Leaks = append(w.Leaks, fmt.Sprintf("%s (%d accepted by the server's proxy once the policy was in force, %d before; the client's proxy: %d connected, %d failed)", pair, acceptedAfter, accepted-acceptedAfter, ok, failed))
			case failed == 0 && ok == 0:
				w.Untried = append(w.Untried, pair)
			case failed == 0 && accepted > 0 && !lastOK.After(lastAccepted.Add(time.Second)):
				// No failure, and no half-open connection after the last one the server accepted
				// (the two lines of one connection are logged within a moment of each other).
				w.NotInForce = append(w.NotInForce, fmt.Sprintf("%s (%d accepted, the last %s after the step began; the client's proxy never failed)",
					pair, accepted, lastAccepted.Sub(s.Start).Round(100*time.Millisecond)))
			default:
				if accepted > 0 {
					w.Converging = append(w.Converging, fmt.Sprintf("%s (%d)", pair, accepted))
				}
				if ok > 0 && accepted == 0 {
					w.HalfOpen++
				}
				w.DeniedTried++
				w.DeniedAttempts += ok + failed
			}
		}
	}
	slices.Sort(w.Converging)
	slices.Sort(w.Leaks)
	slices.Sort(w.NotInForce)
	return w, nil
}

// netpolException is why a NetworkPolicy test whose probes expect a denial cannot pass with a
// sidecar proxy in the client.
const netpolException = "the client's connect() completes to its own outbound proxy, which dials the destination only then; the policy acts on that connection (the last column)"

// NetpolRow is one NetworkPolicy test in both runs and, where it failed with detour only, what
// the proxies carried at the step it failed at.
type NetpolRow struct {
	Row
	// Step is that step; Wire what the proxies carried in it (WireErr: why it could not be read).
	Step    *NetpolStep
	Wire    NetpolWire
	WireErr string
	// WithoutStep is how the same step went without detour.
	WithoutStep NetpolRetry
}

// Late reports whether what keeps the wire from showing the policies holding is only pairs
// not seen in force by the step's end, where the same step without detour needed its second
// round of probes: the primary CNI was slow to enforce that step's policy in both runs, and
// the second run's step ended before it did (Cilium allocates a relabelled pod's identity
// first; the policy then holds, as netpol-cilium's relabel run shows over a longer window).
func (r NetpolRow) Late() bool {
	w := r.Wire
	return len(w.NotInForce) > 0 && len(w.Leaks) == 0 && len(w.Untried) == 0 && len(w.Missing) == 0 &&
		r.WithoutStep.Retried && r.WrongBlocked() == 0
}

// WrongBlocked counts the probes of the step that did not connect where the policies allow it:
// a connection the mesh broke, which no sidecar explains.
func (r NetpolRow) WrongBlocked() int {
	n := 0
	if r.Step != nil {
		for _, p := range r.Step.Wrong {
			if !p.Allowed {
				n++
			}
		}
	}
	return n
}

// Regression reports whether the test passed without detour, not with it, and the proxies'
// logs do not show the policies holding exactly as the test expects: a denied pair got
// through, an allowed one was not carried, a probe was blocked where allowed, or the step could
// not be read.
func (r NetpolRow) Regression() bool {
	if r.Without.Status != StatusPassed || r.With.Status == StatusPassed {
		return false
	}
	return r.Step == nil || r.WireErr != "" || (!r.Wire.Held() && !r.Late() && !r.Wire.CiliumsOwn()) || r.WrongBlocked() > 0
}

// CompareNetpol lines up two runs of the NetworkPolicy tests and reads, for each test that
// failed with detour only, its step and the proxies' logs (pods and services from the
// Recorder).
func CompareNetpol(without, with []Result, pods []Pod, services []Service, lines []LogLine, verdicts []CiliumVerdict) []NetpolRow {
	var rows []NetpolRow
	for _, r := range Compare(without, with) {
		row := NetpolRow{Row: r}
		if r.Without.Status == StatusPassed && r.With.Status == StatusFailed {
			step, err := ParseNetpolStep(r.With.Output)
			if err != nil {
				row.WireErr = err.Error()
			} else {
				row.Step = step
				// Read only to explain a step not in force by its end: a test that passed has
				// a last step.
				row.WithoutStep, _ = ParseNetpolRetry(r.Without.Output)
				if row.Wire, err = step.Wire(pods, services, lines); err != nil {
					row.WireErr = err.Error()
				} else {
					step.ReadCilium(&row.Wire, pods, verdicts)
					if row.Wire.Held() && row.WrongBlocked() == 0 {
						row.Exception = netpolException
					}
				}
			}
		}
		rows = append(rows, row)
	}
	return rows
}

// NetpolTable is rows as a Markdown table, with each run's counts in its last row.
func NetpolTable(rows []NetpolRow) string {
	var b strings.Builder
	b.WriteString("| test | without detour | with detour | through the proxies, at the step it failed at |\n|---|---|---|---|\n")
	count := map[string]map[Status]int{"without": {}, "with": {}}
	held, late, cilium := 0, 0, 0
	for _, r := range rows {
		count["without"][r.Without.Status]++
		count["with"][r.With.Status]++
		with := cell(r.With)
		if r.Exception != "" {
			with += " (exception)"
		}
		wire := ""
		switch {
		case r.WireErr != "":
			wire = "not read: " + r.WireErr
		case r.Step != nil:
			wire = r.Wire.String()
			if n := r.WrongBlocked(); n > 0 {
				wire += fmt.Sprintf("; %d probes BLOCKED where allowed", n)
			}
			if r.Late() {
				wire += fmt.Sprintf("; without detour the same step needed the test's second round of probes (passed %s after it began): late in both runs", r.WithoutStep.Took.Round(100*time.Millisecond))
			}
			if r.Wire.Held() && r.WrongBlocked() == 0 {
				held++
			}
			if r.Late() {
				late++
			}
			if r.Wire.CiliumsOwn() {
				cilium++
			}
		}
		esc := func(s string) string { return strings.ReplaceAll(s, "|", `\|`) }
		fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", esc(r.Name), esc(cell(r.Without)), esc(with), esc(wire))
	}
	total := func(c map[Status]int) string {
		return fmt.Sprintf("%d passed, %d failed, %d skipped", c[StatusPassed], c[StatusFailed]+c[StatusMissing], c[StatusSkipped])
	}
	fmt.Fprintf(&b, "| **%d tests** | %s | %s | held in %d, late in both runs in %d, allowed pairs denied by Cilium's own verdict in %d |\n", len(rows), total(count["without"]), total(count["with"]), held, late, cilium)
	return b.String()
}
