package scale

import (
	"fmt"
	"io"
	"strings"
	"time"
)

// Parts are detour's parts that run on every node.
var Parts = []string{"install-cni", "repair"}

// WriteReport writes results as a markdown table, one row per size, and what each part asked
// in the steady state of the largest.
func WriteReport(w io.Writer, results []*Result, steady time.Duration) {
	fmt.Fprintf(w, "| nodes | herd: every node ready (each agent: p50 / p99 / max) | API p50 / p99 in the herd | 429 | rollout: every agent ready again (each agent; API p99, 429) | pods created through the webhook: p50 / p99 (rate) | the webhook's admission p50 / p99 | the webhook's peak RSS | install-cni req/node/min | repair req/node/min | watches per node (install-cni, repair) | heap per node | check --cluster (peak RSS) |\n")
	fmt.Fprintf(w, "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range results {
		var watches []string
		for _, part := range Parts {
			open := OpenWatches(r.Requests, part, r.WatchesAt)
			total := 0
			for _, n := range open {
				total += n
			}
			watches = append(watches, fmt.Sprintf("%.1f", float64(total)/float64(r.Nodes)))
		}
		a := r.Admission
		fmt.Fprintf(w, "| %d | %s (%s) | %s / %s | %d | %s (%s; %s, %d) | %d: %s / %s (%.0f/s) | %s / %s | %d MiB | %.2f | %.2f | %s | %.0f KiB | %s (%d MiB) |\n", r.Nodes,
			r.Herd.Round(10*time.Millisecond), agentTimes(r.HerdAgent),
			r.HerdP50.Round(100*time.Microsecond), r.HerdP99.Round(100*time.Microsecond), r.Throttled,
			r.Rollout.Round(10*time.Millisecond), agentTimes(r.RolloutAgent), r.RolloutP99.Round(100*time.Microsecond), r.RolloutThrottled,
			a.Pods, a.P50.Round(100*time.Microsecond), a.P99.Round(100*time.Microsecond), a.Rate,
			a.WebhookP50.Round(10*time.Microsecond), a.WebhookP99.Round(10*time.Microsecond), r.WebhookMaxRSS>>20,
			r.Steady.PerNodeMinute("install-cni", r.Nodes, false), r.Steady.PerNodeMinute("repair", r.Nodes, false),
			strings.Join(watches, ", "), r.HeapPerNode/1024, r.Check.Round(10*time.Millisecond), r.CheckMaxRSS>>20)
	}
	if len(results) == 0 {
		return
	}
	last := results[len(results)-1]
	fmt.Fprintf(w, "\nRequests per node per minute beyond watches are counted over the steady state (%s after the herd). The requests of the %d-node run, herd included, by part:\n\n", steady, last.Nodes)
	fmt.Fprintf(w, "| part | verb | resource | requests | per node |\n|---|---|---|---|---|\n")
	all := In(last.Requests, time.Time{}, last.WatchesAt)
	for _, part := range Parts {
		for _, c := range all.Counts(part) {
			fmt.Fprintf(w, "| %s | %s | %s | %d | %.2f |\n", c.Part, c.Verb, c.Resource, c.N, float64(c.N)/float64(last.Nodes))
		}
	}
}

// agentTimes formats each agent's p50, p99 and longest time to ready.
func agentTimes(d [3]time.Duration) string {
	return fmt.Sprintf("%s / %s / %s", d[0].Round(10*time.Millisecond), d[1].Round(10*time.Millisecond), d[2].Round(10*time.Millisecond))
}
