package framework

import (
	"crypto/tls"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
)

// env is the environment of the node's processes other than containerd.
func (n *Node) env() []string {
	return []string{"PATH=" + os.Getenv("PATH"), "HOME=" + n.Dir, "KUBECONFIG=" + n.Kubeconfig}
}

// command is how component name starts.
func (n *Node) command(name string) (argv, env []string) {
	pki := n.pki.path
	env = n.env()
	switch name {
	case "etcd":
		argv = []string{n.Bin("etcd"), "--name", "e2e", "--data-dir", filepath.Join(n.Dir, "etcd"),
			"--listen-client-urls", "http://127.0.0.1:2379", "--advertise-client-urls", "http://127.0.0.1:2379",
			"--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
			"--initial-cluster", "e2e=http://127.0.0.1:2380", "--unsafe-no-fsync", "--log-level", "warn"}
	case "kube-apiserver":
		argv = []string{n.kubeBin("kube-apiserver"),
			"--etcd-servers", "http://127.0.0.1:2379",
			"--bind-address", n.bindAll(), "--secure-port", fmt.Sprint(APIPort),
			// The kubernetes Service's endpoint: of the Services' primary family.
			"--advertise-address", n.IPs()[0].String(),
			"--service-cluster-ip-range", n.Families().serviceCIDRs(),
			"--tls-cert-file", pki("apiserver.crt"), "--tls-private-key-file", pki("apiserver.key"),
			"--client-ca-file", pki("ca.crt"),
			"--service-account-key-file", pki("sa.pub"), "--service-account-signing-key-file", pki("sa.key"),
			"--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
			"--authorization-mode", "Node,RBAC", "--enable-admission-plugins", "NodeRestriction",
			"--allow-privileged=true",
			"--kubelet-client-certificate", pki("apiserver-kubelet-client.crt"),
			"--kubelet-client-key", pki("apiserver-kubelet-client.key"),
			"--kubelet-certificate-authority", pki("ca.crt"),
			// No DNS in the node: reach the kubelet by its IP (logs, exec).
			"--kubelet-preferred-address-types", "InternalIP",
			// Call webhooks at a ready endpoint of their Service, not through its ClusterIP: a
			// connection to the ClusterIP that the API server keeps alive can outlive the
			// webhook pod kube-proxy translated it to, and a pod created right after the
			// webhook's rollout then waited out the call's 10 s (seen in CI, under load).
			"--enable-aggregator-routing=true",
			"--audit-policy-file", filepath.Join(n.Dir, "audit-policy.yaml"),
			"--audit-log-path", n.AuditLogPath(), "--audit-log-format", "json",
			"--profiling=false"}
	case "kube-controller-manager":
		argv = []string{n.kubeBin("kube-controller-manager"),
			"--kubeconfig", pki("kube-controller-manager.kubeconfig"),
			"--authentication-kubeconfig", pki("kube-controller-manager.kubeconfig"),
			"--authorization-kubeconfig", pki("kube-controller-manager.kubeconfig"),
			"--bind-address", "127.0.0.1", "--secure-port", "10257",
			"--use-service-account-credentials=true",
			"--service-account-private-key-file", pki("sa.key"), "--root-ca-file", pki("ca.crt"),
			"--cluster-signing-cert-file", pki("ca.crt"), "--cluster-signing-key-file", pki("ca.key"),
			"--service-cluster-ip-range", n.Families().serviceCIDRs(),
			"--leader-elect=false", "--profiling=false"}
		// On the bridge primary, of every family, each node's conflist holds its pod ranges
		// (host-local's, fixed by the node's index) and no Node carries them: the range
		// allocator hands out ranges round-robin, so a node that left and joined again would
		// be given other ones than its conflist's.
		if n.flannel() || n.cilium() {
			// Flannel's kube subnet manager, and Cilium's ipam mode kubernetes, take each
			// node's pod range from its Node.
			argv = append(argv, "--allocate-node-cidrs=true", "--cluster-cidr", ClusterCIDR.String(),
				"--node-cidr-mask-size", fmt.Sprint(podSubnet.Bits()))
		}
	case "kube-scheduler":
		argv = []string{n.kubeBin("kube-scheduler"),
			"--kubeconfig", pki("kube-scheduler.kubeconfig"),
			"--authentication-kubeconfig", pki("kube-scheduler.kubeconfig"),
			"--authorization-kubeconfig", pki("kube-scheduler.kubeconfig"),
			"--bind-address", "127.0.0.1", "--secure-port", "10259", "--leader-elect=false", "--profiling=false"}
	case "containerd":
		argv = []string{n.Bin("containerd"), "--config", filepath.Join(n.Dir, "containerd.toml")}
		env = []string{"PATH=" + n.RuntimePath(), "HOME=" + n.Dir}
	case "kubelet":
		argv = []string{n.kubeBin("kubelet"),
			"--config", filepath.Join(n.Dir, "kubelet.yaml"),
			"--kubeconfig", pki(n.kubeletPKI() + ".kubeconfig"),
			"--root-dir", filepath.Join(n.Dir, "kubelet"),
			"--hostname-override", n.Name, "--node-ip", joinAddrs(n.IPs()), "--v", "2"}
		if len(n.opts.Taints) > 0 {
			argv = append(argv, "--register-with-taints", strings.Join(n.opts.Taints, ","))
		}
		if len(n.opts.Labels) > 0 {
			argv = append(argv, "--node-labels", strings.Join(n.opts.Labels, ","))
		}
	case "kube-proxy":
		// nftables mode, as a cluster built today would choose. The conntrack table's size is
		// machine-wide, not the node's: left as it is.
		argv = []string{n.kubeBin("kube-proxy"),
			"--kubeconfig", pki("kube-proxy.kubeconfig"), "--hostname-override", n.Name,
			"--proxy-mode", "nftables",
			"--cluster-cidr", n.Families().clusterCIDRs(),
			"--conntrack-max-per-core", "0", "--conntrack-min", "0",
			"--healthz-bind-address", "0.0.0.0:10256", "--metrics-bind-address", "127.0.0.1:10249", "--v", "2"}
		// It runs nft for every change of its rules (Debian's nftables, in /usr/sbin).
		env = []string{"PATH=" + os.Getenv("PATH") + ":/usr/sbin:/sbin", "HOME=" + n.Dir}
	case "cilium-agent":
		argv, env = n.ciliumCommand()
	case "prometheus":
		// Started by the monitoring story, with the configuration it writes into PrometheusDir.
		dir := n.PrometheusDir()
		argv = []string{n.Bin("prometheus"), "--config.file", filepath.Join(dir, "prometheus.yml"),
			"--storage.tsdb.path", filepath.Join(dir, "data"), "--web.listen-address", PrometheusAddr,
			"--log.level", "warn"}
	default:
		panic("e2e: unknown component " + name)
	}
	return argv, env
}

// bindAll is the wildcard address the API server binds: IPv6's (both families) on a cluster
// with IPv6.
func (n *Node) bindAll() string {
	if n.Families().Has6() {
		return "::"
	}
	return "0.0.0.0"
}

// joinAddrs is addrs comma-separated.
func joinAddrs(addrs []netip.Addr) string {
	s := make([]string, len(addrs))
	for i, a := range addrs {
		s[i] = a.String()
	}
	return strings.Join(s, ",")
}

// PrometheusDir holds the Prometheus server's configuration, rules and data.
func (n *Node) PrometheusDir() string { return filepath.Join(n.Dir, "prometheus") }

// PrometheusAddr is where the Prometheus server listens, in the node's network namespace.
const PrometheusAddr = "127.0.0.1:9090"

// AuditLogPath is the API server's audit log: requests for pods, by whom (JSON lines).
func (n *Node) AuditLogPath() string { return filepath.Join(n.Dir, "logs", "audit.jsonl") }

// insecureTLS is for health checks of components whose serving certificates are self-signed.
func insecureTLS() *tls.Config { return &tls.Config{InsecureSkipVerify: true} }
