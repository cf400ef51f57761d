package upstream

import (
	"strings"
	"testing"
	"time"
)

// A stream opened again from its last line's second serves that second's lines again: read
// keeps only those after it, and stamps out of order within a stream (stdout and stderr are
// stamped apart) are kept.
func TestProxyLogsReadSkipsWhatAnEarlierStreamRead(t *testing.T) {
	l := &ProxyLogs{}
	first := "2026-12-05T20:26:46.753289121Z redirect in place\n" +
		"2026-12-05T20:26:46.781136945Z proxy admin listening on [::]:4191\n"
	last, n := l.read("x/a", strings.NewReader(first), time.Time{})
	if n != 2 || !last.Equal(time.Date(2026, 12, 5, 20, 26, 46, 781136945, time.UTC)) {
		t.Fatalf("first stream: %d lines, last %v; want 2, 20:26:46.781136945", n, last)
	}
	again := "2026-12-05T20:26:46.753289121Z redirect in place\n" +
		"2026-12-05T20:26:46.781136945Z proxy admin listening on [::]:4191\n" +
		"2026-12-05T20:26:47.926478018Z proxy inbound 10.88.0.57:55734 -> 10.88.1.60:80 app 127.0.0.1:80\n" +
		"not a line the kubelet stamped\n" +
		"2026-12-05T20:26:47.900000000Z proxy outbound 10.88.1.60:43130 -> 10.96.0.91:80\n"
	last, n = l.read("x/a", strings.NewReader(again), last)
	if n != 2 || !last.Equal(time.Date(2026, 12, 5, 20, 26, 47, 926478018, time.UTC)) {
		t.Fatalf("second stream: %d lines, last %v; want 2, 20:26:47.926478018", n, last)
	}
	lines, _ := l.Lines()
	var texts []string
	for _, line := range lines {
		texts = append(texts, line.Text)
	}
	want := []string{"redirect in place", "proxy admin listening on [::]:4191",
		"proxy inbound 10.88.0.57:55734 -> 10.88.1.60:80 app 127.0.0.1:80", "proxy outbound 10.88.1.60:43130 -> 10.96.0.91:80"}
	if strings.Join(texts, "|") != strings.Join(want, "|") {
		t.Errorf("lines %q, want %q", texts, want)
	}
}
