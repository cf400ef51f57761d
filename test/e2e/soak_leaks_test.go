package e2e

import (
	"context"
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/nodeagent"
	"github.com/detourmesh/detour/test/e2e/framework"
)

// leakReport lists what pods that no longer exist left on the node.
type leakReport struct {
	netns, ipam, cgroups, cniFiles, rules []string
}

func (l leakReport) total() int {
	return len(l.netns) + len(l.ipam) + len(l.cgroups) + len(l.cniFiles) + len(l.rules)
}

func (l leakReport) rows() [][2]string {
	row := func(what string, items []string) [2]string {
		if len(items) == 0 {
			return [2]string{what, "0"}
		}
		return [2]string{what, fmt.Sprintf("%d %v", len(items), items)}
	}
	return [][2]string{
		row("left after the soak: network namespaces beyond the live pods'", l.netns),
		row("left after the soak: host-local IPAM allocations of no live pod", l.ipam),
		row("left after the soak: pod cgroups of no live pod", l.cgroups),
		row("left after the soak: unexpected files in the CNI conf and bin dirs", l.cniFiles),
		row("left after the soak: detour rules in the node's network namespace", l.rules),
	}
}

// waitNoLeaks waits up to two minutes for the node to hold nothing of deleted pods (the
// kubelet and containerd clean up asynchronously) and returns what is left then.
func waitNoLeaks(t testing.TB, ctx context.Context, e *framework.Env) leakReport {
	t.Helper()
	var last leakReport
	framework.Poll(ctx, 2*time.Minute, func() (bool, error) {
		var err error
		if last, err = leaks(ctx, e); err != nil {
			return false, err
		}
		return last.total() == 0, framework.Seen("%+v", last)
	})
	return last
}

// leaks compares the node with its live pods: network namespaces (containerd keeps them under
// its state dir), host-local's allocations, the kubelet's pod cgroups, the CNI directories'
// files, and detour's rules in the node's own namespace (they belong only in pods').
func leaks(ctx context.Context, e *framework.Env) (leakReport, error) {
	var l leakReport
	n := e.Node
	list, err := n.Client.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + framework.NodeName})
	if err != nil {
		return l, err
	}
	liveUIDs, liveIPs, sandboxes := map[string]bool{}, map[string]bool{}, 0
	for _, p := range list.Items {
		if p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			continue
		}
		liveUIDs[string(p.UID)] = true
		if !p.Spec.HostNetwork {
			sandboxes++
			for _, ip := range p.Status.PodIPs {
				liveIPs[ip.IP] = true
			}
		}
	}

	var netns []string
	for _, pattern := range []string{"netns/*", "*/netns/*"} {
		m, _ := filepath.Glob(filepath.Join(n.Dir, "containerd", "state", pattern))
		netns = append(netns, m...)
	}
	if len(netns) > sandboxes {
		for _, p := range netns {
			l.netns = append(l.netns, filepath.Base(p))
		}
		l.netns = l.netns[:len(netns)-sandboxes]
	}

	ipamDir := filepath.Join(n.Dir, "cni", "ipam", framework.PrimaryNetwork)
	entries, _ := os.ReadDir(ipamDir)
	for _, ent := range entries {
		if _, err := netip.ParseAddr(ent.Name()); err == nil && !liveIPs[ent.Name()] {
			l.ipam = append(l.ipam, ent.Name())
		}
	}

	if h, err := framework.TrackingHierarchy(); err == nil {
		filepath.WalkDir(filepath.Join(h, n.Cgroup, "kubepods"), func(path string, d fs.DirEntry, err error) error {
			if err != nil || !d.IsDir() {
				return nil
			}
			if uid, ok := strings.CutPrefix(d.Name(), "pod"); ok && !liveUIDs[uid] {
				l.cgroups = append(l.cgroups, d.Name())
				return filepath.SkipDir
			}
			return nil
		})
	}

	want := map[string]bool{
		filepath.Base(n.PrimaryConfigPath()): true, framework.PrimaryNetwork: true, framework.PrimaryNetwork + "/" + nodeagent.DropInName: true,
		nodeagent.DefaultKubeconfigName: true, nodeagent.DefaultTokenName: true, nodeagent.ModeFileName: true,
	}
	filepath.WalkDir(n.CNIConfDir, func(path string, d fs.DirEntry, err error) error {
		rel, _ := filepath.Rel(n.CNIConfDir, path)
		if err == nil && rel != "." && !want[rel] {
			l.cniFiles = append(l.cniFiles, "net.d/"+rel)
		}
		return nil
	})
	bins, _ := os.ReadDir(n.CNIBinDir)
	for _, b := range bins {
		if !slices.Contains([]string{"bridge", "host-local", "loopback", "portmap", "detour-cni"}, b.Name()) {
			l.cniFiles = append(l.cniFiles, "bin/"+b.Name())
		}
	}

	for _, tool := range []string{"iptables-save", "ip6tables-save"} {
		out, err := n.Run(ctx, tool)
		if err != nil {
			return l, fmt.Errorf("%s in the node: %w", tool, err)
		}
		for line := range strings.SplitSeq(out, "\n") {
			if strings.Contains(line, "DETOUR") || strings.Contains(line, "detour/") {
				l.rules = append(l.rules, tool+": "+line)
			}
		}
	}
	return l, nil
}

// resourceSampler samples the resident memory and open file descriptors of detour's
// processes on the node (the webhook, the node agent's install-cni and repair) every few
// seconds. Each process's growth is measured from the median of its samples in the first
// window after a minute's warm-up to the median of those in its last window: a Go process's
// RSS swings by ±5% from one sample to the next with its garbage collector, which a single
// first and last sample would report as growth or shrinkage. The table shows the
// longest-lived process of each component.
type resourceSampler struct {
	cgroup string
	mu     sync.Mutex
	procs  map[int]*procSamples
}

type procSamples struct {
	component string
	first     time.Time
	// samples are the process's samples after its warm-up.
	samples []resourceSample
}

// span is how long the process was sampled after its warm-up.
func (p *procSamples) span() time.Duration {
	if len(p.samples) == 0 {
		return 0
	}
	return p.samples[len(p.samples)-1].at.Sub(p.samples[0].at)
}

// medians are the median RSS and open fds of the samples taken from from to to.
func (p *procSamples) medians(from, to time.Time) (rssKiB, fds int64) {
	var rss, open []int64
	for _, s := range p.samples {
		if !s.at.Before(from) && !s.at.After(to) {
			rss, open = append(rss, s.rssKiB), append(open, s.openFDs)
		}
	}
	slices.Sort(rss)
	slices.Sort(open)
	return rss[len(rss)/2], open[len(open)/2]
}

type resourceSample struct {
	at      time.Time
	rssKiB  int64
	openFDs int64
}

const (
	resourceWarmUp = time.Minute
	// resourceWindow is the length of the first and the last window whose medians are compared.
	resourceWindow = 30 * time.Second
)

func newResourceSampler(cgroup string) *resourceSampler {
	return &resourceSampler{cgroup: cgroup, procs: map[int]*procSamples{}}
}

func (r *resourceSampler) run(ctx context.Context, every time.Duration) {
	for {
		r.sample()
		if !framework.SleepCtx(ctx, every) {
			return
		}
	}
}

func (r *resourceSampler) sample() {
	now := time.Now()
	for _, pid := range framework.CgroupPIDs(r.cgroup) {
		args := strings.Split(framework.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)), "\x00")
		if len(args) < 2 || filepath.Base(args[0]) != "detour" {
			continue
		}
		component := args[1]
		if component != "webhook" && component != "install-cni" && component != "repair" {
			continue
		}
		var rss int64
		for line := range strings.SplitSeq(framework.ReadFile(fmt.Sprintf("/proc/%d/status", pid)), "\n") {
			if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
				fmt.Sscan(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), &rss)
			}
		}
		fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
		if err != nil || rss == 0 {
			continue
		}
		s := resourceSample{at: now, rssKiB: rss, openFDs: int64(len(fds))}
		r.mu.Lock()
		p := r.procs[pid]
		if p == nil {
			p = &procSamples{component: component, first: now}
			r.procs[pid] = p
		}
		if now.Sub(p.first) >= resourceWarmUp {
			p.samples = append(p.samples, s)
		}
		r.mu.Unlock()
	}
}

func (r *resourceSampler) rows() [][2]string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var rows [][2]string
	for _, c := range []string{"webhook", "install-cni", "repair"} {
		var best *procSamples
		bestPID := 0
		for pid, p := range r.procs {
			if p.component == c && (best == nil || p.span() > best.span()) {
				best, bestPID = p, pid
			}
		}
		what := "growth after warm-up of " + c + "'s RSS and open fds (its longest-lived process; medians of the first and last 30s)"
		if best == nil || best.span() < 2*resourceWindow {
			rows = append(rows, [2]string{what, "no process lived 1m past its 1m warm-up"})
			continue
		}
		first, last := best.samples[0].at, best.samples[len(best.samples)-1].at
		rss0, fds0 := best.medians(first, first.Add(resourceWindow))
		rss1, fds1 := best.medians(last.Add(-resourceWindow), last)
		rows = append(rows, [2]string{what, fmt.Sprintf("RSS %.1f → %.1f MiB (%+.1f%%), fds %d → %d (%+.1f%%) over %s (pid %d)",
			float64(rss0)/1024, float64(rss1)/1024, growth(rss0, rss1), fds0, fds1, growth(fds0, fds1),
			best.span().Round(time.Second), bestPID)})
	}
	return rows
}

func growth(from, to int64) float64 {
	if from == 0 {
		return 0
	}
	return 100 * float64(to-from) / float64(from)
}

// configWatcher looks at the node's detour configuration every 100 ms and records the
// intervals in which there was none, or more than one.
type configWatcher struct {
	e    *framework.Env
	mu   sync.Mutex
	gaps []configGap
}

type configGap struct {
	start, end time.Time
	found      int
}

func (w *configWatcher) run(ctx context.Context) {
	var open *configGap
	for framework.SleepCtx(ctx, 100*time.Millisecond) {
		found, err := w.e.DetourConfigs()
		now := time.Now()
		switch {
		case err != nil: // a file replaced while it was read
		case len(found) != 1 && open == nil:
			open = &configGap{start: now, end: now, found: len(found)}
		case len(found) != 1:
			open.end = now
		case open != nil:
			open.end = now
			w.mu.Lock()
			w.gaps = append(w.gaps, *open)
			w.mu.Unlock()
			open = nil
		}
	}
	if open != nil {
		w.mu.Lock()
		w.gaps = append(w.gaps, *open)
		w.mu.Unlock()
	}
}

func (w *configWatcher) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.gaps) == 0 {
		return "never"
	}
	var parts []string
	for _, g := range w.gaps {
		parts = append(parts, fmt.Sprintf("%s for %s (%d configurations)", g.start.UTC().Format("15:04:05.0"), g.end.Sub(g.start).Round(100*time.Millisecond), g.found))
	}
	return strings.Join(parts, "; ")
}
