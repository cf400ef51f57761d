package upstream

import (
	"os"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestFlannelRefIsTheBuiltVersion keeps FlannelRef's tag the flannel version hack/tools/flannel
// builds: the image holds that flanneld, whatever its tag says.
func TestFlannelRefIsTheBuiltVersion(t *testing.T) {
	data, err := os.ReadFile("../../../hack/tools/flannel/go.mod")
	if err != nil {
		t.Fatal(err)
	}
	_, tag, _ := strings.Cut(FlannelRef, ":")
	if want := "github.com/flannel-io/flannel " + tag + " "; !strings.Contains(string(data), want) {
		t.Errorf("FlannelRef is %s, but hack/tools/flannel/go.mod does not require %q:\n%s", FlannelRef, want, data)
	}
}

// A report as e2e.test writes it (Ginkgo's JUnit, failure message omitted, "[It] " names).
const junitFixture = `<?xml version="1.0" encoding="UTF-8"?>
<testsuites tests="4" disabled="2" errors="0" failures="1" time="70.5">
  <testsuite name="Kubernetes e2e suite" package="/" tests="4" disabled="2" skipped="0" errors="0" failures="1" time="70.5">
    <testcase name="[SynchronizedBeforeSuite]" classname="Kubernetes e2e suite" status="passed" time="1.2"></testcase>
    <testcase name="[It] [sig-network] DNS should provide DNS for services [Conformance]" classname="Kubernetes e2e suite" status="passed" time="30.25"></testcase>
    <testcase name="[It] [sig-network] Services should serve a basic endpoint from pods [Conformance]" classname="Kubernetes e2e suite" status="failed" time="12">
      <failure type="failed">
[FAILED] failed to validate endpoints for service endpoint-test2 in namespace: services-1234
In [It] at: k8s.io/kubernetes/test/e2e/network/service.go:760
      </failure>
    </testcase>
    <testcase name="[It] [sig-network] Services should preserve source pod IP for traffic thru service cluster IP [LinuxOnly]" classname="Kubernetes e2e suite" status="skipped" time="0">
      <skipped message="skipped - Requires at least 2 nodes (not 1)"></skipped>
    </testcase>
    <testcase name="[It] [sig-apps] Deployment should not run" classname="Kubernetes e2e suite" status="skipped" time="0">
      <skipped message="skipped"></skipped>
    </testcase>
    <testcase name="[It] [sig-network] Proxy should time out" classname="Kubernetes e2e suite" status="timedout" time="600"></testcase>
  </testsuite>
</testsuites>`

func TestParseJUnit(t *testing.T) {
	got, err := ParseJUnit([]byte(junitFixture))
	if err != nil {
		t.Fatal(err)
	}
	want := []Result{
		{Name: "[SynchronizedBeforeSuite]", Status: StatusPassed, Duration: 1200 * time.Millisecond},
		{Name: "[sig-network] DNS should provide DNS for services [Conformance]", Status: StatusPassed, Duration: 30250 * time.Millisecond},
		{Name: "[sig-network] Services should serve a basic endpoint from pods [Conformance]", Status: StatusFailed, Duration: 12 * time.Second,
			Message: "[FAILED] failed to validate endpoints for service endpoint-test2 in namespace: services-1234"},
		{Name: "[sig-network] Services should preserve source pod IP for traffic thru service cluster IP [LinuxOnly]", Status: StatusSkipped,
			Message: "skipped - Requires at least 2 nodes (not 1)"},
		{Name: "[sig-apps] Deployment should not run", Status: StatusSkipped, Message: "skipped"},
		{Name: "[sig-network] Proxy should time out", Status: StatusFailed, Duration: 600 * time.Second, Message: "timedout"},
	}
	if !slices.Equal(got, want) {
		t.Errorf("ParseJUnit:\n got %+v\nwant %+v", got, want)
	}
	for _, bad := range []string{"", "not xml", "<testsuite></testsuite>"} {
		if _, err := ParseJUnit([]byte(bad)); err == nil {
			t.Errorf("ParseJUnit(%q) gave no error", bad)
		}
	}
}

func FuzzParseJUnit(f *testing.F) {
	f.Add([]byte(junitFixture))
	f.Add([]byte(`<testsuites><testsuite><testcase name="x" status="weird" time="NaN"/></testsuite></testsuites>`))
	f.Fuzz(func(t *testing.T, data []byte) {
		results, err := ParseJUnit(data)
		if err != nil {
			return
		}
		for _, r := range results {
			switch r.Status {
			case StatusPassed, StatusFailed, StatusSkipped:
			default:
				t.Errorf("result %+v has status %q", r, r.Status)
			}
			if r.Status == StatusPassed && r.Message != "" {
				t.Errorf("passed result %+v has a message", r)
			}
		}
	})
}

func TestSelect(t *testing.T) {
	list := `    k8s.io/kubernetes@v1.37.2/test/e2e/network/apiserver.go:48: [sig-network] API Server should provide secure master service [Conformance]
    k8s.io/kubernetes@v1.37.2/test/e2e/network/service.go:733: [sig-network] Services should serve a basic endpoint from pods [Conformance]
    k8s.io/kubernetes@v1.37.2/test/e2e/network/service.go:1020: [sig-network] Services should preserve source pod IP for traffic thru service cluster IP [LinuxOnly]
    k8s.io/kubernetes@v1.37.2/test/e2e/network/service.go:3783: [sig-network] Services should work after the service has been recreated [Serial]
    k8s.io/kubernetes@v1.37.2/test/e2e/network/loadbalancer.go:116: [sig-network] LoadBalancers [Feature:LoadBalancer] should be able to change the type and ports of a TCP service [Slow]
    k8s.io/kubernetes@v1.37.2/test/e2e/network/networking.go:360: [sig-network] Networking Granular Checks: Services should function for client IP based session affinity: http [LinuxOnly]
    k8s.io/kubernetes@v1.37.2/test/e2e/network/netpol/network_policy.go:100: [sig-network] Netpol NetworkPolicy between server and client should support a 'default-deny-ingress' policy [Feature:NetworkPolicy]
    k8s.io/kubernetes@v1.37.2/test/e2e/network/conntrack.go:201: [sig-network] Conntrack should be able to preserve UDP traffic when server pod cycles for a NodePort service
    k8s.io/kubernetes@v1.37.2/test/e2e/apps/deployment.go:10: [sig-apps] Deployment should run [Conformance]
    k8s.io/kubernetes@v1.37.2/test/e2e/network/dns.go:193: [sig-network] DNS should resolve DNS of partial qualified names for the cluster [LinuxOnly]
    k8s.io/kubernetes@v1.37.2/test/e2e/network/service.go:733: [sig-network] Services should serve a basic endpoint from pods [Conformance]
`
	want := []string{
		"[sig-network] API Server should provide secure master service [Conformance]",
		"[sig-network] Services should serve a basic endpoint from pods [Conformance]",
		"[sig-network] Services should preserve source pod IP for traffic thru service cluster IP [LinuxOnly]",
		"[sig-network] Networking Granular Checks: Services should function for client IP based session affinity: http [LinuxOnly]",
		"[sig-network] DNS should resolve DNS of partial qualified names for the cluster [LinuxOnly]",
	}
	if got := Select(list); !slices.Equal(got, want) {
		t.Errorf("Select:\n got %q\nwant %q", got, want)
	}
}

func TestSelectDualStack(t *testing.T) {
	list := `    k8s.io/kubernetes@v1.37.2/test/e2e/network/dual_stack.go:64: [sig-network] [Feature:IPv6DualStack] should have at least one dual-stack node
    k8s.io/kubernetes@v1.37.2/test/e2e/network/dual_stack.go:469: [sig-network] [Feature:IPv6DualStack] Granular Checks: Services Secondary IP Family [LinuxOnly] should function for pod-Service: sctp [Feature:SCTPConnectivity]
    k8s.io/kubernetes@v1.37.2/test/e2e/network/dual_stack.go:455: [sig-network] [Feature:IPv6DualStack] Granular Checks: Services Secondary IP Family [LinuxOnly] should function for pod-Service: udp
    k8s.io/kubernetes@v1.37.2/test/e2e/network/networking.go:94: [sig-network] Networking should provide Internet connection for containers [Feature:Networking-IPv6] [Experimental][LinuxOnly]
    k8s.io/kubernetes@v1.37.2/test/e2e/network/service.go:733: [sig-network] Services should serve a basic endpoint from pods [Conformance]
    k8s.io/kubernetes@v1.37.2/test/e2e/network/dual_stack.go:64: [sig-network] [Feature:IPv6DualStack] should have at least one dual-stack node
`
	want := []string{
		"[sig-network] [Feature:IPv6DualStack] should have at least one dual-stack node",
		"[sig-network] [Feature:IPv6DualStack] Granular Checks: Services Secondary IP Family [LinuxOnly] should function for pod-Service: udp",
	}
	if got := SelectDualStack(list); !slices.Equal(got, want) {
		t.Errorf("SelectDualStack:\n got %q\nwant %q", got, want)
	}
}

func TestCompare(t *testing.T) {
	const a, b, c, d = "[sig-network] a", "[sig-network] b", "[sig-network] c", "[sig-network] d"
	Exceptions[d] = "the server sees the proxy's address"
	defer delete(Exceptions, d)
	without := []Result{{Name: a, Status: StatusPassed}, {Name: b, Status: StatusPassed}, {Name: c, Status: StatusSkipped}, {Name: d, Status: StatusPassed}}
	with := []Result{{Name: a, Status: StatusPassed}, {Name: b, Status: StatusFailed, Message: "timed out | waiting"}, {Name: c, Status: StatusSkipped}, {Name: d, Status: StatusFailed}}
	rows := Compare(without, with)
	var regressions []string
	for _, r := range rows {
		if r.Regression() {
			regressions = append(regressions, r.Name)
		}
	}
	if !slices.Equal(regressions, []string{b}) {
		t.Errorf("regressions %q, want only %q (d is an exception, c skipped in both)", regressions, b)
	}
	table := Table(rows)
	for _, want := range []string{`failed: timed out \| waiting`, "exception: the server sees the proxy's address", "| **4 tests** | 3 passed, 0 failed, 1 skipped | 1 passed, 2 failed, 1 skipped |"} {
		if !strings.Contains(table, want) {
			t.Errorf("table lacks %q:\n%s", want, table)
		}
	}
}

func TestCount(t *testing.T) {
	c := Count([]Pod{
		{Namespace: "a", Name: "1", Injected: true},
		{Namespace: "a", Name: "2", Injected: true},
		{Namespace: "a", Name: "3"},
		{Namespace: "b", Name: "host", HostNetwork: true},
	})
	if c.Injected != 2 || c.PodNetwork != 3 || c.HostNetwork != 1 || !slices.Equal(c.Missed, []string{"a/3"}) {
		t.Errorf("Count: %+v", c)
	}
	if f := c.Fraction(); f < 0.66 || f > 0.67 {
		t.Errorf("Fraction %v, want 2/3", f)
	}
	if f := Count(nil).Fraction(); f != 1 {
		t.Errorf("Fraction of no pods %v, want 1", f)
	}
}

// A passed test's timeline is only in the log: Ginkgo's JUnit report leaves it out.
func TestTimelines(t *testing.T) {
	name := "[sig-network] Netpol NetworkPolicy between server and client should deny ingress access to updated pod [Feature:NetworkPolicy]"
	log := "Running in parallel across 3 processes\n------------------------------\n" +
		"[ReportBeforeSuite] PASSED [0.001 seconds]\n------------------------------\n" +
		"• [27.627 seconds]\n" + name + " [sig-network, Feature:NetworkPolicy]\nk8s.io/kubernetes@v1.37.2/test/e2e/network/netpol/network_policy.go:748\n\n" +
		"  Timeline >>\n  STEP: Validating reachability matrix... (FIRST TRY) @ 12/05/26 21:56:23.977\n  <<\n------------------------------\n" +
		"• [13.1 seconds]\n" + name + "s on other pods [Feature:NetworkPolicy]\n  Timeline >>\n  <<\n"
	got := timelines(log, []string{name, "not in the log"})
	if len(got) != 1 || !strings.Contains(got[name], "(FIRST TRY) @ 12/05/26 21:56:23.977") || strings.Contains(got[name], "13.1 seconds") {
		t.Errorf("timelines: %q", got)
	}
}
