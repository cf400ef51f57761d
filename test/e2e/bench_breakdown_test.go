package e2e

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"text/tabwriter"
	"time"
)

// The breakdown of BenchmarkPodStartLatency: where each pod's start went, from the node's own
// logs — containerd's (when it created the sandbox and each container, at info level) and the
// kubelet's (when its PLEG saw a container exit, at --v 2) — against the benchmark's clock
// (create call, Ready seen by the watch). One machine, one clock.

// podTimes are the moments of one pod's start.
type podTimes struct {
	created, ready time.Time
	// sandbox is when containerd returned the pod's sandbox (detour-cni's ADD included).
	sandbox time.Time
	// started are the moments containerd started each container (first attempt), by name;
	// requested when the kubelet asked it to create each.
	started, requested map[string]time.Time
	// died is when the kubelet's PLEG saw each container exit (first time), by name.
	died map[string]time.Time
}

var (
	// containerd: time="2026-12-05T13:49:05.118238Z" level=info msg="..."
	containerdLine = regexp.MustCompile(`^time="([^"]+)" level=\w+ msg="(.*)"`)
	// The CRI's metadata is printed as protobuf text (`name:"init" attempt:1`, with spaces the
	// protobuf library varies on purpose; attempt 0 left out), or, by older runtimes, as
	// `&ContainerMetadata{Name:init,Attempt:0,}`: only the name and the first attempt matter.
	sandboxReturns = regexp.MustCompile(`^RunPodSandbox for (.*) returns sandbox id \\"([0-9a-f]+)\\"`)
	createAsked    = regexp.MustCompile(`^CreateContainer within sandbox \\"([0-9a-f]+)\\" for container (.*)$`)
	createReturns  = regexp.MustCompile(`^CreateContainer within sandbox \\"([0-9a-f]+)\\" for (.*) returns container id \\"([0-9a-f]+)\\"`)
	metaName       = regexp.MustCompile(`(?:name:\s*\\"|Name:)([^\\",]+)`)
	metaNamespace  = regexp.MustCompile(`(?:namespace:\s*\\"|Namespace:)([^\\",]+)`)
	metaRetry      = regexp.MustCompile(`attempt:\s*[1-9]|Attempt:[1-9]`)
	startReturns   = regexp.MustCompile(`^StartContainer for \\"([0-9a-f]+)\\" returns successfully`)
	// kubelet: I1205 13:49:06.092732   27122 kubelet.go:2788] "SyncLoop (PLEG): event for pod" pod="ns/name" event={..."Type":"ContainerDied","Data":"<id>"}
	plegDied = regexp.MustCompile(`^I(\d{4}) (\d\d:\d\d:\d\d\.\d+) .*"SyncLoop \(PLEG\): event for pod" pod="([^"]+)" event=\{"ID":"[^"]+","Type":"ContainerDied","Data":"([0-9a-f]+)"\}`)
)

// readPodTimes fills in pods (by "namespace/name", created and ready already set) from the
// node's containerd and kubelet logs in logDir.
func readPodTimes(logDir string, pods map[string]*podTimes) error {
	sandboxes := map[string]*podTimes{}  // sandbox id → pod
	containers := map[string]*podTimes{} // container id → pod
	names := map[string]string{}         // container id → name
	for _, p := range pods {
		p.started, p.requested, p.died = map[string]time.Time{}, map[string]time.Time{}, map[string]time.Time{}
	}
	err := eachLine(filepath.Join(logDir, "containerd.log"), func(line string) {
		m := containerdLine.FindStringSubmatch(line)
		if m == nil {
			return
		}
		at, err := time.Parse(time.RFC3339Nano, m[1])
		if err != nil {
			return
		}
		msg := m[2]
		if s := sandboxReturns.FindStringSubmatch(msg); s != nil && !metaRetry.MatchString(s[1]) {
			name, ns := metaName.FindStringSubmatch(s[1]), metaNamespace.FindStringSubmatch(s[1])
			if name != nil && ns != nil {
				if p := pods[ns[1]+"/"+name[1]]; p != nil {
					p.sandbox, sandboxes[s[2]] = at, p
				}
			}
		} else if s := createReturns.FindStringSubmatch(msg); s != nil {
			if p, name := sandboxes[s[1]], metaName.FindStringSubmatch(s[2]); p != nil && name != nil && !metaRetry.MatchString(s[2]) {
				containers[s[3]], names[s[3]] = p, name[1]
			}
		} else if s := createAsked.FindStringSubmatch(msg); s != nil {
			if p, name := sandboxes[s[1]], metaName.FindStringSubmatch(s[2]); p != nil && name != nil && !metaRetry.MatchString(s[2]) {
				p.requested[name[1]] = at
			}
		} else if s := startReturns.FindStringSubmatch(msg); s != nil {
			if p := containers[s[1]]; p != nil {
				p.started[names[s[1]]] = at
			}
		}
	})
	if err != nil {
		return err
	}
	return eachLine(filepath.Join(logDir, "kubelet.log"), func(line string) {
		m := plegDied.FindStringSubmatch(line)
		if m == nil {
			return
		}
		p := pods[m[3]]
		if p == nil || p.created.IsZero() {
			return
		}
		// klog has the month and day, not the year, and the machine's local time.
		at, err := time.ParseInLocation("0102 15:04:05.999999", m[1]+" "+m[2], time.Local)
		if err != nil {
			return
		}
		at = at.AddDate(p.created.Year(), 0, 0)
		if name := names[m[4]]; name != "" {
			if _, seen := p.died[name]; !seen {
				p.died[name] = at
			}
		}
	})
}

func eachLine(path string, f func(string)) error {
	file, err := os.Open(path)
	if err != nil {
		return err
	}
	defer file.Close()
	r := bufio.NewReaderSize(file, 1<<20)
	for {
		line, err := r.ReadString('\n')
		if line != "" {
			f(line)
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// breakdownSteps are the steps of a pod's start the breakdown shows, each the median over a
// row's pods of the time between two of its moments (a pod that lacks either is left out).
var breakdownSteps = []struct {
	name     string
	from, to func(p *podTimes) time.Time
}{
	{"create → sandbox (detour-cni's ADD inside)", func(p *podTimes) time.Time { return p.created }, func(p *podTimes) time.Time { return p.sandbox }},
	{"sandbox → the validator init container started", func(p *podTimes) time.Time { return p.sandbox }, started("detour-validator")},
	{"its exit → seen by the kubelet", started("detour-validator"), died("detour-validator")},
	{"sandbox or validator → the proxy (native) started", func(p *podTimes) time.Time {
		return latest(p.sandbox, p.died["detour-validator"])
	}, func(p *podTimes) time.Time { return native(p) }},
	{"the proxy started → init asked for (the start gate)", func(p *podTimes) time.Time { return native(p) }, requested("init")},
	{"init started → its exit seen by the kubelet", started("init"), died("init")},
	{"init's exit seen → app started", died("init"), started("app")},
	{"app started → Ready seen by the watch", started("app"), func(p *podTimes) time.Time { return p.ready }},
}

func started(name string) func(*podTimes) time.Time {
	return func(p *podTimes) time.Time { return p.started[name] }
}

func died(name string) func(*podTimes) time.Time {
	return func(p *podTimes) time.Time { return p.died[name] }
}

func requested(name string) func(*podTimes) time.Time {
	return func(p *podTimes) time.Time { return p.requested[name] }
}

// native is when the pod's proxy started, if it is a native sidecar (it starts before init).
func native(p *podTimes) time.Time {
	for _, name := range []string{"detour-proxy", "proxy"} {
		if at, ok := p.started[name]; ok && (p.started["init"].IsZero() || at.Before(p.started["init"])) {
			return at
		}
	}
	return time.Time{}
}

func latest(ts ...time.Time) time.Time {
	return slices.MaxFunc(ts, func(a, b time.Time) int { return a.Compare(b) })
}

// printBreakdown writes the median of each step per row (rows[i] names row i; pods[i] are its
// pods' times).
func printBreakdown(w io.Writer, rows []string, pods [][]*podTimes) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprint(tw, "\nmedian of each step (containerd's and the kubelet's logs)")
	for i := range rows {
		fmt.Fprintf(tw, "\trow %d", i+1)
	}
	fmt.Fprintln(tw)
	for _, s := range breakdownSteps {
		fmt.Fprint(tw, s.name)
		for i := range rows {
			var d []time.Duration
			for _, p := range pods[i] {
				from, to := s.from(p), s.to(p)
				if !from.IsZero() && !to.IsZero() {
					d = append(d, to.Sub(from))
				}
			}
			if len(d) == 0 {
				fmt.Fprint(tw, "\t—")
				continue
			}
			p50, _ := percentiles(d)
			fmt.Fprintf(tw, "\t%dms", p50.Milliseconds())
		}
		fmt.Fprintln(tw)
	}
	tw.Flush()
}
