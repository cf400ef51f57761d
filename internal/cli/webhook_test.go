package cli

import (
	"os"
	"path/filepath"
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
