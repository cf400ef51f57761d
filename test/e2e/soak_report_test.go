package e2e

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/repair"
	"github.com/detourmesh/detour/test/e2e/framework"
)

// finish runs `detour check --cluster` while the pods admitted uninjected still exist, deletes
// the soak's namespaces, looks for what deleted pods left on the node, and prints the table.
func (s *soak) finish(ctx context.Context) {
	t := s.t
	s.logf("detour check --cluster")
	report, _ := s.e.CheckCluster(t, ctx)
	s.mu.Lock()
	uninjected := maps.Clone(s.uninjected)
	s.mu.Unlock()
	var unreported []string
	live := 0
	res, _ := report.Result("uninjected-pods")
	for _, name := range uninjected {
		if _, exists, _ := s.podInformer.GetStore().GetByKey(name); !exists {
			continue
		}
		live++
		if !slices.Contains(res.Objects, name) {
			unreported = append(unreported, name)
		}
	}
	slices.Sort(unreported)
	if len(unreported) > 0 {
		t.Errorf("detour check --cluster did not report %d pods admitted uninjected: %v (check uninjected-pods: %s %q)", len(unreported), unreported, res.Status, res.Message)
	}

	bareDeleted := s.bareDeletedByRepair(ctx)
	failedAdmissions := s.failedAdmissions(ctx)
	repairRate := s.repairRate(ctx)

	s.logf("deleting the soak's namespaces")
	for _, ns := range []string{"soak-fail", "soak-ignore"} {
		if err := s.e.Node.Client.CoreV1().Namespaces().Delete(ctx, ns, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			t.Error(err)
		}
	}
	framework.WaitFor(t, ctx, "the soak's namespaces to be deleted", 8*time.Minute, func() (bool, error) {
		for _, ns := range []string{"soak-fail", "soak-ignore"} {
			if _, err := s.e.Node.Client.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
				if err != nil {
					return false, err
				}
				return false, framework.Seen("namespace %s still there", ns)
			}
		}
		return true, nil
	})
	s.logf("looking for what deleted pods left on the node")
	leaks := waitNoLeaks(t, ctx, s.e)
	configs, _ := s.e.DetourConfigs()

	s.mu.Lock()
	defer s.mu.Unlock()
	kinds, foldedPods := map[string]int{}, 0
	for _, sp := range s.seen {
		kinds[sp.kind]++
		if sp.folded {
			foldedPods++
		}
	}
	verdicts := map[string]int{}
	var unverified []string
	for key, v := range s.checks {
		word, _, _ := strings.Cut(v, ":")
		verdicts[word]++
		if word == "unverified" {
			unverified = append(unverified, key+" "+v)
		}
	}
	// A caught pod either got no redirect from detour-cni (its ADDs in the plugin's log say
	// so, or there is none), or got one and its validator still saw none.
	adds := map[string][]framework.PluginEntry{}
	for _, l := range s.e.PluginLog(t, "ADD", "") {
		adds[l.Pod] = append(adds[l.Pod], l)
	}
	caughtBy, caughtRedirected := map[faultKind]int{}, map[faultKind]int{}
	var caughtLines []string
	for _, c := range s.caught {
		kind := s.faultAt(c.at)
		caughtBy[kind]++
		var decisions []string
		redirected := false
		for _, l := range adds[c.name] {
			decisions = append(decisions, strings.TrimSpace(l.Time.UTC().Format("15:04:05.000")+" "+l.Decision+" "+l.Error))
			redirected = redirected || l.Decision == "redirected"
		}
		if redirected {
			caughtRedirected[kind]++
		}
		caughtLines = append(caughtLines, fmt.Sprintf("%s at %s after %s: detour-cni ADDs %v; validator: %s",
			c.name, c.at.UTC().Format("15:04:05.000"), kind, decisions, c.message))
	}
	slices.Sort(caughtLines)

	// The drop-in is detour's alone: no fault may take it off the node even for a moment. An
	// entry in the primary's conflist is gone while the primary rewrites it.
	gapsWant := ""
	if s.cfg.configMode == "auto" {
		gapsWant = "must be never (drop-in)"
	}
	rows := [][3]string{
		{"soak", fmt.Sprintf("%s, seed %d, cniConfigMode %s, %d faults", time.Since(s.start).Round(time.Second), s.cfg.seed, s.cfg.configMode, len(s.faults)), ""},
		{"pods created", fmt.Sprintf("%d (%d in waves, %d of Jobs, %d bare)", len(s.seen), kinds[kindWave], kinds[kindJob], kinds[kindBare]), "≥ 300 in the long form"},
		{"of them with the validator's check at the proxy's start (validator.mode auto)", fmt.Sprint(foldedPods), ""},
		{"capture checks (a real connection per Ready sandbox; the proxy's log per completed Job pod)", fmt.Sprintf("%d captured, %d unverified", verdicts["captured"], verdicts["unverified"]), ""},
		{"pods whose app ran without the redirect while their validator passed", fmt.Sprint(len(s.bypassed)), "must be 0"},
	}
	for _, k := range append(slices.Clone(allFaults), faultNone) {
		rows = append(rows, [3]string{"pods caught by the validator (exit 42) after: " + string(k),
			fmt.Sprintf("%d (%d of them had an ADD that redirected)", caughtBy[k], caughtRedirected[k]), "goal 0"})
	}
	rows = append(rows,
		[3]string{"validator failures with another code of its own (1, 2, 43, 44)", fmt.Sprint(len(s.otherFailures)), ""},
		[3]string{"validator runs killed or lost to a fault (exit ≥ 128; a new run follows)", fmt.Sprint(len(s.interrupted)), ""},
		[3]string{"time the node held no detour configuration, or two", s.configGaps.String(), gapsWant},
		[3]string{"Job pods a reboot left without a sandbox (kubelet: restartPolicy Never, Pending for good)", fmt.Sprint(len(s.stranded)), ""},
		[3]string{"admissions refused (failurePolicy Fail: controllers' FailedCreate + the soak's own)", fmt.Sprint(failedAdmissions), ""},
		[3]string{"pods admitted uninjected (failurePolicy Ignore)", fmt.Sprint(len(uninjected)), ""},
		[3]string{"of those still there, not reported by detour check --cluster", fmt.Sprintf("%d of %d", len(unreported), live), "must be 0"},
		[3]string{"bare pods deleted by repair", fmt.Sprint(bareDeleted), "must be 0"},
		[3]string{"repair deletions; most in any window beyond rate·t + burst", repairRate.String(), "must be 0 beyond"},
		[3]string{"waves that did not get Ready and checked within 6m", fmt.Sprint(s.waveTimeouts), ""},
		[3]string{"detour configurations on the node", fmt.Sprintf("%d %v", len(configs), configs), "exactly 1"},
	)
	for _, l := range leaks.rows() {
		rows = append(rows, [3]string{l[0], l[1], "must be 0"})
	}
	for _, r := range s.resources.rows() {
		rows = append(rows, [3]string{r[0], r[1], "goal ≤ 10%"})
	}
	s.logFaults()
	t.Logf("soak table:")
	for _, r := range rows {
		t.Logf("  | %s | %s | %s |", r[0], r[1], r[2])
	}
	if len(unverified) > 0 {
		slices.Sort(unverified)
		t.Logf("soak: unverified checks: %v", unverified)
	}
	for _, l := range caughtLines {
		t.Logf("soak: caught: %s", l)
	}
	if len(s.otherFailures) > 0 {
		t.Logf("soak: validator failures with another code: %v", s.otherFailures)
	}

	if len(s.bypassed) > 0 {
		t.Errorf("%d pods ran their app without the redirect while their validator passed: %v", len(s.bypassed), s.bypassed)
	}
	if bareDeleted > 0 {
		t.Errorf("repair deleted %d bare pods", bareDeleted)
	}
	if repairRate.excess > 0 {
		t.Errorf("repair exceeded its rate limit: %s", repairRate)
	}
	if gapsWant != "" && s.configGaps.String() != "never" {
		t.Errorf("the node held no detour configuration, or two, at: %s", s.configGaps)
	}
	if len(configs) != 1 {
		t.Errorf("the node holds %d detour configurations, want exactly 1: %v", len(configs), configs)
	}
	if leaks.total() > 0 {
		t.Errorf("deleted pods left things on the node: %+v", leaks)
	}
	if verdicts["captured"] == 0 {
		t.Errorf("no pod was proven captured: the soak proved nothing")
	}
}

// faultAt names the last fault that began before at, when it ended less than a minute
// before at; else faultNone.
func (s *soak) faultAt(at time.Time) faultKind {
	for i := len(s.faults) - 1; i >= 0; i-- {
		f := s.faults[i]
		if f.start.After(at) {
			continue
		}
		if at.Sub(f.end) <= time.Minute {
			return f.kind
		}
		break
	}
	return faultNone
}

// bareDeletedByRepair counts the bare pods that are gone or replaced, and the repair Events
// that deleted one.
func (s *soak) bareDeletedByRepair(ctx context.Context) int {
	s.mu.Lock()
	bare := maps.Clone(s.bare)
	s.mu.Unlock()
	deleted := 0
	for name, uid := range bare {
		ns, pod, _ := strings.Cut(name, "/")
		p, err := s.e.Node.Client.CoreV1().Pods(ns).Get(ctx, pod, metav1.GetOptions{})
		if apierrors.IsNotFound(err) || err == nil && p.UID != uid {
			s.logf("bare pod %s is gone or was replaced", name)
			deleted++
		}
	}
	return deleted
}

// failedAdmissions sums the controllers' FailedCreate Events that name detour's webhook and
// the soak's own refused creations.
func (s *soak) failedAdmissions(ctx context.Context) int {
	total := 0
	for _, ns := range []string{"soak-fail", "soak-ignore"} {
		evs, err := s.e.Node.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "reason=FailedCreate"})
		if err != nil {
			s.t.Errorf("list the FailedCreate Events of %s: %v", ns, err)
			continue
		}
		for _, ev := range evs.Items {
			if strings.Contains(ev.Message, "inject.detour.dev") {
				total += int(max(ev.Count, 1))
			}
		}
	}
	s.mu.Lock()
	for _, n := range s.createErrors {
		total += n
	}
	s.mu.Unlock()
	return total
}

// rateReport is repair's deletions against its limit (rate 5/s, burst 5 in the e2e values).
type rateReport struct{ deletions, excess int }

func (r rateReport) String() string { return fmt.Sprintf("%d; %d", r.deletions, r.excess) }

func (s *soak) repairRate(ctx context.Context) rateReport {
	const limit, burst = 5.0, 5
	var times []time.Time
	for _, ns := range []string{"soak-fail", "soak-ignore"} {
		evs, err := s.e.Node.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{FieldSelector: "reason=" + repair.EventReason})
		if err != nil {
			s.t.Errorf("list repair's Events of %s: %v", ns, err)
			continue
		}
		for _, ev := range evs.Items {
			if ev.Action == "Annotate" {
				continue
			}
			at := ev.EventTime.Time
			if at.IsZero() {
				at = ev.LastTimestamp.Time
			}
			for range max(ev.Count, 1) {
				times = append(times, at)
			}
		}
	}
	slices.SortFunc(times, func(a, b time.Time) int { return a.Compare(b) })
	r := rateReport{deletions: len(times)}
	for i := range times {
		for j := i; j < len(times); j++ {
			// Event times have a second's resolution at worst: allow one more second.
			allowed := burst + int(limit*(times[j].Sub(times[i]).Seconds()+1))
			r.excess = max(r.excess, j-i+1-allowed)
		}
	}
	return r
}
