package upstream

import (
	"encoding/xml"
	"fmt"
	"strings"
	"time"
)

// Status is a test's outcome.
type Status string

const (
	StatusPassed  Status = "passed"
	StatusFailed  Status = "failed"
	StatusSkipped Status = "skipped"
	// StatusMissing: the report does not name the test (it does not exist in this e2e.test).
	StatusMissing Status = "missing"
)

// Result is one test's outcome in one run.
type Result struct {
	Name     string
	Status   Status
	Duration time.Duration
	// Message is why it failed or was skipped (the start of Ginkgo's text).
	Message string
	// Output is what the test wrote: Ginkgo's timeline of it (its steps and the framework's log
	// lines, system-err) and its captured output (system-out).
	Output string
}

// junitReport is what ParseJUnit reads of a Ginkgo JUnit report.
type junitReport struct {
	XMLName xml.Name `xml:"testsuites"`
	Suites  []struct {
		Cases []struct {
			Name    string  `xml:"name,attr"`
			Status  string  `xml:"status,attr"`
			Time    float64 `xml:"time,attr"`
			Failure *struct {
				Message string `xml:"message,attr"`
				Text    string `xml:",chardata"`
			} `xml:"failure"`
			Error *struct {
				Message string `xml:"message,attr"`
				Text    string `xml:",chardata"`
			} `xml:"error"`
			Skipped *struct {
				Message string `xml:"message,attr"`
			} `xml:"skipped"`
			SystemErr string `xml:"system-err"`
			SystemOut string `xml:"system-out"`
		} `xml:"testcase"`
	} `xml:"testsuite"`
}

// ParseJUnit reads the JUnit report e2e.test writes (junit_<prefix>01.xml): one Result per
// test case, named as the test's full text (Ginkgo's "[It] " dropped). A case Ginkgo reports
// panicked, interrupted, aborted or timed out is failed.
func ParseJUnit(data []byte) ([]Result, error) {
	var r junitReport
	if err := xml.Unmarshal(data, &r); err != nil {
		return nil, fmt.Errorf("read the JUnit report: %w", err)
	}
	var out []Result
	for _, s := range r.Suites {
		for _, c := range s.Cases {
			res := Result{
				Name:     strings.TrimPrefix(c.Name, "[It] "),
				Duration: time.Duration(c.Time * float64(time.Second)),
				Output:   c.SystemErr + c.SystemOut,
			}
			switch {
			case c.Failure != nil:
				res.Status, res.Message = StatusFailed, firstLine(c.Failure.Message, c.Failure.Text)
			case c.Error != nil:
				res.Status, res.Message = StatusFailed, firstLine(c.Error.Message, c.Error.Text)
			case c.Skipped != nil || c.Status == "skipped" || c.Status == "pending":
				res.Status = StatusSkipped
				if c.Skipped != nil {
					res.Message = firstLine(c.Skipped.Message)
				}
			case c.Status == "passed" || c.Status == "":
				res.Status = StatusPassed
			default:
				res.Status, res.Message = StatusFailed, c.Status
			}
			out = append(out, res)
		}
	}
	return out, nil
}

// firstLine is the first non-empty line of the first non-empty text.
func firstLine(texts ...string) string {
	for _, t := range texts {
		for line := range strings.SplitSeq(t, "\n") {
			if line = strings.TrimSpace(line); line != "" {
				return line
			}
		}
	}
	return ""
}
