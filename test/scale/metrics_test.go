package scale

import (
	"math"
	"testing"
	"time"
)

func TestHistogramQuantile(t *testing.T) {
	before := histogram{0.001: 10, 0.005: 10, 0.01: 10, math.Inf(1): 10}
	// 100 observations since: 50 up to 1 ms, 40 in (1 ms, 5 ms], 10 in (5 ms, 10 ms].
	after := histogram{0.001: 60, 0.005: 100, 0.01: 110, math.Inf(1): 110}
	h := after.since(before)
	for _, c := range []struct {
		q    float64
		want time.Duration
	}{
		{0.5, time.Millisecond},         // the 50th falls at the first bucket's top
		{0.7, 3 * time.Millisecond},     // 20 of the 40 in (1, 5]: halfway
		{0.99, 9500 * time.Microsecond}, // 9 of the 10 in (5, 10]
		{0.25, 500 * time.Microsecond},  // 25 of the 50 in (0, 1]
	} {
		got, err := h.quantile(c.q)
		if err != nil || got.Round(time.Microsecond) != c.want {
			t.Errorf("quantile(%g) = %s, %v; want %s", c.q, got, err, c.want)
		}
	}
	if got, err := (histogram{}).quantile(0.99); got != 0 || err != nil {
		t.Errorf("an empty histogram's p99: %s, %v; want 0", got, err)
	}
	if _, err := (histogram{0.01: 0, math.Inf(1): 5}).quantile(0.5); err == nil {
		t.Error("a quantile above the largest bound: no error")
	}
}
