package netlab

import (
	"context"
	"fmt"
	"os/exec"
	"syscall"
)

// Self is the path that re-executes the running binary. It is a magic link: the kernel follows
// it to the binary without checking the directories on the way, so a child that has already
// taken on an unprivileged identity can still execute a test binary in go test's work
// directory (mode 0700, owned by root), which that identity could not reach by name.
const Self = "/proc/self/exe"

// Identity is the user a process runs as, as iptables owner matches see it; the zero value is
// root.
type Identity struct {
	UID, GID uint32
}

func (id Identity) String() string { return fmt.Sprintf("uid %d gid %d", id.UID, id.GID) }

// Command is the command that runs path with args as id, the way a container's process runs:
// with id's UID and GID and no supplementary groups, set by the kernel between fork and exec
// (so the child never runs as the caller). The zero Identity sets no credential: the child runs
// as the caller, which is root in the tests and the demo, and a caller that is not root can
// still start it. SysProcAttr is never nil, so callers can add to it (namespaces, ID mappings).
// Started from a thread in a network namespace, the child runs there; ctx kills it. To run the
// running binary itself, pass [Self] as path.
func (id Identity) Command(ctx context.Context, path string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, path, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{}
	if id != (Identity{}) {
		cmd.SysProcAttr.Credential = &syscall.Credential{Uid: id.UID, Gid: id.GID, Groups: []uint32{}}
	}
	return cmd
}
