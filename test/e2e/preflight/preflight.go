// Package preflight checks that this machine can run the real node of detour's end-to-end tests
// (test/e2e) before anything is built or started: root, usable cgroups, the kernel features
// the node uses, disk space and, once built, its binaries. Each problem is one line that says
// what is missing and what to do, so that a run on an unfit host fails at once instead of half an
// hour later inside a component's log.
package preflight

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"

	"github.com/google/nftables"
	"github.com/moby/sys/mountinfo"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// MinFreeBytes is the free space the node needs where it keeps its run (the images unpacked by
// containerd, the pods' logs, etcd).
const MinFreeBytes = 4 << 30

// Options are what the check looks at besides the kernel.
type Options struct {
	// RunDir is where the node keeps its run (its free space is checked); empty: the temp dir.
	RunDir string
	// BinDir and Binaries: the binaries that must be there (none when BinDir is empty).
	BinDir   string
	Binaries []string
}

// Check returns one line per thing the node needs and this machine lacks; none when the node
// can run here.
func Check(opts Options) []string {
	var problems []string
	if os.Geteuid() != 0 {
		// Nothing below can be checked without root.
		return []string{"not root: the node creates namespaces, cgroups and mounts (run the tests as root)"}
	}
	problems = append(problems, cgroups()...)
	problems = append(problems, namespaces()...)
	for _, f := range []func() string{overlay, userNamespaces, seccomp, nft, haproxy, ipv6} {
		if p := f(); p != "" {
			problems = append(problems, p)
		}
	}
	if p := freeSpace(opts.RunDir); p != "" {
		problems = append(problems, p)
	}
	if opts.BinDir != "" {
		for _, b := range opts.Binaries {
			if _, err := os.Stat(filepath.Join(opts.BinDir, b)); err != nil {
				problems = append(problems, fmt.Sprintf("binary %s is not in %s: run hack/test-binaries.sh (make test does)", b, opts.BinDir))
			}
		}
	}
	return problems
}

// cgroups checks for the controllers the kubelet needs (cgroupfs driver) and that the test can
// create a cgroup in each hierarchy: v2 (unified) or v1 (one hierarchy per controller).
func cgroups() []string {
	infos, err := mountinfo.GetMounts(mountinfo.FSTypeFilter("cgroup", "cgroup2"))
	if err != nil {
		return []string{fmt.Sprintf("cannot read the mount table: %v", err)}
	}
	if len(infos) == 0 {
		return []string{"no cgroup filesystem is mounted: mount cgroup2 at /sys/fs/cgroup (or the v1 hierarchies)"}
	}
	have := map[string]string{} // controller → hierarchy
	var v1 bool
	for _, m := range infos {
		switch m.FSType {
		case "cgroup":
			v1 = true
			for opt := range strings.SplitSeq(m.VFSOptions, ",") {
				have[opt] = m.Mountpoint
			}
		case "cgroup2":
			data, err := os.ReadFile(filepath.Join(m.Mountpoint, "cgroup.controllers"))
			if err != nil {
				continue
			}
			for _, c := range strings.Fields(string(data)) {
				if _, ok := have[c]; !ok {
					have[c] = m.Mountpoint
				}
			}
		}
	}
	need := []string{"cpu", "cpuset", "memory", "pids"}
	version := "v2"
	if v1 {
		need, version = append(need, "cpuacct"), "v1"
	}
	var problems []string
	seen := map[string]bool{}
	for _, c := range need {
		dir, ok := have[c]
		if !ok {
			problems = append(problems, fmt.Sprintf("cgroup %s: no %s controller (the kubelet's cgroupfs driver needs %s)", version, c, strings.Join(need, ", ")))
			continue
		}
		if seen[dir] {
			continue
		}
		seen[dir] = true
		probe := filepath.Join(dir, fmt.Sprintf("detour-e2e-preflight-%d", os.Getpid()))
		if err := os.Mkdir(probe, 0o755); err != nil {
			problems = append(problems, fmt.Sprintf("cgroup %s: cannot create a cgroup in %s: %v", version, dir, err))
			continue
		}
		unix.Rmdir(probe)
	}
	return problems
}

// namespaces creates, on a thread of its own that is thrown away afterwards, a network
// namespace with what the node builds in its own: a veth pair, a bridge (the primary CNI's),
// an nf_tables table with a NAT chain (kube-proxy's Services, detour's rules).
func namespaces() []string {
	done := make(chan []string, 1)
	go func() {
		// Never unlocked: the thread ends with the goroutine, and its namespace with it.
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			done <- []string{fmt.Sprintf("cannot create a network namespace: %v", err)}
			return
		}
		var problems []string
		veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "preflight0"}, PeerName: "preflight1"}
		if err := netlink.LinkAdd(veth); err != nil {
			problems = append(problems, fmt.Sprintf("the kernel cannot create veth links (the node's IP, every pod's interface): %v", err))
		}
		if err := netlink.LinkAdd(&netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "preflight-br"}}); err != nil {
			problems = append(problems, fmt.Sprintf("the kernel cannot create bridges (the primary CNI's cni0): %v", err))
		}
		if err := natTable(); err != nil {
			problems = append(problems, fmt.Sprintf("nf_tables with NAT is missing (detour's rules, kube-proxy's Services): %v", err))
		}
		done <- problems
	}()
	return <-done
}

func natTable() error {
	c, err := nftables.New()
	if err != nil {
		return err
	}
	table := c.AddTable(&nftables.Table{Family: nftables.TableFamilyINet, Name: "preflight"})
	c.AddChain(&nftables.Chain{Name: "out", Table: table, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookOutput, Priority: nftables.ChainPriorityNATDest})
	return c.Flush()
}

// nft checks for the command kube-proxy's nftables mode runs for every change of its rules.
func nft() string {
	if _, err := exec.LookPath("nft"); err != nil {
		return "nft is not on PATH: kube-proxy (nftables mode) runs it on every node (Debian: apt-get install nftables; hack/host-deps.sh does as root)"
	}
	return ""
}

// ipv6 checks that the kernel has IPv6: the dual-stack node (TestE2EDualStack, in make test)
// gives its pods IPv6 addresses.
func ipv6() string {
	if _, err := os.Stat("/proc/sys/net/ipv6"); err != nil {
		return "the kernel has no IPv6 (/proc/sys/net/ipv6 is missing: booted with ipv6.disable=1?): the dual-stack node's pods need it"
	}
	return ""
}

// overlay mounts an overlay filesystem in a throwaway mount namespace: containerd's
// overlayfs snapshotter needs one per container.
func overlay() string {
	dir, err := os.MkdirTemp("", "detour-preflight-")
	if err != nil {
		return fmt.Sprintf("cannot create a temporary directory: %v", err)
	}
	defer os.RemoveAll(dir)
	for _, d := range []string{"lower", "upper", "work", "merged"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o755); err != nil {
			return err.Error()
		}
	}
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: see namespaces
		if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
			done <- fmt.Errorf("create a mount namespace: %w", err)
			return
		}
		if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
			done <- err
			return
		}
		data := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", filepath.Join(dir, "lower"), filepath.Join(dir, "upper"), filepath.Join(dir, "work"))
		err := unix.Mount("overlay", filepath.Join(dir, "merged"), "overlay", 0, data)
		if err == nil {
			err = unix.Unmount(filepath.Join(dir, "merged"), 0)
		}
		done <- err
	}()
	if err := <-done; err != nil {
		return fmt.Sprintf("cannot mount an overlay filesystem in %s (containerd's overlayfs snapshotter; modprobe overlay, and keep the run's directory off overlayfs): %v", dir, err)
	}
	return ""
}

func userNamespaces() string {
	data, err := os.ReadFile("/proc/sys/user/max_user_namespaces")
	if err != nil {
		return fmt.Sprintf("the kernel has no user namespaces (pods with hostUsers: false): %v", err)
	}
	if n, _ := strconv.Atoi(strings.TrimSpace(string(data))); n == 0 {
		return "user namespaces are off (pods with hostUsers: false): sysctl -w user.max_user_namespaces=15000"
	}
	return ""
}

func seccomp() string {
	data, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return fmt.Sprintf("cannot read /proc/self/status: %v", err)
	}
	if !strings.Contains(string(data), "\nSeccomp:") {
		return "the kernel has no seccomp: runc applies the RuntimeDefault profile to every sandbox"
	}
	return ""
}

func freeSpace(dir string) string {
	if dir == "" {
		dir = os.TempDir()
	}
	// The directory may not exist yet: its nearest existing parent holds it.
	for {
		if _, err := os.Stat(dir); err == nil || dir == filepath.Dir(dir) {
			break
		}
		dir = filepath.Dir(dir)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return fmt.Sprintf("cannot read the free space of %s: %v", dir, err)
	}
	if free := st.Bavail * uint64(st.Bsize); free < MinFreeBytes {
		return fmt.Sprintf("only %.1f GiB free in %s: the node needs %d GiB (set DETOUR_E2E_DIR elsewhere)", float64(free)/(1<<30), dir, MinFreeBytes>>30)
	}
	return ""
}

// Err joins problems into one error, a line each; nil when there are none.
func Err(problems []string) error {
	if len(problems) == 0 {
		return nil
	}
	problems = slices.Clone(problems)
	for i, p := range problems {
		problems[i] = "  - " + p
	}
	return errors.New("the real node cannot run on this machine:\n" + strings.Join(problems, "\n"))
}

// haproxy checks for the binary the HAProxy test image carries (test/images/haproxy.go), which
// every e2e run builds with the other test images.
func haproxy() string {
	if _, err := os.Stat("/usr/sbin/haproxy"); err != nil {
		return "/usr/sbin/haproxy is missing: the HAProxy test image carries it (Debian: apt-get install haproxy; hack/host-deps.sh does as root)"
	}
	return ""
}
