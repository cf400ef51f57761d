package netlab

import (
	"fmt"
	"os"
	"syscall"
)

// Identity is the user a process runs as, as iptables owner matches see it; the zero value is
// root.
type Identity struct {
	UID, GID uint32
}

func (id Identity) String() string { return fmt.Sprintf("uid %d gid %d", id.UID, id.GID) }

// Become switches the calling process (all its threads) to id, dropping supplementary groups.
// It is for child processes started as root that must act as a container's user: they start
// as root because their binary may not be executable by that user, then drop.
func (id Identity) Become() error {
	if os.Geteuid() != 0 || id == (Identity{}) {
		return nil
	}
	if err := syscall.Setgroups(nil); err != nil {
		return fmt.Errorf("setgroups: %w", err)
	}
	if err := syscall.Setgid(int(id.GID)); err != nil {
		return fmt.Errorf("setgid %d: %w", id.GID, err)
	}
	if err := syscall.Setuid(int(id.UID)); err != nil {
		return fmt.Errorf("setuid %d: %w", id.UID, err)
	}
	return nil
}
