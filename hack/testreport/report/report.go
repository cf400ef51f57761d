// Package report reads the event stream of `go test -json` and says what a run of the tests
// came to: one line per package, the tests that were skipped and why, and — when the run
// failed — each failing test's own output, a package that reached go test's -timeout with the
// tests that were still running and their last lines, and output that is no test's (a build
// error). hack/test.sh prints it at the end of `make test`, so that the end of a red CI log
// says why.
package report

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"
)

// event is one line of `go test -json` (cmd/test2json).
type event struct {
	Action  string
	Package string
	Test    string
	Elapsed float64
	Output  string
}

// Run is what one run of go test came to.
type Run struct {
	packages map[string]*pkg
	order    []string
	// other is output that belongs to no package's test events (build errors, go vet).
	other []string
	// failures counts the tests that failed so far: each failure's order in time.
	failures int
}

type pkg struct {
	name    string
	result  string // "ok", "FAIL", "no test files"
	elapsed time.Duration
	tests   map[string]*test
	order   []string // tests in the order they ran
	output  []string // the package's own lines (a timeout's panic, TestMain's)
	timeout bool
}

type test struct {
	name   string
	result string // "pass", "fail", "skip", "" while running
	output []string
	// failedAs is the test's place among the run's failures, in time (1: the first).
	failedAs int
}

// Read reads the stream until its end; the plain text of every event's output is copied to
// log (the run's full log) as it comes.
func Read(r io.Reader, log io.Writer) (*Run, error) {
	run := &Run{packages: map[string]*pkg{}}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 16<<20)
	for sc.Scan() {
		line := sc.Text()
		var ev event
		if !strings.HasPrefix(line, "{") || json.Unmarshal([]byte(line), &ev) != nil || ev.Action == "" {
			fmt.Fprintln(log, line)
			run.other = append(run.other, line)
			continue
		}
		if ev.Output != "" {
			io.WriteString(log, ev.Output)
		}
		run.add(ev)
	}
	return run, sc.Err()
}

func (r *Run) add(ev event) {
	if ev.Package == "" {
		if ev.Output != "" {
			r.other = append(r.other, strings.TrimRight(ev.Output, "\n"))
		}
		return
	}
	p := r.packages[ev.Package]
	if p == nil {
		p = &pkg{name: ev.Package, tests: map[string]*test{}}
		r.packages[ev.Package] = p
		r.order = append(r.order, ev.Package)
	}
	if ev.Test == "" {
		switch ev.Action {
		case "output", "build-output":
			out := strings.TrimRight(ev.Output, "\n")
			p.output = append(p.output, out)
			if strings.HasPrefix(out, "panic: test timed out after") {
				p.timeout = true
			}
			if strings.Contains(out, "[no test files]") {
				p.result = "no test files"
			}
		case "pass":
			p.result, p.elapsed = "ok", seconds(ev.Elapsed)
		case "fail", "build-fail":
			p.result, p.elapsed = "FAIL", seconds(ev.Elapsed)
		case "skip":
			if p.result == "" {
				p.result = "no test files"
			}
		}
		return
	}
	t := p.tests[ev.Test]
	if t == nil {
		t = &test{name: ev.Test}
		p.tests[ev.Test] = t
		p.order = append(p.order, ev.Test)
	}
	switch ev.Action {
	case "output":
		out := strings.TrimRight(ev.Output, "\n")
		if strings.HasPrefix(out, "panic: test timed out after") {
			p.timeout = true
		}
		t.output = append(t.output, out)
	case "pass", "fail", "skip":
		t.result = ev.Action
		if ev.Action == "fail" {
			r.failures++
			t.failedAs = r.failures
		}
	}
}

func seconds(s float64) time.Duration {
	return time.Duration(s * float64(time.Second)).Round(100 * time.Millisecond)
}

// Counts are the tests, subtests included, by result.
type Counts struct{ Passed, Failed, Skipped, Running int }

// Counts counts the run's tests.
func (r *Run) Counts() Counts {
	var c Counts
	for _, p := range r.packages {
		pc := p.counts()
		c.Passed, c.Failed, c.Skipped, c.Running = c.Passed+pc.Passed, c.Failed+pc.Failed, c.Skipped+pc.Skipped, c.Running+pc.Running
	}
	return c
}

func (p *pkg) counts() Counts {
	var c Counts
	for _, t := range p.tests {
		switch t.result {
		case "pass":
			c.Passed++
		case "fail":
			c.Failed++
		case "skip":
			c.Skipped++
		default:
			c.Running++
		}
	}
	return c
}

// Failed reports whether a package or a test failed, or the run printed no package at all.
func (r *Run) Failed() bool {
	for _, p := range r.packages {
		if p.result == "FAIL" || p.timeout || p.counts().Failed > 0 {
			return true
		}
	}
	return len(r.packages) == 0
}

// Skipped returns the skipped tests, each with the reason it gave ("pkg Test: reason").
func (r *Run) Skipped() []string {
	var out []string
	for _, name := range r.order {
		p := r.packages[name]
		for _, tn := range p.order {
			if t := p.tests[tn]; t.result == "skip" {
				out = append(out, fmt.Sprintf("%s %s: %s", shortName(name), tn, skipReason(t.output)))
			}
		}
	}
	return out
}

// skipReason is the test's last line of its own (t.Skip's message), without the file:line.
func skipReason(output []string) string {
	for i := len(output) - 1; i >= 0; i-- {
		l := strings.TrimSpace(output[i])
		if l == "" || strings.HasPrefix(l, "--- ") || strings.HasPrefix(l, "=== ") {
			continue
		}
		if _, msg, ok := strings.Cut(l, ".go:"); ok {
			if _, rest, ok := strings.Cut(msg, ": "); ok {
				return rest
			}
		}
		return l
	}
	return "(no reason given)"
}

// maxLines bounds each failing test's output in the report (its end is kept: the failure).
const maxLines = 120

// Write prints the report: the failures first (when the run failed), then one line per
// package, then the totals — the last lines a CI log shows.
func (r *Run) Write(w io.Writer) {
	if r.Failed() {
		r.writeFailures(w)
	}
	fmt.Fprintln(w, "packages:")
	for _, name := range r.order {
		p := r.packages[name]
		c := p.counts()
		switch {
		case p.result == "no test files":
			fmt.Fprintf(w, "  ?    %s [no test files]\n", name)
			continue
		case p.timeout:
			fmt.Fprintf(w, "  FAIL %s %s: go test's -timeout, %d tests still running\n", name, p.elapsed, c.Running)
			continue
		}
		result := p.result
		if result == "" {
			result = "FAIL"
		}
		line := fmt.Sprintf("  %-4s %s %s (%d passed", result, name, p.elapsed, c.Passed)
		if c.Failed > 0 {
			line += fmt.Sprintf(", %d failed", c.Failed)
		}
		if c.Skipped > 0 {
			line += fmt.Sprintf(", %d skipped", c.Skipped)
		}
		fmt.Fprintln(w, line+")")
	}
	c := r.Counts()
	fmt.Fprintf(w, "tests: %d passed, %d failed, %d skipped", c.Passed, c.Failed, c.Skipped)
	if c.Running > 0 {
		fmt.Fprintf(w, ", %d did not finish", c.Running)
	}
	fmt.Fprintln(w)
}

func (r *Run) writeFailures(w io.Writer) {
	if len(r.other) > 0 {
		fmt.Fprintln(w, "output of no test (build or vet errors, a crash before the tests):")
		for _, l := range tail(r.other, maxLines) {
			fmt.Fprintln(w, "  "+l)
		}
	}
	var first *test
	firstPkg := ""
	for _, name := range r.order {
		p := r.packages[name]
		if p.timeout {
			var running []string
			for _, tn := range p.order {
				if p.tests[tn].result == "" {
					running = append(running, tn)
				}
			}
			fmt.Fprintf(w, "package %s reached go test's -timeout; still running: %s\n", name, strings.Join(running, ", "))
			for _, tn := range running {
				fmt.Fprintf(w, "--- %s, its last lines before the timeout:\n", tn)
				for _, l := range tail(beforePanic(p.tests[tn].output), 30) {
					fmt.Fprintln(w, "  "+l)
				}
			}
		}
		for _, tn := range p.order {
			t := p.tests[tn]
			// A parent fails with its subtests: the innermost failing tests say why.
			if t.result != "fail" || p.hasFailingSubtest(tn) {
				continue
			}
			if first == nil || t.failedAs < first.failedAs {
				first, firstPkg = t, name
			}
			fmt.Fprintf(w, "--- FAIL %s %s:\n", name, tn)
			for _, l := range tail(t.output, maxLines) {
				fmt.Fprintln(w, "  "+l)
			}
		}
		if !p.timeout {
			for _, tn := range p.order {
				if t := p.tests[tn]; t.result == "" && !p.hasRunningSubtest(tn) {
					fmt.Fprintf(w, "--- %s %s did not finish:\n", name, tn)
					for _, l := range tail(beforePanic(t.output), maxLines) {
						fmt.Fprintln(w, "  "+l)
					}
				}
			}
		}
		if p.result == "FAIL" && p.counts().Failed == 0 && !p.timeout {
			fmt.Fprintf(w, "package %s failed outside its tests:\n", name)
			for _, l := range tail(p.output, maxLines) {
				fmt.Fprintln(w, "  "+l)
			}
		}
	}
	if first != nil {
		fmt.Fprintf(w, "first failing test: %s %s: %s\n", shortName(firstPkg), first.name, failureMessage(first.output))
	}
}

// failureMessage is the first message the test logged with its file and line (t.Error,
// t.Fatal), else its last line.
func failureMessage(output []string) string {
	for i, l := range output {
		l = strings.TrimSpace(l)
		if _, msg, ok := strings.Cut(l, ".go:"); ok && !strings.HasPrefix(l, "---") {
			if _, rest, ok := strings.Cut(msg, ": "); ok {
				// A message over several lines: keep a few.
				for _, more := range output[i+1 : min(i+4, len(output))] {
					if strings.HasPrefix(more, "        ") {
						rest += " ⏎ " + strings.TrimSpace(more)
					}
				}
				return rest
			}
		}
	}
	return skipReason(output)
}

// beforePanic is output up to a panic (go test's goroutine dump follows it in the test's output).
func beforePanic(output []string) []string {
	for i, l := range output {
		if strings.HasPrefix(l, "panic: ") {
			return output[:i+1]
		}
	}
	return output
}

func (p *pkg) hasRunningSubtest(name string) bool {
	return slices.ContainsFunc(p.order, func(tn string) bool {
		return strings.HasPrefix(tn, name+"/") && p.tests[tn].result == ""
	})
}

func (p *pkg) hasFailingSubtest(name string) bool {
	return slices.ContainsFunc(p.order, func(tn string) bool {
		return strings.HasPrefix(tn, name+"/") && p.tests[tn].result == "fail"
	})
}

func tail(lines []string, n int) []string {
	if len(lines) <= n {
		return lines
	}
	return append([]string{fmt.Sprintf("… %d lines before", len(lines)-n)}, lines[len(lines)-n:]...)
}

func shortName(pkg string) string {
	return strings.TrimPrefix(pkg, "github.com/detourmesh/detour/")
}

// Report writes the skipped tests and the report (see [Run.Write]) and returns the exit code of
// the run: 1 when it failed, or when noSkips is set and a test was skipped; else 0.
func (r *Run) Report(w io.Writer, noSkips bool) int {
	skipped := r.Skipped()
	if len(skipped) > 0 {
		fmt.Fprintln(w, "skipped tests:")
		for _, s := range skipped {
			fmt.Fprintln(w, "  "+s)
		}
	}
	r.Write(w)
	switch {
	case r.Failed():
		fmt.Fprintln(w, "test: FAILED")
		return 1
	case noSkips && len(skipped) > 0:
		fmt.Fprintln(w, "test: tests were skipped where every test must run (DETOUR_REQUIRE_PRIVILEGED=1)")
		return 1
	}
	fmt.Fprintln(w, "test: all tests passed")
	return 0
}
