package framework

import (
	"bufio"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Every process of a run lives under one cgroup of its own, named after the run, in every
// hierarchy: the holder and the daemons in <run>/system, the pods where the kubelet puts them
// (its cgroupRoot is <run>). Killing what a run left — at its end, or when a later run sweeps
// an earlier one that crashed — is killing that cgroup's tree; removing it is removing the
// directories, deepest first.

// CgroupHierarchies returns the mount points of the cgroup hierarchies (v1 and v2).
func CgroupHierarchies() ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var dirs []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// 36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue
		fields := strings.Fields(sc.Text())
		sep := slices.Index(fields, "-")
		if sep < 0 || sep+1 >= len(fields) || len(fields) < 5 {
			continue
		}
		if t := fields[sep+1]; t == "cgroup" || t == "cgroup2" {
			dirs = append(dirs, fields[4])
		}
	}
	return dirs, sc.Err()
}

// TrackingHierarchy is the hierarchy whose cgroup.procs list a run's processes: v1's pids
// controller, or the v2 hierarchy.
func TrackingHierarchy() (string, error) {
	dirs, err := CgroupHierarchies()
	if err != nil {
		return "", err
	}
	for _, d := range dirs {
		if filepath.Base(d) == "pids" {
			return d, nil
		}
	}
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "cgroup.controllers")); err == nil {
			return d, nil
		}
	}
	return "", fmt.Errorf("no cgroup hierarchy to track processes with (looked for v1 pids and v2)")
}

// createCgroup creates name in every hierarchy (the kubelet checks that its cgroupRoot
// exists in each), with v1 cpuset's cpus and mems copied from the root so that tasks can join.
func createCgroup(name string) error {
	dirs, err := CgroupHierarchies()
	if err != nil {
		return err
	}
	for _, d := range dirs {
		dir := filepath.Join(d, name)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("create cgroup %s: %w", dir, err)
		}
		if filepath.Base(d) == "cpuset" {
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				v, err := os.ReadFile(filepath.Join(d, f))
				if err != nil {
					return err
				}
				if err := os.WriteFile(filepath.Join(dir, f), v, 0o644); err != nil {
					return fmt.Errorf("set %s of %s: %w", f, dir, err)
				}
			}
		}
	}
	return nil
}

// joinCgroup moves pid into name/system of the tracking hierarchy; its children follow.
func joinCgroup(name string, pid int) error {
	h, err := TrackingHierarchy()
	if err != nil {
		return err
	}
	dir := filepath.Join(h, name, "system")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644)
}

// CgroupPIDs lists the processes in name's tree of the tracking hierarchy.
func CgroupPIDs(name string) []int {
	h, err := TrackingHierarchy()
	if err != nil {
		return nil
	}
	var pids []int
	filepath.WalkDir(filepath.Join(h, name), func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || d.Name() != "cgroup.procs" {
			return nil
		}
		data, _ := os.ReadFile(path)
		for _, f := range strings.Fields(string(data)) {
			if pid, err := strconv.Atoi(f); err == nil {
				pids = append(pids, pid)
			}
		}
		return nil
	})
	return pids
}

// killCgroup kills every process in name's tree but except, until none is left (processes
// may fork while it works) or 20 s have passed.
func killCgroup(name string, except int) error {
	deadline := time.Now().Add(20 * time.Second)
	for {
		pids := slices.DeleteFunc(CgroupPIDs(name), func(p int) bool { return p == except })
		if len(pids) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("processes %v of cgroup %s still run after SIGKILL", pids, name)
		}
		for _, p := range pids {
			syscall.Kill(p, syscall.SIGKILL)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// removeCgroup removes name's tree from every hierarchy, deepest first. A cgroup empties a
// moment after its last process is reaped, so it retries for a few seconds.
func removeCgroup(name string) error {
	dirs, err := CgroupHierarchies()
	if err != nil {
		return err
	}
	var last error
	for _, d := range dirs {
		root := filepath.Join(d, name)
		for attempt := 0; attempt < 50; attempt++ {
			if last = removeTree(root); last == nil {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	return last
}

func removeTree(root string) error {
	var dirs []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			dirs = append(dirs, path)
		}
		return nil
	})
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		return err
	}
	for i := len(dirs) - 1; i >= 0; i-- {
		if err := syscall.Rmdir(dirs[i]); err != nil && !os.IsNotExist(err) {
			return fmt.Errorf("remove cgroup %s: %w", dirs[i], err)
		}
	}
	return nil
}
