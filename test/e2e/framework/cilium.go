package framework

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"
)

// The Cilium cluster (issue 35): Cilium v1.20, not a conflist of the test's, is the primary CNI.
// cilium-agent on each node writes its conflist (05-cilium.conflist, network "cilium") once it
// is up, and cilium-cni, which the runtime runs for each pod, asks it for the pod's address and
// endpoint. The agent runs as one of the node's processes (a component, as kube-proxy is), not
// from Cilium's DaemonSet: it compiles its datapath with clang at start, and clang comes from the
// host (Debian's clang-19, hack/host-deps.sh) rather than from an image built here. Its
// configuration is what Cilium's chart gives it with ipam.mode kubernetes (the controller-manager
// allocates each node's pod range), tunnel routing over VXLAN, kube-proxy beside it (no
// kube-proxy replacement), cni.exclusive false, and no operator, L7 proxy, Hubble or health
// checks; the node applies the CRDs, which Cilium's operator would. It talks to the API server as
// admin.
//
// What the agent would change on the machine stays the node's: it mounts its BPF filesystem in
// the node's mount namespace, its cgroup root is the node's own cgroup (bound in by the holder,
// ciliumBinds), and the two machine-wide sysctls it writes, kernel.unprivileged_bpf_disabled
// (which nothing can set back once it is 1) and kernel.timer_migration, have stand-ins
// (machineSysctls).

const (
	// CiliumNetwork is the name of Cilium's network (its conflist's "name").
	CiliumNetwork = "cilium"
	// ciliumConflist is the file the agent writes (--write-cni-conf-when-ready).
	ciliumConflist = "05-cilium.conflist"
	// ciliumHealthPort is the agent's health API (--agent-health-port's default), in the node's
	// network namespace.
	ciliumHealthPort = 9879
	// llvmBin holds Debian's clang-19, which the agent runs as clang.
	llvmBin = "/usr/lib/llvm-19/bin"
)

// cilium reports whether Cilium is the cluster's primary CNI.
func (n *Node) cilium() bool { return n.root().opts.Cilium }

// ciliumDir holds the agent's library directory (the datapath's sources) and its cgroup root.
func (n *Node) ciliumDir() string { return filepath.Join(n.Dir, "cilium") }

// ciliumCgroupRoot is where the holder mounts the node's cgroup of the v2 hierarchy, the agent's
// cgroup root: its socket programs, when it attaches any, see the node's processes only.
func (n *Node) ciliumCgroupRoot() string { return filepath.Join(n.ciliumDir(), "cgroupv2") }

// writeCiliumFiles writes what the agent reads: its library directory, with the datapath's C
// sources as hack/test-binaries.sh keeps them beside the binaries, the mount point of its cgroup
// root, and cilium-cni among the node's CNI plugins.
func (n *Node) writeCiliumFiles() error {
	lib := filepath.Join(n.ciliumDir(), "lib")
	for _, d := range []string{lib, n.ciliumCgroupRoot()} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	if err := os.Symlink(n.Bin("cilium/bpf"), filepath.Join(lib, "bpf")); err != nil {
		return err
	}
	return os.Symlink(n.Bin("cilium/cilium-cni"), filepath.Join(n.CNIBinDir, "cilium-cni"))
}

// ciliumBinds are the holder's mounts for the agent: the node's cgroup of the v2 hierarchy over
// its cgroup root. Without a v2 hierarchy there is none, and the agent mounts one itself.
func (n *Node) ciliumBinds() []bindMount {
	if !n.cilium() {
		return nil
	}
	dirs, err := CgroupHierarchies()
	if err != nil {
		return nil
	}
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "cgroup.controllers")); err == nil {
			return []bindMount{{Source: filepath.Join(d, n.Cgroup), Target: n.ciliumCgroupRoot()}}
		}
	}
	return nil
}

// ciliumCommand is how cilium-agent starts on the node.
func (n *Node) ciliumCommand() (argv, env []string) {
	argv = []string{n.Bin("cilium/cilium-agent"),
		"--k8s-kubeconfig-path", n.Kubeconfig,
		"--lib-dir", filepath.Join(n.ciliumDir(), "lib"),
		"--cgroup-root", n.ciliumCgroupRoot(),
		"--ipam", "kubernetes", "--k8s-require-ipv4-pod-cidr",
		"--enable-ipv4", "--enable-ipv6=false",
		"--routing-mode", "tunnel", "--tunnel-protocol", "vxlan",
		"--kube-proxy-replacement=false",
		"--enable-l7-proxy=false", "--enable-hubble=false",
		"--enable-health-checking=false", "--enable-endpoint-health-checking=false",
		"--identity-allocation-mode", "crd", "--cluster-name", "e2e",
		"--devices", "node0", "--agent-health-port", fmt.Sprint(ciliumHealthPort),
		"--write-cni-conf-when-ready", filepath.Join(n.CNIConfDir, ciliumConflist),
		"--cni-exclusive=false", "--cni-log-file", n.logPath("cilium-cni"),
	}
	env = []string{
		// clang first; iptables and ip in /usr/sbin.
		"PATH=" + llvmBin + ":" + os.Getenv("PATH") + ":/usr/sbin:/sbin",
		"HOME=" + n.Dir, "K8S_NODE_NAME=" + n.Name, "CILIUM_K8S_NAMESPACE=kube-system",
		// Another mount than the conf dir's, as the /tmp of Cilium's pod is on a node: the
		// agent writes its conflist with renameio, which makes the temporary file in TMPDIR
		// when it can rename from there into the conf dir. From the host's /tmp, the conflist
		// then only appears (a rename into the directory: a CREATE event), and containerd
		// 2.4.2 reloads its CNI configuration on writes, renames and removals, never on
		// creations (containerd/containerd#11715): the node stayed NotReady. From the holder's
		// /run the rename fails across mounts, and renameio writes the file in the conf dir
		// itself, then renames it there, as on a real node.
		"TMPDIR=/run",
	}
	return argv, env
}

// installCiliumCRDs creates Cilium's CRDs, as its operator would before the agents start.
func (n *Node) installCiliumCRDs(ctx context.Context) error {
	// create, not apply: the CiliumClusterwideNetworkPolicy CRD is too large for apply's
	// last-applied annotation.
	if _, stderr, err := n.Kubectl(ctx, "create", "-f", n.Bin("cilium/crds")); err != nil {
		return fmt.Errorf("create Cilium's CRDs: %w\n%s", err, stderr)
	}
	return nil
}

// launchCilium starts the agent without waiting for it: it waits itself for its Node's pod range,
// and the Node comes with the kubelet, which is ready only once the agent wrote its conflist.
func (n *Node) launchCilium() error {
	argv, env := n.command("cilium-agent")
	pid, err := n.holder.start(argv, env, n.logPath("cilium-agent"), "")
	if err != nil {
		return fmt.Errorf("start cilium-agent: %w", err)
	}
	n.mu.Lock()
	n.pids["cilium-agent"] = pid
	n.mu.Unlock()
	return nil
}

// waitCilium waits until the agent that launchCilium started reports itself healthy.
func (n *Node) waitCilium(ctx context.Context) error {
	err := Poll(ctx, 2*time.Minute, func() (bool, error) {
		if code, dead := n.Exited("cilium-agent"); dead {
			return false, fmt.Errorf("exited with code %d", code)
		}
		return n.ready(ctx, "cilium-agent"), Seen("its health API at 127.0.0.1:%d does not answer 200", ciliumHealthPort)
	})
	if err != nil {
		return fmt.Errorf("cilium-agent on %s is not ready: %w; its log %s ends with:\n%s", n.Name, err, n.logPath("cilium-agent"), Tail(n.Log("cilium-agent"), 30))
	}
	return nil
}
