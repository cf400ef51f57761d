package upstream

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"
)

// Runner runs argv (with env added) where the tests must run — inside a node's namespaces,
// which reach the API server, the nodes and the pods (the e2e package's Node.RunSplit).
type Runner func(ctx context.Context, env []string, argv ...string) (stdout, stderr string, err error)

// Options are one run of e2e.test.
type Options struct {
	// Binary is e2e.test, Kubectl the kubectl its tests run, Kubeconfig the cluster's admin.
	Binary, Kubectl, Kubeconfig string
	// ReportDir receives the run's JUnit report and log; Prefix names them.
	ReportDir, Prefix string
	// Tests are the full names of the tests to run (Smoke, Select).
	Tests []string
	// Nodes is the cluster's node count (the framework does not count them itself in every
	// process, and skips the tests that need more than it knows of).
	Nodes int
	// Timeout bounds the whole run (Ginkgo's own default is one hour).
	Timeout time.Duration
	// Procs above 1 runs the tests in that many parallel processes of e2e.test, with the
	// ginkgo command Ginkgo (the tests that must run alone, [Serial], are never selected).
	Procs  int
	Ginkgo string
}

// Run runs the tests of o with e2e.test and returns each one's result, in o.Tests' order. A
// test that fails is a result, not an error: the error is for a run that reported nothing
// (e2e.test could not start, or its suite set-up failed), with the end of its log.
func Run(ctx context.Context, run Runner, o Options) ([]Result, error) {
	if len(o.Tests) == 0 {
		return nil, fmt.Errorf("no tests to run")
	}
	if err := os.MkdirAll(o.ReportDir, 0o755); err != nil {
		return nil, err
	}
	focus := make([]string, len(o.Tests))
	for i, name := range o.Tests {
		focus[i] = regexp.QuoteMeta(name)
	}
	timeout := o.Timeout
	if timeout == 0 {
		timeout = time.Hour
	}
	e2eFlags := []string{"--kubeconfig", o.Kubeconfig, "--provider", "skeleton", "--kubectl-path", o.Kubectl,
		"--report-dir", o.ReportDir, "--report-prefix", o.Prefix, fmt.Sprintf("--num-nodes=%d", max(o.Nodes, 1))}
	// Ginkgo's own flags: on its command, or with e2e.test's "ginkgo." prefix when alone.
	ginkgoFlags := []string{"focus=" + strings.Join(focus, "|"), "timeout=" + timeout.String(), "no-color", "v"}
	var argv []string
	if o.Procs > 1 {
		argv = []string{o.Ginkgo, fmt.Sprintf("--procs=%d", o.Procs)}
		for _, f := range ginkgoFlags {
			argv = append(argv, "--"+f)
		}
		argv = append(append(argv, o.Binary, "--"), e2eFlags...)
	} else {
		argv = append([]string{o.Binary}, e2eFlags...)
		for _, f := range ginkgoFlags {
			argv = append(argv, "--ginkgo."+f)
		}
	}
	stdout, stderr, runErr := run(ctx, nil, argv...)
	logPath := filepath.Join(o.ReportDir, o.Prefix+"e2e.log")
	if err := os.WriteFile(logPath, []byte(stdout+stderr), 0o644); err != nil {
		return nil, err
	}
	report := filepath.Join(o.ReportDir, "junit_"+o.Prefix+"01.xml")
	data, err := os.ReadFile(report)
	if err != nil {
		return nil, fmt.Errorf("e2e.test wrote no report (%v; it exited with %v); its log %s ends with:\n%s", err, runErr, logPath, lastLines(stdout+stderr, 40))
	}
	all, err := ParseJUnit(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", report, err)
	}
	byName := map[string]Result{}
	for _, r := range all {
		byName[r.Name] = r
	}
	logged := timelines(stdout+stderr, o.Tests)
	results := make([]Result, len(o.Tests))
	for i, name := range o.Tests {
		r, ok := byName[name]
		if !ok {
			r = Result{Name: name, Status: StatusMissing}
		}
		if r.Output == "" {
			r.Output = logged[name]
		}
		results[i] = r
	}
	return results, nil
}

// timelines are the reports of the tests named in e2e.test's log, by name. With -v Ginkgo
// prints every test's timeline there, a passed one's too, which its JUnit report leaves out:
// a block between two rules of dashes that opens with the test's name (its labels after it).
func timelines(log string, names []string) map[string]string {
	out := map[string]string{}
	for block := range strings.SplitSeq(log, "\n------------------------------\n") {
		for _, name := range names {
			if strings.HasPrefix(block, name+" ") || strings.Contains(block, "\n"+name+" ") {
				out[name] = block
			}
		}
	}
	return out
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
