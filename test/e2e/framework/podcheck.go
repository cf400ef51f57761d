package framework

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// PodNetns returns pod p's network namespace as a path the node's processes can open:
// /proc/<pid>/ns/net of a process in the pod's cgroup (pod<UID>, below the cluster's), the
// same namespace as its sandbox's. Every node of the cluster has its pods below the
// control-plane node's cgroup.
func (e *Env) PodNetns(p *corev1.Pod) (string, error) {
	h, err := TrackingHierarchy()
	if err != nil {
		return "", err
	}
	want := "pod" + string(p.UID)
	var pid int
	filepath.WalkDir(filepath.Join(h, e.Node.Cgroup), func(path string, d fs.DirEntry, err error) error {
		if err != nil || pid != 0 || !d.IsDir() || d.Name() != want {
			return nil
		}
		for _, q := range CgroupPIDs(strings.TrimPrefix(path, h+"/")) {
			if _, err := os.Stat(fmt.Sprintf("/proc/%d/ns/net", q)); err == nil {
				pid = q
				break
			}
		}
		return filepath.SkipDir
	})
	if pid == 0 {
		return "", fmt.Errorf("no process of pod %s/%s (cgroup %s) found below %s", p.Namespace, p.Name, want, filepath.Join(h, e.Node.Cgroup))
	}
	return "/proc/" + strconv.Itoa(pid) + "/ns/net", nil
}

// KillInPod sends SIGKILL to every process of pod p whose command name (/proc/<pid>/comm) is
// comm — a container's process crashing, which the kubelet then restarts — and returns how many
// it killed.
func (e *Env) KillInPod(p *corev1.Pod, comm string) (int, error) {
	h, err := TrackingHierarchy()
	if err != nil {
		return 0, err
	}
	want := "pod" + string(p.UID)
	killed := 0
	var errs []error
	filepath.WalkDir(filepath.Join(h, e.Node.Cgroup), func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() || d.Name() != want {
			return nil
		}
		for _, pid := range CgroupPIDs(strings.TrimPrefix(path, h+"/")) {
			name, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
			if err != nil || strings.TrimSpace(string(name)) != comm {
				continue
			}
			if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
				errs = append(errs, fmt.Errorf("kill %s (pid %d) of pod %s/%s: %w", comm, pid, p.Namespace, p.Name, err))
				continue
			}
			killed++
		}
		return filepath.SkipDir
	})
	return killed, errors.Join(errs...)
}

// DetourBin is the working tree's detour command, as built for the run.
func (e *Env) DetourBin() string { return filepath.Join(e.Artifacts.dir, "detour") }

// CheckPodRules runs `detour check -f <p's YAML> --netns <its namespace>` (the command bin, the
// working tree's when empty) inside the node, as an admin diagnosing a pod there does: the
// live rules in the pod's namespace against the ones its annotations call for, what
// detour-cni's CHECK compares. It returns the command's output, and an error when it exited
// non-zero (a check failed) or could not run.
func (e *Env) CheckPodRules(ctx context.Context, p *corev1.Pod, bin string) (string, error) {
	if bin == "" {
		bin = e.DetourBin()
	}
	netns, err := e.PodNetns(p)
	if err != nil {
		return "", err
	}
	pod := p.DeepCopy()
	pod.APIVersion, pod.Kind = "v1", "Pod"
	data, err := yaml.Marshal(pod)
	if err != nil {
		return "", err
	}
	f, err := os.CreateTemp(filepath.Join(e.Node.Dir, "run"), "pod-*.yaml")
	if err != nil {
		return "", err
	}
	defer os.Remove(f.Name())
	if _, err := f.Write(data); err != nil {
		f.Close()
		return "", err
	}
	if err := f.Close(); err != nil {
		return "", err
	}
	stdout, stderr, err := e.Node.RunSplit(ctx, nil, bin, "check", "--cni-conf-dir=", "-f", f.Name(), "--netns", netns)
	if err != nil {
		return stdout + stderr, fmt.Errorf("detour check of pod %s/%s: %w", p.Namespace, p.Name, err)
	}
	return stdout, nil
}
