package cniplugin

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"syscall"
	"time"
)

// The plugin is a process per command, so it cannot serve metrics: it counts its ADDs in a
// small file in its state directory, and the node agent serves them (detour_cni_add_*).

// StatsFileName is the file in the plugin's state directory that counts its ADDs.
const StatsFileName = "add-stats.json"

// ADD results, the values of the result label.
const (
	// AddRedirected: the pod got detour's rules.
	AddRedirected = "redirected"
	// AddSkipped: the pod is not injected, or its namespace is excluded: passed through.
	AddSkipped = "skipped"
	// AddFailed: the ADD failed, and the runtime failed the pod's sandbox.
	AddFailed = "failed"
)

// AddResults lists the results in a fixed order.
var AddResults = []string{AddRedirected, AddSkipped, AddFailed}

// AddDurationBuckets are the upper bounds, in seconds, of the ADD duration histogram.
var AddDurationBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}

// AddStats are the ADDs counted since the state directory was created (a reboot empties it).
type AddStats struct {
	// Results holds one histogram per result.
	Results map[string]*AddHistogram `json:"results"`
	// InboundFallbacks counts the redirected ADDs whose pod asked for its listening ports only
	// (detour.dev/redirect-inbound: listening) but got every inbound connection redirected: the
	// kernel has no socket lookup.
	InboundFallbacks uint64 `json:"inboundFallbacks,omitempty"`
}

// AddHistogram counts the ADDs of one result and their durations.
type AddHistogram struct {
	Count uint64 `json:"count"`
	// SumSeconds is the total duration.
	SumSeconds float64 `json:"sumSeconds"`
	// Buckets[i] counts the ADDs that took at most AddDurationBuckets[i] (cumulative, as
	// Prometheus exposes them).
	Buckets []uint64 `json:"buckets"`
}

// observe counts one ADD of result that took d.
func (s *AddStats) observe(result string, d time.Duration) {
	if s.Results == nil {
		s.Results = map[string]*AddHistogram{}
	}
	h := s.Results[result]
	if h == nil || len(h.Buckets) != len(AddDurationBuckets) {
		h = &AddHistogram{Buckets: make([]uint64, len(AddDurationBuckets))}
		s.Results[result] = h
	}
	h.Count++
	h.SumSeconds += d.Seconds()
	i := sort.SearchFloat64s(AddDurationBuckets, d.Seconds())
	for ; i < len(h.Buckets); i++ {
		h.Buckets[i]++
	}
}

// RecordAdd counts one ADD in the stats file in dir, under an exclusive lock on the file, so
// that concurrent ADDs lose no count. A file it cannot parse starts over.
func RecordAdd(dir, result string, d time.Duration, inboundFallback bool) error {
	path := filepath.Join(dir, StatsFileName)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if errors.Is(err, os.ErrNotExist) {
		// The first ADD since the node's boot (the directory is on a tmpfs).
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return err
		}
		f, err = os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	}
	if err != nil {
		return err
	}
	defer f.Close()
	if err := lockWithin(f, syscall.LOCK_EX, statsLockWait); err != nil {
		return err
	}
	defer syscall.Flock(int(f.Fd()), syscall.LOCK_UN) //nolint:errcheck // closing unlocks too
	data, err := io.ReadAll(f)
	if err != nil {
		return err
	}
	s, err := ParseAddStats(data)
	if err != nil {
		s = AddStats{}
	}
	s.observe(result, d)
	if inboundFallback {
		s.InboundFallbacks++
	}
	out, err := json.Marshal(&s)
	if err != nil {
		return err
	}
	if err := f.Truncate(0); err != nil {
		return err
	}
	_, err = f.WriteAt(out, 0)
	return err
}

// statsLockWait bounds how long an ADD waits for the stats file: counting must never hold up a
// pod's sandbox, so past it the ADD goes uncounted. A reader (the node agent's scrape) waits no
// longer either: past it the read fails.
const statsLockWait = time.Second

// lockWithin takes f's lock of kind how (syscall.LOCK_EX or LOCK_SH), trying for at most wait.
func lockWithin(f *os.File, how int, wait time.Duration) error {
	deadline := time.Now().Add(wait)
	for {
		err := syscall.Flock(int(f.Fd()), how|syscall.LOCK_NB)
		if err == nil || !errors.Is(err, syscall.EWOULDBLOCK) {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the stats file %s stayed locked for %s", f.Name(), wait)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// ReadAddStats reads the stats file at path under a shared lock, waiting for it as long as an
// ADD waits for its own (statsLockWait). A missing file is no ADD yet.
func ReadAddStats(path string) (AddStats, error) {
	var s AddStats
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return s, nil
	}
	if err != nil {
		return s, err
	}
	defer f.Close()
	if err := lockWithin(f, syscall.LOCK_SH, statsLockWait); err != nil {
		return s, err
	}
	data, err := io.ReadAll(f)
	if err != nil {
		return s, err
	}
	s, err = ParseAddStats(data)
	if err != nil {
		return s, fmt.Errorf("parse the plugin's ADD counts %s: %w", path, err)
	}
	return s, nil
}

// ParseAddStats parses the stats file's content; empty content is no ADD yet.
func ParseAddStats(data []byte) (AddStats, error) {
	var s AddStats
	if len(data) == 0 {
		return s, nil
	}
	if err := json.Unmarshal(data, &s); err != nil {
		return AddStats{}, err
	}
	for r, h := range s.Results {
		if h == nil || len(h.Buckets) != len(AddDurationBuckets) {
			return AddStats{}, fmt.Errorf("result %q does not have %d buckets", r, len(AddDurationBuckets))
		}
	}
	return s, nil
}

// addResult is the result label of an ADD that ended with err and decision.
func addResult(decision string, err error) string {
	switch {
	case err != nil:
		return AddFailed
	case decision == "redirected":
		return AddRedirected
	}
	return AddSkipped
}
