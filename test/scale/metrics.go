package scale

import (
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/detourmesh/detour/nodeagent"
)

// histogram is a Prometheus histogram's cumulative counts by upper bound.
type histogram map[float64]uint64

// admissions is the webhook's detour_webhook_admission_duration_seconds, every outcome of
// every replica summed.
func (w *Webhook) admissions() (histogram, error) {
	h := histogram{}
	for _, url := range w.metrics {
		families, err := nodeagent.RemoteGatherer(url).Gather()
		if err != nil {
			return nil, err
		}
		for _, f := range families {
			if f.GetName() != "detour_webhook_admission_duration_seconds" {
				continue
			}
			for _, m := range f.GetMetric() {
				for _, b := range m.GetHistogram().GetBucket() {
					if !math.IsInf(b.GetUpperBound(), 1) { // the text format's +Inf bucket, which is the count
						h[b.GetUpperBound()] += b.GetCumulativeCount()
					}
				}
				h[math.Inf(1)] += m.GetHistogram().GetSampleCount()
			}
		}
	}
	return h, nil
}

// since is h's counts less those of an earlier scrape.
func (h histogram) since(before histogram) histogram {
	out := histogram{}
	for le, n := range h {
		out[le] = n - before[le]
	}
	return out
}

// quantile estimates the q-quantile as Prometheus' histogram_quantile does: linear within the
// bucket it falls in. It is 0 without observations.
func (h histogram) quantile(q float64) (time.Duration, error) {
	bounds := make([]float64, 0, len(h))
	for le := range h {
		bounds = append(bounds, le)
	}
	slices.Sort(bounds)
	if len(bounds) == 0 || h[math.Inf(1)] == 0 {
		return 0, nil
	}
	rank := q * float64(h[math.Inf(1)])
	lower, below := 0.0, uint64(0)
	for _, le := range bounds {
		if float64(h[le]) >= rank {
			if math.IsInf(le, 1) {
				return 0, fmt.Errorf("the %g-quantile is above the histogram's largest bound %g s", q, lower)
			}
			in := h[le] - below
			frac := 1.0
			if in > 0 {
				frac = (rank - float64(below)) / float64(in)
			}
			return time.Duration((lower + (le-lower)*frac) * float64(time.Second)), nil
		}
		lower, below = le, h[le]
	}
	return 0, nil
}
