package demo

import (
	"fmt"
	"io"
	"strings"
	"time"
)

// narrator prints the demo's story: numbered sections, one line per step with ✓ or ✗, and
// indented details.
type narrator struct {
	w        io.Writer
	section  int
	failures []string
	start    time.Time
}

func (n *narrator) Section(title string) {
	n.section++
	fmt.Fprintf(n.w, "\n%2d. %s\n", n.section, title)
}

// OK reports a step that did what it should.
func (n *narrator) OK(format string, args ...any) {
	fmt.Fprintf(n.w, "    ✓ %s\n", fmt.Sprintf(format, args...))
}

// Fail reports a step that did not do what it should; the demo fails at the end.
func (n *narrator) Fail(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	n.failures = append(n.failures, msg)
	fmt.Fprintf(n.w, "    ✗ %s\n", msg)
}

// Expected reports a failure the demo shows on purpose.
func (n *narrator) Expected(format string, args ...any) {
	fmt.Fprintf(n.w, "    ✗ %s\n", fmt.Sprintf(format, args...))
}

// Note prints an indented line of explanation.
func (n *narrator) Note(format string, args ...any) {
	fmt.Fprintf(n.w, "      %s\n", fmt.Sprintf(format, args...))
}

// Block prints text indented under the current step.
func (n *narrator) Block(text string) {
	for line := range strings.Lines(strings.TrimRight(text, "\n") + "\n") {
		fmt.Fprintf(n.w, "        %s", line)
	}
}

// Check reports err as a failure, or ok as a success; it returns whether it succeeded.
func (n *narrator) Check(err error, format string, args ...any) bool {
	if err != nil {
		n.Fail("%s: %v", fmt.Sprintf(format, args...), err)
		return false
	}
	n.OK(format, args...)
	return true
}
