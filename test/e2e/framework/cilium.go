package framework

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/internal/fsutil"
	"github.com/detourmesh/detour/test/testenv"
)

// The Cilium cluster (issue 35): Cilium v1.20, not a conflist of the test's, is the primary CNI.
// cilium-agent on each node writes its conflist (05-cilium.conflist, network "cilium") once it
// is up, and cilium-cni, which the runtime runs for each pod, asks it for the pod's address and
// endpoint. The agent runs as one of the node's processes (a component, as kube-proxy is), not
// from Cilium's DaemonSet: it compiles its datapath with clang at start, and clang comes from the
// host (Debian's clang-19, hack/host-deps.sh) rather than from an image built here.
//
// Everything else is installed as Cilium's Helm chart installs it, rendered from the chart of
// the same module (helm template, beside the binaries): the ConfigMap cilium-config in
// kube-system, which the agent reads as its DaemonSet mounts it (--config-dir, one file per key),
// and the agent's ServiceAccount, ClusterRole and Roles, whose token (a TokenRequest) the agent
// talks to the API server with. The values are the chart's with ipam.mode kubernetes (the
// controller-manager allocates each node's pod range), tunnel routing over VXLAN, no operator,
// L7 proxy, Hubble or health checks, and a story's [CiliumConfig]; the node applies the CRDs,
// which Cilium's operator would. Only what differs from node to node is a flag: the paths of the
// node's CNI directories, the agent's state and its kubeconfig.
//
// What the agent would change on the machine stays the node's: it mounts its BPF filesystem in
// the node's mount namespace, its cgroup root is the node's own cgroup (bound in by the holder,
// ciliumBinds), and the two machine-wide sysctls it writes, kernel.unprivileged_bpf_disabled
// (which nothing can set back once it is 1) and kernel.timer_migration, have stand-ins
// (machineSysctls).

// CiliumConfig is what a story sets of Cilium's Helm values; the rest is the cluster's
// (ciliumValues).
type CiliumConfig struct {
	// Exclusive is cni.exclusive (true in Cilium's chart): the agent renames every other
	// configuration in the CNI config directory to *.cilium_bak, and watches the directory.
	Exclusive bool
	// KubeProxyReplacement is kubeProxyReplacement: Cilium serves Services itself, with socket
	// load balancing, and the nodes run no kube-proxy. It is chosen when the cluster starts.
	KubeProxyReplacement bool
	// SocketLBHostNamespaceOnly is socketLB.hostNamespaceOnly: socket load balancing only for
	// the host's processes, not in the pods' network namespaces.
	SocketLBHostNamespaceOnly bool
}

const (
	// CiliumNetwork is the name of Cilium's network (its conflist's "name").
	CiliumNetwork = "cilium"
	// CiliumNamespace is where the chart installs Cilium (its release namespace).
	CiliumNamespace = "kube-system"
	// CiliumConfigMap is the agent's configuration, as the chart renders it.
	CiliumConfigMap = "cilium-config"
	// ciliumConflist is the file the agent writes (--write-cni-conf-when-ready).
	ciliumConflist = "05-cilium.conflist"
	// ciliumHealthPort is the agent's health API (the chart's healthPort), in the node's
	// network namespace.
	ciliumHealthPort = 9879
	// llvmBin holds Debian's clang-19, which the agent runs as clang.
	llvmBin = "/usr/lib/llvm-19/bin"
)

// ciliumTemplates are the chart's templates the cluster installs: everything but the agent's
// DaemonSet (the agent is a node process) and what the values turn off.
var ciliumTemplates = []string{
	"templates/cilium-secrets-namespace.yaml",
	"templates/cilium-configmap.yaml",
	"templates/cilium-agent/serviceaccount.yaml",
	"templates/cilium-agent/clusterrole.yaml",
	"templates/cilium-agent/clusterrolebinding.yaml",
	"templates/cilium-agent/role.yaml",
	"templates/cilium-agent/rolebinding.yaml",
}

// ciliumMu serializes changes of the Cilium configuration of a cluster.
var ciliumMu sync.Mutex

// RequireCilium fails the test when Cilium's binaries or clang 19 are missing, saying how to
// get them.
func RequireCilium(t testing.TB) {
	t.Helper()
	for _, name := range []string{"cilium/cilium-agent", "cilium/cilium-cni", "cilium/bpf", "cilium/crds", "cilium/chart"} {
		if _, err := os.Stat(filepath.Join(testenv.BinDir(), name)); err != nil {
			t.Fatalf("Cilium is not built (%v): make e2e-cluster builds it (DETOUR_BINARIES=cluster bash hack/test-binaries.sh)", err)
		}
	}
	if _, err := os.Stat(filepath.Join(llvmBin, "clang")); err != nil {
		t.Fatalf("cilium-agent needs clang 19 (%v): make e2e-cluster installs it (DETOUR_HOST_DEPS=cluster bash hack/host-deps.sh)", err)
	}
}

// cilium reports whether Cilium is the cluster's primary CNI.
func (n *Node) cilium() bool { return n.root().opts.Cilium != nil }

// CiliumConfig is the cluster's Cilium configuration now.
func (n *Node) CiliumConfig() CiliumConfig {
	ciliumMu.Lock()
	defer ciliumMu.Unlock()
	return *n.root().opts.Cilium
}

// kubeProxy reports whether the node runs kube-proxy: not where Cilium replaces it.
func (n *Node) kubeProxy() bool {
	return !n.cilium() || !n.CiliumConfig().KubeProxyReplacement
}

// ciliumDir holds the agent's library directory (the datapath's sources), its configuration,
// kubeconfig and cgroup root.
func (n *Node) ciliumDir() string { return filepath.Join(n.Dir, "cilium") }

// ciliumConfigDir is the agent's --config-dir: cilium-config's keys, one file each.
func (n *Node) ciliumConfigDir() string { return filepath.Join(n.ciliumDir(), "config-map") }

// ciliumCgroupRoot is where the holder mounts the node's cgroup of the v2 hierarchy, the agent's
// cgroup root: its socket programs, when it attaches any, see the node's processes only.
func (n *Node) ciliumCgroupRoot() string { return filepath.Join(n.ciliumDir(), "cgroupv2") }

// writeCiliumFiles writes what the agent reads from the node's disk: its library directory,
// with the datapath's C sources as hack/test-binaries.sh keeps them beside the binaries, the
// mount point of its cgroup root, and cilium-cni among the node's CNI plugins.
func (n *Node) writeCiliumFiles() error {
	lib := filepath.Join(n.ciliumDir(), "lib")
	for _, d := range []string{lib, n.ciliumCgroupRoot(), n.ciliumConfigDir()} {
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

// ciliumCommand is how cilium-agent starts on the node: as the chart's DaemonSet starts it
// (--config-dir), with the node's own paths.
func (n *Node) ciliumCommand() (argv, env []string) {
	argv = []string{n.Bin("cilium/cilium-agent"),
		"--config-dir", n.ciliumConfigDir(),
		"--k8s-kubeconfig-path", filepath.Join(n.ciliumDir(), "kubeconfig"),
		"--lib-dir", filepath.Join(n.ciliumDir(), "lib"),
		"--cgroup-root", n.ciliumCgroupRoot(),
		"--write-cni-conf-when-ready", filepath.Join(n.CNIConfDir, ciliumConflist),
		"--cni-log-file", n.logPath("cilium-cni"),
	}
	env = []string{
		// clang first; iptables and ip in /usr/sbin.
		"PATH=" + llvmBin + ":" + os.Getenv("PATH") + ":/usr/sbin:/sbin",
		"HOME=" + n.Dir, "K8S_NODE_NAME=" + n.Name, "CILIUM_K8S_NAMESPACE=" + CiliumNamespace,
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

// ciliumValues are the chart's values for the cluster with cfg. The agent is privileged (a
// process of the node's, not a container): the chart then leaves procfs at /proc, where an
// unprivileged agent's DaemonSet mounts the host's at /host/proc.
func ciliumValues(cfg CiliumConfig) string {
	return fmt.Sprintf(`cluster: {name: e2e}
ipam: {mode: kubernetes}
k8s: {requireIPv4PodCIDR: true}
routingMode: tunnel
tunnelProtocol: vxlan
devices: node0
healthPort: %d
kubeProxyReplacement: %t
k8sServiceHost: %s
k8sServicePort: %d
socketLB: {hostNamespaceOnly: %t}
cni: {exclusive: %t}
l7Proxy: false
hubble: {enabled: false}
healthChecking: false
endpointHealthChecking: {enabled: false}
operator: {enabled: false}
envoy: {enabled: false}
securityContext: {privileged: true}
`, ciliumHealthPort, cfg.KubeProxyReplacement, NodeIP, APIPort, cfg.SocketLBHostNamespaceOnly, cfg.Exclusive)
}

// applyCilium renders the chart's objects with cfg's values and applies them: the CRDs first
// (created, not applied: the CiliumClusterwideNetworkPolicy CRD is too large for apply's
// last-applied annotation) when first, then the namespace, ConfigMap and RBAC.
func (n *Node) applyCilium(ctx context.Context, cfg CiliumConfig, first bool) error {
	if first {
		if _, stderr, err := n.Kubectl(ctx, "create", "-f", n.Bin("cilium/crds")); err != nil {
			return fmt.Errorf("create Cilium's CRDs: %w\n%s", err, stderr)
		}
	}
	v, err := n.Client.Discovery().ServerVersion()
	if err != nil {
		return fmt.Errorf("the API server's version, for Cilium's chart: %w", err)
	}
	values := filepath.Join(n.ciliumDir(), "values.yaml")
	if err := os.WriteFile(values, []byte(ciliumValues(cfg)), 0o644); err != nil {
		return err
	}
	args := []string{"template", "cilium", n.Bin("cilium/chart"), "--namespace", CiliumNamespace,
		"--kube-version", v.GitVersion, "-f", values}
	for _, t := range ciliumTemplates {
		args = append(args, "--show-only", t)
	}
	out, err := n.Helm(ctx, args...)
	if err != nil {
		return fmt.Errorf("render Cilium's chart: %w", err)
	}
	rendered := filepath.Join(n.ciliumDir(), "rendered.yaml")
	if err := os.WriteFile(rendered, []byte(out), 0o644); err != nil {
		return err
	}
	if _, stderr, err := n.Kubectl(ctx, "apply", "-f", rendered); err != nil {
		return fmt.Errorf("apply Cilium's objects: %w\n%s", err, stderr)
	}
	return nil
}

// writeCiliumConfig writes what the agent reads from the API's objects, as the kubelet would
// project them into its pod: cilium-config's keys into its config dir (only the files whose
// content changed), and a kubeconfig with a token of its ServiceAccount.
func (n *Node) writeCiliumConfig(ctx context.Context) error {
	cm, err := n.Client.CoreV1().ConfigMaps(CiliumNamespace).Get(ctx, CiliumConfigMap, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("read Cilium's configuration: %w", err)
	}
	dir := n.ciliumConfigDir()
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if _, ok := cm.Data[e.Name()]; !ok {
			if err := os.Remove(filepath.Join(dir, e.Name())); err != nil {
				return err
			}
		}
	}
	for k, v := range cm.Data {
		if err := writeIfChanged(filepath.Join(dir, k), v, 0o644); err != nil {
			return err
		}
	}
	exp := int64(24 * 3600)
	tok, err := n.Client.CoreV1().ServiceAccounts(CiliumNamespace).CreateToken(ctx, "cilium",
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &exp}}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("request a token of Cilium's ServiceAccount: %w", err)
	}
	kubeconfig := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster: {server: %q, certificate-authority-data: %q}
users:
- name: cilium
  user: {token: %q}
contexts:
- name: cilium
  context: {cluster: e2e, user: cilium}
current-context: cilium
`, n.apiURL(), base64.StdEncoding.EncodeToString(n.root().pki.caPEM()), tok.Status.Token)
	return writeIfChanged(filepath.Join(n.ciliumDir(), "kubeconfig"), kubeconfig, 0o600)
}

// writeIfChanged writes content to path atomically when it differs from what is there.
func writeIfChanged(path, content string, mode os.FileMode) error {
	_, err := fsutil.WriteFileAtomic(path, []byte(content), mode)
	return err
}

// launchCilium starts the agent without waiting for it: it waits itself for its Node's pod range,
// and the Node comes with the kubelet, which is ready only once the agent wrote its conflist.
func (n *Node) launchCilium(ctx context.Context) error {
	if err := n.writeCiliumConfig(ctx); err != nil {
		return err
	}
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

// RestartCilium restarts cilium-agent on every node of the cluster at once, as `kubectl -n
// kube-system rollout restart daemonset/cilium` does with enough unavailability allowed, and
// returns once every agent is healthy again.
func (cp *Node) RestartCilium(ctx context.Context) error {
	nodes := cp.Nodes()
	errs := make([]error, len(nodes))
	var wg sync.WaitGroup
	for i, n := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := n.StopComponent("cilium-agent"); err != nil {
				errs[i] = fmt.Errorf("node %s: stop cilium-agent: %w", n.Name, err)
				return
			}
			if err := n.launchCilium(ctx); err != nil {
				errs[i] = fmt.Errorf("node %s: %w", n.Name, err)
				return
			}
			errs[i] = n.waitCilium(ctx)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// SetCilium changes the cluster's Cilium configuration to cfg, as `helm upgrade` of Cilium's
// chart with those values would, followed by the restart of its agents that the chart's users
// do (or its rollOutCiliumPods does): the ConfigMap changes, then every agent restarts with it.
// Kube-proxy replacement cannot change on a running cluster here.
func (cp *Node) SetCilium(ctx context.Context, cfg CiliumConfig) error {
	if cfg.KubeProxyReplacement != cp.CiliumConfig().KubeProxyReplacement {
		return fmt.Errorf("kube-proxy replacement is chosen when the cluster starts (Options.Cilium)")
	}
	if err := cp.applyCilium(ctx, cfg, false); err != nil {
		return err
	}
	ciliumMu.Lock()
	*cp.opts.Cilium = cfg
	ciliumMu.Unlock()
	return cp.RestartCilium(ctx)
}

// CiliumMonitor starts `cilium-dbg monitor` against the node's agent, printing its policy
// verdicts and drops (the remote identity as a number) to the file out, until stop. A policy
// verdict names the identity Cilium judged a connection's peer by: a pod's, or a CIDR's (local
// identities, 16777216 and up), which is what tells an ipBlock rule's match from the wire.
func (n *Node) CiliumMonitor(out string) (stop func(), err error) {
	argv := []string{n.Bin("cilium/cilium-dbg"), "monitor", "--type", "policy-verdict", "--type", "drop", "--numeric"}
	pid, err := n.holder.start(argv, n.env(), out, out)
	if err != nil {
		return nil, fmt.Errorf("node %s: start cilium-dbg monitor: %w", n.Name, err)
	}
	return func() { n.holder.stop(pid, time.Second) }, nil
}

// CiliumState is what the node's agent knows, as cilium-dbg prints it: its endpoints, the
// identities it knows and their labels, its IP cache (address → identity) and its Services.
func (n *Node) CiliumState(ctx context.Context) string {
	var b strings.Builder
	for _, args := range [][]string{{"endpoint", "list"}, {"identity", "list"}, {"ip", "list", "--numeric"}, {"service", "list"}} {
		fmt.Fprintf(&b, "$ cilium-dbg %s\n", strings.Join(args, " "))
		out, err := n.Run(ctx, append([]string{n.Bin("cilium/cilium-dbg")}, args...)...)
		b.WriteString(out)
		if err != nil {
			fmt.Fprintf(&b, "(%v)\n", err)
		}
		b.WriteString("\n")
	}
	return b.String()
}
