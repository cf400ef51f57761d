package cniplugin

import (
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// Concurrent ADDs (the runtime runs one plugin process per sandbox) lose no count, and the
// buckets are cumulative as Prometheus exposes them.
func TestRecordAddConcurrent(t *testing.T) {
	dir := t.TempDir()
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Go(func() {
			for i := range 50 {
				result, d := AddRedirected, 3*time.Millisecond
				if w == 0 {
					result, d = AddFailed, time.Duration(i)*100*time.Millisecond // 0s to 4.9s
				}
				if err := RecordAdd(dir, result, d, false); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	s, err := ReadAddStats(filepath.Join(dir, StatsFileName))
	if err != nil {
		t.Fatal(err)
	}
	ok, failed := s.Results[AddRedirected], s.Results[AddFailed]
	if ok == nil || ok.Count != 150 || failed == nil || failed.Count != 50 {
		t.Fatalf("counts = %+v, want 150 redirected and 50 failed", s.Results)
	}
	for i, b := range ok.Buckets {
		if b != 150 {
			t.Errorf("redirected bucket le=%v = %d, want 150 (every ADD took 3ms)", AddDurationBuckets[i], b)
		}
	}
	// Failed ADDs took 0, 0.1, ..., 4.9 s: 1 is at most 0.005 s (le 0.005), 11 at most 1 s, 26 at
	// most 2.5 s, 50 at most 5 s.
	want := map[float64]uint64{0.005: 1, 0.1: 2, 1: 11, 2.5: 26, 5: 50, 10: 50}
	for i, le := range AddDurationBuckets {
		if w, ok := want[le]; ok && failed.Buckets[i] != w {
			t.Errorf("failed bucket le=%v = %d, want %d", le, failed.Buckets[i], w)
		}
	}
	if failed.SumSeconds < 122 || failed.SumSeconds > 123 {
		t.Errorf("failed sum = %v s, want 122.5", failed.SumSeconds)
	}
}

// A stats file that is not the plugin's (truncated, another program's) makes the plugin start
// over, and the agent reports it without exposing wrong counts.
func TestAddStatsCorrupt(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, StatsFileName)
	if err := os.WriteFile(path, []byte(`{"results":{"redirected":{"count":3,"buckets":[1]}}}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadAddStats(path); err == nil {
		t.Fatal("a histogram with the wrong number of buckets was read without an error")
	}
	if err := RecordAdd(dir, AddSkipped, time.Millisecond, false); err != nil {
		t.Fatal(err)
	}
	s, err := ReadAddStats(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(s.Results) != 1 || s.Results[AddSkipped].Count != 1 {
		t.Fatalf("after a corrupt file, stats = %+v, want one skipped ADD", s.Results)
	}
	if s, err := ReadAddStats(filepath.Join(dir, "missing")); err != nil || len(s.Results) != 0 {
		t.Fatalf("a missing file = %+v, %v; want no ADD and no error", s, err)
	}
}

// ADD counts each outcome in the state directory: passed through, failed.
func TestAddIsCounted(t *testing.T) {
	dir := t.TempDir()
	g := &fakeGetter{pods: map[string]PodMeta{"shop/web": {UID: "u-1"}}}
	p, _, _ := testPlugin(g)
	p.StateDir = dir
	if err := p.Add(cmdArgs(conf(t, `,"kubeconfig":"/etc/k"`), podArgs)); err != nil {
		t.Fatal(err)
	}
	g.err = errors.New("connection refused")
	if err := p.Add(cmdArgs(conf(t, `,"kubeconfig":"/etc/k"`), podArgs)); err == nil {
		t.Fatal("ADD with the API down succeeded")
	}
	s, err := ReadAddStats(filepath.Join(dir, StatsFileName))
	if err != nil {
		t.Fatal(err)
	}
	if s.Results[AddSkipped] == nil || s.Results[AddSkipped].Count != 1 || s.Results[AddFailed] == nil || s.Results[AddFailed].Count != 1 {
		t.Fatalf("stats = %+v, want one skipped and one failed ADD", s.Results)
	}
}

func FuzzParseAddStats(f *testing.F) {
	f.Add([]byte(`{"results":{"redirected":{"count":1,"sumSeconds":0.1,"buckets":[0,0,0,0,1,1,1,1,1,1,1]}}}`))
	f.Add([]byte(`{"results":{"x":null}}`))
	f.Add([]byte(``))
	f.Fuzz(func(t *testing.T, data []byte) {
		s, err := ParseAddStats(data)
		if err != nil {
			return
		}
		for r, h := range s.Results {
			if h == nil || len(h.Buckets) != len(AddDurationBuckets) {
				t.Fatalf("accepted result %q with %+v", r, h)
			}
		}
	})
}

// BenchmarkRecordAdd is what counting costs every ADD: open the stats file, lock it, read,
// update and rewrite it (make bench-cni; docs/benchmarks.md).
func BenchmarkRecordAdd(b *testing.B) {
	dir := b.TempDir()
	for i := 0; b.Loop(); i++ {
		if err := RecordAdd(dir, AddResults[i%len(AddResults)], time.Duration(i%1000)*time.Millisecond, false); err != nil {
			b.Fatal(err)
		}
	}
}
