package upstream

import (
	"strings"
	"testing"
	"time"
)

func TestReadRelabel(t *testing.T) {
	at := time.Date(2026, 12, 5, 20, 0, 0, 0, time.UTC)
	line := func(sec float64, text string) LogLine {
		return LogLine{Time: at.Add(time.Duration(sec * float64(time.Second))), Pod: "r/client", Text: text}
	}
	ok := "dial 10.96.0.9:8080 ok: server"
	failed := "dial 10.96.0.9:8080 failed: read tcp 127.0.0.6:4140: i/o timeout"
	lines := []LogLine{line(-1, ok), line(0.5, ok), line(17.2, ok), line(19.7, failed), line(22.2, failed), line(24.7, failed),
		line(25, "something else")}
	r := ReadRelabel("r/client", at, lines)
	if r.LastThrough != 17200*time.Millisecond || r.FirstDenied != 19700*time.Millisecond || r.After != 2 || r.Through != 0 || !r.Held(2) || r.Held(3) {
		t.Errorf("held: %+v", r)
	}
	flap := ReadRelabel("r/client", at, append(lines, line(26, ok)))
	if flap.Through != 1 || flap.Held(1) {
		t.Errorf("a dial through after the first denial: %+v", flap)
	}
	if never := ReadRelabel("r/client", at, lines[:3]); never.FirstDenied != 0 || never.Held(0) || !strings.Contains(never.String(), "never denied") {
		t.Errorf("never denied: %+v %s", never, never)
	}
}
