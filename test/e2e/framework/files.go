package framework

import (
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"

	"github.com/detourmesh/detour/internal/fsutil"
)

// writeFiles writes everything the node's processes read: certificates and kubeconfigs, the
// configurations of containerd and the kubelet, the primary CNI's conflist and plugins, and
// the runtime's PATH.
func (n *Node) writeFiles() error {
	for _, d := range []string{"logs", "run", "etcd", "kubelet", "pod-logs", "volume-plugins", "runtime-bin", "cni/ipam"} {
		if err := os.MkdirAll(filepath.Join(n.Dir, d), 0o755); err != nil {
			return err
		}
	}
	for _, d := range []string{n.CNIConfDir, n.CNIBinDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	// containerd's state (the containers' rootfs mounts) lies below this directory, as below
	// /run/containerd (0711) on a real node: runc, as the root of a pod's user namespace
	// (hostUsers: false), must be able to traverse it.
	if err := os.Mkdir(filepath.Join(n.Dir, "containerd"), 0o711); err != nil && !os.IsExist(err) {
		return err
	}
	if err := n.writePKI(); err != nil {
		return err
	}
	files := map[string]string{
		"containerd.toml":   n.containerdConfig(),
		"kubelet.yaml":      n.kubeletConfig(),
		"audit-policy.yaml": auditPolicy,
		"resolv.conf":       "nameserver 127.0.0.1\n",
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(n.Dir, name), []byte(content), 0o644); err != nil {
			return err
		}
	}
	registryHost := net.JoinHostPort(NodeIP.String(), fmt.Sprint(RegistryPort))
	if err := os.MkdirAll(filepath.Join(n.registryHostsDir(), registryHost), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(n.registryHostsDir(), registryHost, "hosts.toml"), []byte(hostsTOML(registryHost)), 0o644); err != nil {
		return err
	}
	if n.flannel() {
		// Flannel's DaemonSet writes the conflist; flanneld its subnet file here.
		if err := os.MkdirAll(n.ownFlannelDir(), 0o755); err != nil {
			return err
		}
	} else if n.cilium() {
		// cilium-agent writes the conflist (cilium.go).
		if err := n.writeCiliumFiles(); err != nil {
			return err
		}
	} else if err := n.WritePrimaryConfig(); err != nil {
		return err
	}
	for _, p := range []string{"bridge", "host-local", "loopback", "portmap"} {
		if err := os.Symlink(n.Bin(p), filepath.Join(n.CNIBinDir, p)); err != nil {
			return err
		}
	}
	return n.writeRuntimePath()
}

// apiServerIPs are the addresses the API server's certificate names: loopback, the node's,
// and each family's kubernetes Service.
func (n *Node) apiServerIPs() []net.IP {
	ips := []net.IP{net.ParseIP("127.0.0.1"), NodeIP.AsSlice()}
	for _, fam := range n.Families().list() {
		if fam.nodeIP != NodeIP {
			ips = append(ips, fam.nodeIP.AsSlice())
		}
		ips = append(ips, fam.serviceIP.AsSlice())
	}
	return ips
}

// servingIPs are the addresses the kubelet's serving certificate names: the node's on the
// underlay and those it reports.
func (n *Node) servingIPs() []net.IP {
	ips := []net.IP{n.IP.AsSlice()}
	for _, ip := range n.IPs() {
		if ip != n.IP {
			ips = append(ips, ip.AsSlice())
		}
	}
	return ips
}

func (n *Node) writePKI() error {
	if n.cp != nil {
		n.pki, n.Kubeconfig = n.cp.pki, n.cp.Kubeconfig
		return n.issueKubeletPKI()
	}
	p, err := newPKI(filepath.Join(n.Dir, "pki"))
	if err != nil {
		return err
	}
	n.pki = p
	ids := []identity{
		{name: "apiserver", cn: "kube-apiserver", server: true,
			ips: n.apiServerIPs(),
			dns: []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"}},
		{name: "admin", cn: "e2e-admin", orgs: []string{"system:masters"}},
		{name: "apiserver-kubelet-client", cn: "kube-apiserver-kubelet-client", orgs: []string{"system:masters"}},
		{name: "kube-controller-manager", cn: "system:kube-controller-manager"},
		{name: "kube-scheduler", cn: "system:kube-scheduler"},
		// Bound to system:node-proxier by the API server's default policy, as kubeadm's.
		{name: "kube-proxy", cn: "system:kube-proxy"},
	}
	for _, id := range ids {
		if err := p.issue(id); err != nil {
			return fmt.Errorf("issue %s's certificate: %w", id.name, err)
		}
	}
	if err := p.serviceAccountKeys(); err != nil {
		return err
	}
	for _, name := range []string{"admin", "kube-controller-manager", "kube-scheduler", "kube-proxy"} {
		path, err := p.kubeconfig(n.apiURL(), name)
		if err != nil {
			return err
		}
		if name == "admin" {
			n.Kubeconfig = path
		}
	}
	return n.issueKubeletPKI()
}

// kubeletPKI is the name of the kubelet's client certificate and kubeconfig in the cluster's
// PKI directory; its serving certificate is this name with "-serving".
func (n *Node) kubeletPKI() string {
	if n.cp == nil {
		return "kubelet"
	}
	return n.Name + "-kubelet"
}

// issueKubeletPKI writes the kubelet's serving certificate and its kubeconfig, whose client
// certificate names the node (system:node:NAME, as the Node authorizer requires).
func (n *Node) issueKubeletPKI() error {
	name := n.kubeletPKI()
	for _, id := range []identity{
		{name: name + "-serving", cn: n.Name, server: true, ips: n.servingIPs(), dns: []string{n.Name}},
		{name: name, cn: "system:node:" + n.Name, orgs: []string{"system:nodes"}},
	} {
		if err := n.pki.issue(id); err != nil {
			return fmt.Errorf("issue %s's certificate: %w", id.name, err)
		}
	}
	_, err := n.pki.kubeconfig(n.apiURL(), name)
	return err
}

// WritePrimaryConfig writes the primary CNI's conflist as the primary would at boot: the
// reference bridge plugin with host-local IPAM, then portmap for the pods' hostPorts (as
// flannel's and Calico's conflists end), and nothing of detour's.
func (n *Node) WritePrimaryConfig() error { return n.WritePrimaryConfigVersion("1.1.0") }

// WritePrimaryConfigVersion writes the primary's conflist declaring cniVersion version (one
// detour-cni does not speak makes the node agent refuse to chain into it).
func (n *Node) WritePrimaryConfigVersion(version string) error {
	conf := fmt.Sprintf(`{
  "cniVersion": %q,
  "name": %q,
  "plugins": [
    {
      "type": "bridge",
      "bridge": %q,
      "isGateway": true,
      "isDefaultGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "dataDir": %q,
        "ranges": %s
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`, version, PrimaryNetwork, podBridge, filepath.Join(n.Dir, "cni", "ipam"), n.ipamRanges())
	// Always a new file, even with the same content: a CNI installer's rewrite.
	return fsutil.ReplaceFile(n.PrimaryConfigPath(), 0o644, func(w io.Writer) error {
		_, err := io.WriteString(w, conf)
		return err
	})
}

// ipamRanges is host-local's ranges: one range set per family, the primary first, each with
// the bridge's address as the pods' gateway.
func (n *Node) ipamRanges() string {
	var sets []string
	for _, p := range n.PodSubnets() {
		sets = append(sets, fmt.Sprintf(`[{"subnet": %q, "gateway": %q}]`, p, p.Addr().Next()))
	}
	return "[" + strings.Join(sets, ", ") + "]"
}

// PrimaryConfigPath is the primary CNI's conflist: the test's, flannel's on the flannel
// cluster, or Cilium's on the Cilium cluster.
func (n *Node) PrimaryConfigPath() string {
	if n.flannel() {
		return filepath.Join(n.CNIConfDir, flannelConflist)
	}
	if n.cilium() {
		return filepath.Join(n.CNIConfDir, ciliumConflist)
	}
	return filepath.Join(n.CNIConfDir, "10-e2e.conflist")
}

// Primary is the name of the primary CNI's network: PrimaryNetwork, or FlannelNetwork on the
// flannel cluster, CiliumNetwork on the Cilium cluster.
func (n *Node) Primary() string {
	if n.flannel() {
		return FlannelNetwork
	}
	if n.cilium() {
		return CiliumNetwork
	}
	return PrimaryNetwork
}

// writeRuntimePath fills the directory that is containerd's whole PATH, and so the CNI
// plugins': the runc shim, runc, and the iptables tools detour-cni's iptables backends run —
// no nsenter, nothing else of util-linux (seed 002).
func (n *Node) writeRuntimePath() error {
	dir := filepath.Join(n.Dir, "runtime-bin")
	for _, b := range []string{"containerd-shim-runc-v2", "runc"} {
		if err := os.Symlink(n.Bin(b), filepath.Join(dir, b)); err != nil {
			return err
		}
	}
	for _, fam := range []string{"iptables", "ip6tables"} {
		for _, tool := range []string{"", "-save", "-restore", "-legacy", "-legacy-save", "-legacy-restore", "-nft", "-nft-save", "-nft-restore"} {
			for _, sbin := range []string{"/usr/sbin", "/sbin"} {
				if target := filepath.Join(sbin, fam+tool); fileExists(target) {
					if err := os.Symlink(target, filepath.Join(dir, fam+tool)); err != nil {
						return err
					}
					break
				}
			}
		}
	}
	return nil
}

// RuntimePath is containerd's PATH.
func (n *Node) RuntimePath() string { return filepath.Join(n.Dir, "runtime-bin") }

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// auditPolicy records who reads and writes pods, nothing else.
const auditPolicy = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    resources:
      - group: ""
        resources: ["pods"]
  - level: None
`

func (n *Node) containerdConfig() string {
	d := filepath.Join(n.Dir, "containerd")
	return fmt.Sprintf(`version = 3
root = %[1]q
state = %[2]q

[grpc]
  address = %[3]q

[ttrpc]
  address = %[4]q

[plugins.'io.containerd.internal.v1.opt']
  path = %[5]q

[plugins.'io.containerd.nri.v1.nri']
  disable = true

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = %[6]q
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = %[11]q

[plugins.'io.containerd.cri.v1.runtime']
  # CAP_SYS_RESOURCE is not in this machine's bounding set: without this every sandbox fails
  # to raise its oom_score_adj.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = 'runc'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = %[7]q
        Root = %[8]q
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = [%[9]q]
    conf_dir = %[10]q
    max_conf_num = 1

[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true
`, filepath.Join(d, "root"), filepath.Join(d, "state"), n.containerdSocket(), filepath.Join(d, "ttrpc.sock"),
		filepath.Join(d, "opt"), n.opts.PauseImage, n.Bin("runc"), filepath.Join(d, "runc"),
		n.CNIBinDir, n.CNIConfDir, n.registryHostsDir())
}

// registryHostsDir is containerd's registry configuration: how the node reaches the
// cluster's registry (registry.go).
func (n *Node) registryHostsDir() string { return filepath.Join(n.Dir, "certs.d") }

func (n *Node) kubeletConfig() string {
	pki := n.pki.path
	return fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
containerRuntimeEndpoint: unix://%[1]s
# The machine has cgroup v1 and no systemd for the node.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /%[2]s
failSwapOn: false
authentication:
  x509: {clientCAFile: %[3]q}
  webhook: {enabled: false}
  anonymous: {enabled: false}
authorization: {mode: AlwaysAllow}
tlsCertFile: %[4]q
tlsPrivateKeyFile: %[5]q
podLogsDir: %[6]q
volumePluginDir: %[7]q
resolvConf: %[8]q
imageGCHighThresholdPercent: 100
evictionHard: {memory.available: "100Mi", nodefs.available: "1%%", imagefs.available: "1%%", nodefs.inodesFree: "1%%"}
shutdownGracePeriod: 0s
serializeImagePulls: false
clusterDNS: [%[9]q]
clusterDomain: cluster.local
`, n.containerdSocket(), n.Cgroup, pki("ca.crt"), pki(n.kubeletPKI()+"-serving.crt"), pki(n.kubeletPKI()+"-serving.key"),
		filepath.Join(n.Dir, "pod-logs"), filepath.Join(n.Dir, "volume-plugins"), filepath.Join(n.Dir, "resolv.conf"), n.dnsIP()) + kubeletFeatureGates()
}

// KubeletFeatureGatesEnv names extra feature gates for every kubelet the e2e starts,
// "Name=true,Other=false": DETOUR_E2E_KUBELET_FEATURE_GATES=EventedPLEG=true measures the pod
// start benchmark with the kubelet's evented PLEG (docs/benchmarks.md).
const KubeletFeatureGatesEnv = "DETOUR_E2E_KUBELET_FEATURE_GATES"

// kubeletFeatureGates is the featureGates section of the kubelet's configuration from
// KubeletFeatureGatesEnv, or "" when it is unset. A malformed entry is written as it is, and the
// kubelet refuses to start with a message that names it.
func kubeletFeatureGates() string {
	v := strings.TrimSpace(os.Getenv(KubeletFeatureGatesEnv))
	if v == "" {
		return ""
	}
	out := "featureGates:\n"
	for _, g := range strings.Split(v, ",") {
		name, value, _ := strings.Cut(strings.TrimSpace(g), "=")
		out += fmt.Sprintf("  %s: %s\n", strings.TrimSpace(name), strings.TrimSpace(value))
	}
	return out
}
