package framework

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// ReplacedDirs are the host directories the node gets scratch copies of (see setUpHolder):
// on a real node they belong to its runtime, its kubelet and its logs.
var ReplacedDirs = []string{"/run", "/var/lib", "/var/log"}

// MountsUnder returns the mount points below any of dirs (not dirs themselves) in the mount
// namespace of process pid, deepest first: a parent's lazy unmount takes its children along.
func MountsUnder(pid int, dirs ...string) ([]string, error) {
	return mountPoints(pid, func(mp string) bool {
		return slices.ContainsFunc(dirs, func(d string) bool { return below(mp, d) })
	})
}

// mountPoints returns the mount points in the mount namespace of process pid that match,
// deepest first, each once.
func mountPoints(pid int, match func(mountpoint string) bool) ([]string, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	infos, err := mountinfo.GetMountsFromReader(f, func(m *mountinfo.Info) (skip, stop bool) {
		return !match(m.Mountpoint), false
	})
	if err != nil {
		return nil, fmt.Errorf("read the mount table of process %d: %w", pid, err)
	}
	out := make([]string, 0, len(infos))
	for _, m := range infos {
		if !slices.Contains(out, m.Mountpoint) {
			out = append(out, m.Mountpoint)
		}
	}
	slices.SortStableFunc(out, func(a, b string) int { return strings.Count(b, "/") - strings.Count(a, "/") })
	return out, nil
}

// below reports whether path lies strictly below dir.
func below(path, dir string) bool {
	rel, err := filepath.Rel(dir, path)
	return err == nil && rel != "." && rel != ".." && !strings.HasPrefix(rel, "../")
}

// detachHostMounts lazily unmounts, in the calling process's (private) mount namespace, every
// mount at or below dirs but those that hold keep (the run's directory) or are keep. A new
// mount namespace starts as a copy of the host's: iproute2's /run/netns (shared, and each `ip
// netns add` namespace bound below it), another runtime's or kubelet's mounts under /var/lib
// and /run, other tests' namespaces. Left below the node's scratch directories they would
// still be in its mount table, where a fault that unmounts the node's /run cannot reach them
// (its paths lead to the scratch directory), and each copy of a namespace's bind mount would
// keep that namespace alive while the node runs. A mount hidden by another at the same place
// (a second tmpfs over /run) cannot be reached by its path either: each pass detaches the
// mounts on top, with everything below them, until none is left.
func detachHostMounts(keep string, dirs ...string) error {
	match := func(mp string) bool {
		if mp == keep || below(keep, mp) {
			return false
		}
		return slices.ContainsFunc(dirs, func(d string) bool { return mp == d || below(mp, d) })
	}
	for range 16 {
		mounts, err := mountPoints(os.Getpid(), match)
		if err != nil || len(mounts) == 0 {
			return err
		}
		for _, m := range mounts {
			// EINVAL: not a mount point at this path any more (a parent's detach took it along,
			// or it is hidden until the mount on top of it goes).
			if err := unix.Unmount(m, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
				return fmt.Errorf("detach the host's mount %s: %w", m, err)
			}
		}
	}
	left, err := mountPoints(os.Getpid(), match)
	if err == nil && len(left) > 0 {
		err = fmt.Errorf("the host's mounts %v are still in the node's mount namespace after detaching them", left)
	}
	return err
}
