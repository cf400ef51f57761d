package validator

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
)

// Exec replaces the process with argv: the proxy's own command, once the check folded into the
// proxy's start has passed. argv[0] is looked up in PATH when it holds no slash, as the
// container runtime looks up a container's command. The proxy then is this same process: its
// PID, signals, exit code, standard output and error, environment and arguments (spaces and all)
// are its own. Exec returns only when the exec fails, with an [*Error] to exit with.
func Exec(argv []string) error {
	if len(argv) == 0 || argv[0] == "" {
		return &Error{Code: ExitUsage, Msg: "no command to start after the check: write it after --"}
	}
	path := argv[0]
	if !strings.Contains(path, "/") {
		p, err := exec.LookPath(path)
		if err != nil && !errors.Is(err, exec.ErrDot) {
			return &Error{Code: ExitFailure, Msg: fmt.Sprintf(
				"the redirect is in place, but the command to start after the check, %q, is not on this container's PATH (%s): %v; proxy.command in the webhook configuration must name a program of the proxy's image",
				path, os.Getenv("PATH"), err)}
		}
		path = p
	}
	err := syscall.Exec(path, argv, os.Environ())
	return &Error{Code: ExitFailure, Msg: fmt.Sprintf(
		"the redirect is in place, but starting %s failed: %v; proxy.command in the webhook configuration must name a program of the proxy's image", path, err)}
}
