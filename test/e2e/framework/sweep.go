package framework

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// A run's directory holds an owner file: the test process's PID and start time. A later run
// sweeps every run whose owner no longer runs (a test killed by its timeout runs no cleanup):
// it kills what is left in the run's cgroup, removes the cgroups and the directory.

func writeOwner(dir string) error {
	start, err := processStart(os.Getpid())
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "owner"), []byte(fmt.Sprintf("%d %s\n", os.Getpid(), start)), 0o644)
}

// processStart is field 22 of /proc/PID/stat: the start time, which tells a PID's reuse apart.
func processStart(pid int) (string, error) {
	fields, err := procStat(pid)
	if err != nil {
		return "", err
	}
	return fields[19], nil
}

// ownerAlive reports whether the process that owns run dir still runs.
func ownerAlive(dir string) bool {
	data, err := os.ReadFile(filepath.Join(dir, "owner"))
	if err != nil {
		// No owner file yet (a run between creating its directory and writing the file) or
		// none any more: the PID in the name decides, so a live run is never swept.
		parts := strings.Split(filepath.Base(dir), "-")
		return len(parts) == 4 && fileExists("/proc/"+parts[2])
	}
	fields := strings.Fields(string(data))
	if len(fields) != 2 {
		return false
	}
	pid, err := strconv.Atoi(fields[0])
	if err != nil {
		return false
	}
	start, err := processStart(pid)
	return err == nil && start == fields[1]
}

// sweep removes the runs under base whose owner is gone, and cgroups of runs whose
// directory is gone.
func sweep(base string) {
	entries, _ := os.ReadDir(base)
	for _, e := range entries {
		dir := filepath.Join(base, e.Name())
		if !strings.HasPrefix(e.Name(), "detour-e2e-") || ownerAlive(dir) {
			continue
		}
		killCgroup(e.Name(), 0)
		removeCgroup(e.Name())
		os.RemoveAll(dir)
	}
	h, err := TrackingHierarchy()
	if err != nil {
		return
	}
	cgroups, _ := os.ReadDir(h)
	for _, c := range cgroups {
		// detour-e2e-<owner PID>-<random>: the run of a process that is gone.
		parts := strings.Split(c.Name(), "-")
		if !c.IsDir() || len(parts) != 4 || !strings.HasPrefix(c.Name(), "detour-e2e-") || fileExists("/proc/"+parts[2]) {
			continue
		}
		killCgroup(c.Name(), 0)
		removeCgroup(c.Name())
	}
}
