package cli

import (
	"math"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"testing"
)

// detour webhook refuses to start on a bad configuration or flag, naming what is wrong,
// before it contacts any API server.
func TestWebhookCommandRefusesBadInput(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.yaml")
	if err := os.WriteFile(bad, []byte("proxy: {image: p, inboundPort: 0}\nsidecarMode: sometimes\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"webhook", "--config", filepath.Join(dir, "missing.yaml")}, []string{"read webhook config", "missing.yaml"}},
		{[]string{"webhook", "--config", bad}, []string{bad, "proxy.inboundPort: 0 is not valid", `sidecarMode: "sometimes" is not valid`, "does not start"}},
		{[]string{"webhook", "--config", bad, "--log-level", "loud"}, []string{`--log-level "loud"`}},
		{[]string{"webhook", "--config", bad, "--log-format", "xml"}, []string{`--log-format "xml"`}},
	} {
		_, _, err := run(t, "", tc.args...)
		for _, w := range tc.want {
			if err == nil || !strings.Contains(err.Error(), w) {
				t.Errorf("detour %v: error %v, want one containing %q", tc.args, err, w)
			}
		}
	}
	out, _, err := run(t, "", "webhook", "--help")
	if err != nil || !strings.Contains(out, "Examples:") || !strings.Contains(out, "/mutate-v1-pod") {
		t.Errorf("webhook --help: %v\n%s", err, out)
	}
}

// The webhook's GC defaults: GOGC 300 and a soft limit under the cgroup's memory limit, unless
// the environment sets its own.
func TestSetGCDefaults(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(100))
	defer debug.SetMemoryLimit(debug.SetMemoryLimit(math.MaxInt64))

	v2, v1, none := t.TempDir(), t.TempDir(), t.TempDir()
	write := func(path, s string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(filepath.Join(v2, "memory.max"), "268435456\n")
	write(filepath.Join(v1, "memory", "memory.limit_in_bytes"), "134217728\n")
	unlimitedV2, unlimitedV1 := t.TempDir(), t.TempDir()
	write(filepath.Join(unlimitedV2, "memory.max"), "max\n")
	write(filepath.Join(unlimitedV1, "memory", "memory.limit_in_bytes"), "9223372036854771712\n")

	env := func(kv ...string) func(string) string {
		return func(k string) string {
			for i := 0; i+1 < len(kv); i += 2 {
				if kv[i] == k {
					return kv[i+1]
				}
			}
			return ""
		}
	}
	for _, tc := range []struct {
		name      string
		getenv    func(string) string
		root      string
		gcPercent int // what the environment's GOGC set before, when it sets one
		wantGC    int
		wantLimit int64
	}{
		{"cgroup v2", env(), v2, 100, webhookGCPercent, 192 << 20},
		{"cgroup v1", env(), v1, 100, webhookGCPercent, 96 << 20},
		{"no cgroup limit", env(), none, 100, webhookGCPercent, math.MaxInt64},
		{"unlimited v2", env(), unlimitedV2, 100, webhookGCPercent, math.MaxInt64},
		{"unlimited v1", env(), unlimitedV1, 100, webhookGCPercent, math.MaxInt64},
		{"GOGC set", env("GOGC", "150"), v2, 150, 150, 192 << 20},
		{"GOMEMLIMIT set", env("GOMEMLIMIT", "1GiB"), v2, 100, webhookGCPercent, math.MaxInt64},
	} {
		t.Run(tc.name, func(t *testing.T) {
			debug.SetGCPercent(tc.gcPercent) // as the runtime would from GOGC
			debug.SetMemoryLimit(math.MaxInt64)
			gc, limit := setGCDefaults(tc.getenv, tc.root)
			if gc != tc.wantGC || limit != tc.wantLimit {
				t.Errorf("setGCDefaults = %d, %d; want %d, %d", gc, limit, tc.wantGC, tc.wantLimit)
			}
			if got := debug.SetGCPercent(-1); got != tc.wantGC {
				t.Errorf("GOGC in effect %d, want %d", got, tc.wantGC)
			}
			debug.SetGCPercent(tc.wantGC)
			if got := debug.SetMemoryLimit(-1); got != tc.wantLimit {
				t.Errorf("memory limit in effect %d, want %d", got, tc.wantLimit)
			}
		})
	}
}
