package upstream

import (
	"fmt"
	"regexp"
	"strings"
)

// Smoke are the conformance tests `make e2e` runs with detour injecting every pod: a Service's
// endpoints through kube-proxy, cluster DNS for Services, pod-to-pod HTTP, session affinity (by
// the client's address, which the outbound proxy keeps) and a NodePort.
var Smoke = []string{
	"[sig-network] Services should serve a basic endpoint from pods [Conformance]",
	"[sig-network] DNS should provide DNS for services [Conformance]",
	"[sig-network] Networking Granular Checks: Pods should function for intra-pod communication: http [Conformance] [NodeConformance]",
	"[sig-network] Services should have session affinity work for service with type clusterIP [LinuxOnly] [Conformance]",
	"[sig-network] Services should be able to create a functioning NodePort service [Conformance]",
}

// excluded marks tests `make conformance` leaves out: those that need a serial cluster, take
// long on purpose, break the cluster, or need a feature (load balancers, SCTP, dual stack,
// network policies) this cluster does not have — as the upstream jobs that run the network
// tests on a plain cluster leave them out.
var excluded = regexp.MustCompile(`\[(Serial|Slow|Disruptive|Flaky|Feature:[^\]]*)\]`)

// groups are the test groups `make conformance` runs besides the conformance tests: the
// network tests of Services, DNS, endpoints, kube-proxy and pod connectivity.
var groups = regexp.MustCompile(`^\[sig-network\] (Networking|Services|DNS|EndpointSlice|EndpointSliceMirroring|Endpoints|EndpointsController|HostPort|Proxy|Connectivity) `)

// Select picks, from e2e.test --list-tests (lines "file:line: name"), the tests `make
// conformance` runs: every [sig-network] conformance test, and the tests of groups that are
// not excluded.
func Select(list string) []string {
	return pick(list, func(name string) bool {
		return strings.HasPrefix(name, "[sig-network] ") &&
			(strings.Contains(name, "[Conformance]") || groups.MatchString(name) && !excluded.MatchString(name))
	})
}

// pick returns the names of e2e.test --list-tests that keep holds for, each once, in order.
func pick(list string, keep func(name string) bool) []string {
	var out []string
	seen := map[string]bool{}
	for line := range strings.SplitSeq(list, "\n") {
		_, name, ok := strings.Cut(strings.TrimSpace(line), ": ")
		if ok && !seen[name] && keep(name) {
			seen[name] = true
			out = append(out, name)
		}
	}
	return out
}

// dualStack marks Kubernetes' dual-stack tests; dualStackExcluded those of them that need
// more than a dual-stack node on the bridge primary (SCTP) or a serial cluster.
var (
	dualStack         = regexp.MustCompile(`^\[sig-network\] \[Feature:IPv6DualStack\] `)
	dualStackExcluded = regexp.MustCompile(`\[(Serial|Slow|Disruptive|Flaky|Feature:SCTPConnectivity)\]`)
)

// SelectDualStack picks, from e2e.test --list-tests, Kubernetes' dual-stack tests
// ([Feature:IPv6DualStack]) but those that need SCTP or a serial cluster: what `make
// e2e-dualstack` runs on its dual-stack node.
func SelectDualStack(list string) []string {
	return pick(list, func(name string) bool {
		return dualStack.MatchString(name) && !dualStackExcluded.MatchString(name)
	})
}

// Row is one test in both runs.
type Row struct {
	Name          string
	Without, With Result
	// Exception is why the test cannot pass with a sidecar proxy (Exceptions), if it is one.
	Exception string
}

// Regression reports whether the test passed without detour and not with it, and is no
// known exception.
func (r Row) Regression() bool {
	return r.Without.Status == StatusPassed && r.With.Status != StatusPassed && r.Exception == ""
}

// Exceptions are the tests whose assertion a transparent proxy cannot satisfy by its nature,
// with why (docs/conformance.md says more, and what Istio and Linkerd do there).
var Exceptions = map[string]string{
	"[sig-network] Services should preserve source pod IP for traffic thru service cluster IP [LinuxOnly]": sourceIP,
	"[sig-network] Services should support externalTrafficPolicy=Local for type=NodePort":                  sourceIP,
	"[sig-network] Services should be rejected for evicted pods (no endpoints exist)":                      refused,
	"[sig-network] Services should be rejected when no endpoints exist":                                    refused,
}

const (
	sourceIP = "the server's app sees its inbound proxy's connection from 127.0.0.1, not the client's address"
	refused  = "the client's connect is accepted by its own outbound proxy, which only then finds the Service has no endpoint"
)

// Compare lines up two runs of the same tests.
func Compare(without, with []Result) []Row {
	byName := map[string]Result{}
	for _, r := range with {
		byName[r.Name] = r
	}
	rows := make([]Row, 0, len(without))
	for _, w := range without {
		rows = append(rows, Row{Name: w.Name, Without: w, With: byName[w.Name], Exception: Exceptions[w.Name]})
	}
	return rows
}

// Table is rows as a Markdown table, with each run's counts in its last row.
func Table(rows []Row) string {
	var b strings.Builder
	b.WriteString("| test | without detour | with detour |\n|---|---|---|\n")
	count := map[string]map[Status]int{"without": {}, "with": {}}
	for _, r := range rows {
		count["without"][r.Without.Status]++
		count["with"][r.With.Status]++
		with := cell(r.With)
		if r.Exception != "" {
			with += " (exception: " + r.Exception + ")"
		}
		fmt.Fprintf(&b, "| %s | %s | %s |\n", strings.ReplaceAll(r.Name, "|", `\|`), cell(r.Without), strings.ReplaceAll(with, "|", `\|`))
	}
	total := func(c map[Status]int) string {
		return fmt.Sprintf("%d passed, %d failed, %d skipped", c[StatusPassed], c[StatusFailed]+c[StatusMissing], c[StatusSkipped])
	}
	fmt.Fprintf(&b, "| **%d tests** | %s | %s |\n", len(rows), total(count["without"]), total(count["with"]))
	return b.String()
}

func cell(r Result) string {
	s := string(r.Status)
	if r.Status == StatusPassed {
		s += fmt.Sprintf(" (%.0f s)", r.Duration.Seconds())
	}
	if r.Message != "" && r.Status != StatusPassed {
		msg := r.Message
		if len(msg) > 120 {
			msg = msg[:117] + "..."
		}
		s += ": " + msg
	}
	return s
}
