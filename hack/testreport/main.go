// Command testreport reads `go test -json` on stdin, writes the run's full text log to -log,
// and prints its report (package summary, skipped tests, failing tests' output; see package
// report). It exits 1 when the run failed, or when -no-skips is set and a test was skipped.
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/detourmesh/detour/hack/testreport/report"
)

func main() {
	logPath := flag.String("log", "", "write the run's full text log here")
	noSkips := flag.Bool("no-skips", false, "a skipped test fails the run (CI: every test must run)")
	flag.Parse()
	log := os.Stdout
	if *logPath != "" {
		f, err := os.Create(*logPath)
		if err != nil {
			fmt.Fprintln(os.Stderr, "testreport:", err)
			os.Exit(2)
		}
		defer f.Close()
		log = f
	}
	run, err := report.Read(os.Stdin, log)
	if err != nil {
		fmt.Fprintln(os.Stderr, "testreport: read go test's output:", err)
		os.Exit(2)
	}
	os.Exit(run.Report(os.Stdout, *noSkips))
}
