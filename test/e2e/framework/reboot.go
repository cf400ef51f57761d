package framework

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// Reboot plays a node reboot: the kubelet and containerd stop; every pod's process and
// containerd's shims are killed; what lives on tmpfs on a real node — containerd's state (the
// pods' network namespaces among it), runc's state, /run, the kubelet's tmpfs volumes — is
// unmounted and removed, so the pods' network namespaces are gone; the primary CNI writes its
// conflist again, as at boot, before anything of detour's runs; containerd and the kubelet
// start and the kubelet restarts the node's pods in new sandboxes. Disk stays: containerd's
// root (its metadata), the kubelet's directory, /etc/cni/net.d (detour's drop-in) and
// /opt/cni/bin, host-local's allocations.
//
// Whichever step fails, containerd and the kubelet are running again when it returns (or the
// error says why they are not): a failed reboot does not leave the node down.
func (n *Node) Reboot(ctx context.Context) (detail string, err error) {
	defer func() {
		if restore := n.EnsureRunning(ctx, "containerd", "kubelet"); restore != nil {
			err = errors.Join(err, restore)
		}
	}()
	for _, c := range []string{"kubelet", "containerd"} {
		if err := n.StopComponent(c); err != nil {
			return "", fmt.Errorf("stop %s: %w", c, err)
		}
	}
	killed, err := killPods(n.Cgroup)
	if err != nil {
		return "", err
	}
	state := filepath.Join(n.Dir, "containerd", "state")
	runc := filepath.Join(n.Dir, "containerd", "runc")
	volumes := filepath.Join(n.Dir, "kubelet", "pods")
	// Only the node's own mounts are here: the holder detached the host's (mounts.go).
	mounts, err := MountsUnder(n.holder.pid, state, runc, volumes, "/run")
	if err != nil {
		return "", err
	}
	var failed []string
	for _, m := range mounts {
		if _, err := n.Run(ctx, "umount", "-l", m); err != nil && !strings.Contains(err.Error(), "not mounted") {
			failed = append(failed, fmt.Sprintf("%s (%v)", m, strings.TrimSpace(err.Error())))
		}
	}
	if left, err := MountsUnder(n.holder.pid, state, runc, volumes, "/run"); err != nil || len(left) > 0 {
		return "", fmt.Errorf("mounts left after unmounting %d: %v (%v; failed unmounts: %v)", len(mounts), left, err, failed)
	}
	runDir := filepath.Join(n.Dir, "root", "run")
	entries, _ := os.ReadDir(runDir)
	for _, dir := range []string{state, runc} {
		if err := os.RemoveAll(dir); err != nil {
			return "", err
		}
	}
	for _, e := range entries {
		if err := os.RemoveAll(filepath.Join(runDir, e.Name())); err != nil {
			return "", err
		}
	}
	if err := n.WritePrimaryConfig(); err != nil {
		return "", err
	}
	// Started by the deferred EnsureRunning, which also restores them after a failed step.
	return fmt.Sprintf("killed %d processes, unmounted %d mounts, removed containerd's and runc's state and /run", killed, len(mounts)), nil
}

// killPods kills every process of the node's pods (the kubepods cgroup tree) and containerd's
// shims, until none is left.
func killPods(cgroup string) (int, error) {
	killed := map[int]bool{}
	deadline := time.Now().Add(30 * time.Second)
	for {
		var victims []int
		for _, pid := range CgroupPIDs(cgroup) {
			cg := ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
			cmd := strings.Split(ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid)), "\x00")
			// This node's only: a node that joined has its own subtree below the run's.
			shim := filepath.Base(cmd[0]) == "containerd-shim-runc-v2" && strings.Contains(cg, "/"+cgroup+"/system")
			if strings.Contains(cg, "/"+cgroup+"/kubepods") || shim {
				victims = append(victims, pid)
			}
		}
		if len(victims) == 0 {
			return len(killed), nil
		}
		if time.Now().After(deadline) {
			return len(killed), fmt.Errorf("processes %v of the node's pods still run after SIGKILL", victims)
		}
		for _, pid := range victims {
			syscall.Kill(pid, syscall.SIGKILL)
			killed[pid] = true
		}
		time.Sleep(100 * time.Millisecond)
	}
}
