package report

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// goTestJSON runs the real `go test -json` over a module of the test's own and returns its
// event stream: the report is tested on what go test prints, not on a hand-written imitation.
func goTestJSON(t *testing.T, files map[string]string, args ...string) []byte {
	t.Helper()
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("no go command on PATH")
	}
	dir := t.TempDir()
	files["go.mod"] = "module example.test/m\n\ngo 1.26\n"
	for name, content := range files {
		path := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command("go", append([]string{"test", "-json", "-count=1"}, append(args, "./...")...)...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOFLAGS=", "GOWORK=off")
	out, _ := cmd.CombinedOutput() // fails by design
	return out
}

func report(t *testing.T, stream []byte, noSkips bool) (string, string, int) {
	t.Helper()
	var log, rep bytes.Buffer
	run, err := Read(bytes.NewReader(stream), &log)
	if err != nil {
		t.Fatal(err)
	}
	code := run.Report(&rep, noSkips)
	return rep.String(), log.String(), code
}

func TestReportFailuresSkipsAndTimeout(t *testing.T) {
	stream := goTestJSON(t, map[string]string{
		"good/good_test.go": `package good
import "testing"
func TestPass(t *testing.T) {}
func TestSkip(t *testing.T) { t.Skip("needs root to create namespaces") }
`,
		"bad/bad_test.go": `package bad
import "testing"
func TestPass(t *testing.T) {}
func TestStories(t *testing.T) {
	t.Run("first", func(t *testing.T) { t.Log("chatter") })
	t.Run("second", func(t *testing.T) { t.Errorf("fault %s: mounts left: %v", "node-rebooted", []string{"/run/netns"}) })
}
func TestLater(t *testing.T) { t.Fatal("kubelet is not running") }
`,
		"slow/slow_test.go": `package slow
import ("testing"; "time")
func TestWaits(t *testing.T) { t.Log("waiting for the pods to settle"); time.Sleep(time.Minute) }
`,
		"crash/crash_test.go": `package crash
import "testing"
func TestCrash(t *testing.T) { t.Log("about to crash"); var m map[string]int; m["x"] = 1 }
`,
		"nobuild/nobuild_test.go": `package nobuild
import "testing"
func TestX(t *testing.T) { undefined() }
`,
		"notests/notests.go": "package notests\n",
	}, "-timeout", "3s", "-p", "1") // -p 1: the packages fail in their order

	rep, log, code := report(t, stream, false)
	if code != 1 {
		t.Errorf("exit code %d, want 1", code)
	}
	for _, want := range []string{
		// The innermost failing test with its message, not its parent.
		"--- FAIL example.test/m/bad TestStories/second:",
		"fault node-rebooted: mounts left: [/run/netns]",
		"--- FAIL example.test/m/bad TestLater:",
		// The first failure in time, with its message, near the end.
		"first failing test: example.test/m/bad TestStories/second: fault node-rebooted: mounts left: [/run/netns]",
		// The timeout names the test that was running and its last line.
		"package example.test/m/slow reached go test's -timeout; still running: TestWaits",
		"waiting for the pods to settle",
		"FAIL example.test/m/slow",
		// A panic.
		"--- FAIL example.test/m/crash TestCrash:",
		"panic: assignment to entry in nil map",
		// The build error.
		"undefined: undefined",
		"skipped tests:\n  example.test/m/good TestSkip: needs root to create namespaces",
		"ok   example.test/m/good",
		"?    example.test/m/notests [no test files]",
		"test: FAILED",
	} {
		if !strings.Contains(rep, want) {
			t.Errorf("the report lacks %q:\n%s", want, rep)
		}
	}
	if strings.Contains(rep, "--- FAIL example.test/m/bad TestStories:") {
		t.Errorf("the report names the parent of the failing subtest as failing on its own:\n%s", rep)
	}
	if !strings.Contains(log, "=== RUN   TestStories/first") || !strings.Contains(log, "chatter") {
		t.Errorf("the full log lacks the passing tests' output:\n%s", log)
	}
	// The summary comes last: the end of a CI log.
	if lines := strings.Split(strings.TrimSpace(rep), "\n"); !strings.HasPrefix(lines[len(lines)-2], "tests: ") {
		t.Errorf("the report does not end with the totals:\n%s", rep)
	}
}

func TestReportPassAndRequiredSkips(t *testing.T) {
	stream := goTestJSON(t, map[string]string{
		"good/good_test.go": `package good
import "testing"
func TestPass(t *testing.T) { t.Run("sub", func(t *testing.T) {}) }
func TestSkip(t *testing.T) { t.Skip("iptables-nft-restore is not on PATH") }
`,
	})
	rep, _, code := report(t, stream, false)
	if code != 0 || !strings.Contains(rep, "tests: 2 passed, 0 failed, 1 skipped") || !strings.Contains(rep, "test: all tests passed") {
		t.Errorf("exit code %d, report:\n%s", code, rep)
	}
	rep, _, code = report(t, stream, true)
	if code != 1 || !strings.Contains(rep, "tests were skipped where every test must run") {
		t.Errorf("with skips not allowed: exit code %d, report:\n%s", code, rep)
	}
}

func TestReportEmptyStreamFails(t *testing.T) {
	if _, _, code := report(t, nil, false); code != 1 {
		t.Errorf("a run without any package passed")
	}
}
