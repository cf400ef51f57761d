package framework

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// The node's fixed addresses. They live in the node's own network namespace, so they never
// meet the host's or another run's.
var (
	// NodeIP is the control-plane node's address (on the underlay).
	NodeIP      = netip.MustParseAddr("10.200.0.1")
	serviceIP   = netip.MustParseAddr("10.96.0.1")
	podSubnet   = netip.MustParsePrefix("10.88.0.0/24")
	serviceCIDR = netip.MustParsePrefix("10.96.0.0/24")
	// dnsIP is the cluster DNS's ClusterIP (the kube-dns Service, the kubelet's clusterDNS).
	dnsIP = netip.MustParseAddr("10.96.0.10")
	// ClusterCIDR holds every node's pod range (family.at).
	ClusterCIDR = netip.MustParsePrefix("10.88.0.0/16")
	// underlay is the nodes' network: the control-plane node is NodeIP, the nodes that join
	// it the next addresses (cluster.go).
	underlay = netip.MustParsePrefix("10.200.0.0/24")
)

const (
	// APIPort is where kube-apiserver listens, on the node's IP.
	APIPort = 6443
	// NodeName is the name the kubelet registers.
	NodeName = "e2e-node"
	// PrimaryNetwork is the name of the primary CNI's network (its conflist's "name").
	PrimaryNetwork = "e2e"
	// StartupTaint is the taint the kubelet registers the node with, as an admin following
	// docs/operations.md would.
	StartupTaint = "detour.dev/cni-not-ready"
)

// Options shape a node.
type Options struct {
	// Taints the kubelet registers the node with (key:Effect or key=value:Effect).
	Taints []string
	// Labels the kubelet registers the node with (key=value).
	Labels []string
	// Images are docker-save tarballs imported into containerd before the kubelet starts.
	Images []string
	// PauseImage is the sandbox image (already in one of Images).
	PauseImage string
	// FlannelImage, when set, is flannel's image (already in one of Images): flannel is the
	// cluster's primary CNI (flannel.go), not the bridge conflist the test writes. The nodes
	// that join take the control-plane node's choice.
	FlannelImage string
	// Cilium, when set, makes Cilium the cluster's primary CNI (cilium.go), installed from its
	// chart with this configuration: cilium-agent runs on every node and writes its conflist.
	// With kube-proxy replacement, no node runs kube-proxy. The nodes that join take the
	// control-plane node's choice.
	Cilium *CiliumConfig
	// DNSImage, when set, is CoreDNS's image (DNSImage; already in one of Images): the
	// control-plane node deploys it as the cluster's DNS, kube-dns.
	DNSImage string
	// Kubernetes, when set, is the Kubernetes release ("v1.34.4") of the control plane,
	// kube-proxy and the kubelet, as hack/kubernetes-versions.sh built it (versions.go); else
	// hack/test-binaries.sh's. The nodes that join take the control-plane node's.
	Kubernetes string
	// Kubelet, when set, is the release of this node's kubelet alone: a node that lags its
	// control plane (versions.go).
	Kubelet string
	// Families are the cluster's IP families (families.go): IPv4 only when empty.
	Families Families
}

// Node is one Kubernetes node with its control plane: etcd, kube-apiserver,
// kube-controller-manager, kube-scheduler, containerd, the kubelet and kube-proxy (and, with
// Options.DNSImage, CoreDNS as the cluster's DNS), all built from their Go
// modules by hack/test-binaries.sh, in a network and mount namespace of their own.
type Node struct {
	// Name is the node's name.
	Name string
	// IP is the node's address on the underlay.
	IP netip.Addr
	// PodSubnet is its pods' range.
	PodSubnet netip.Prefix
	// Dir is the run's directory; everything the node writes is under it.
	Dir string
	// BinDir holds the binaries of hack/test-binaries.sh the node runs.
	BinDir string
	// CNIConfDir and CNIBinDir are the runtime's CNI directories (the chart's nodeAgent
	// cniConfDir and cniBinDir).
	CNIConfDir, CNIBinDir string
	// Kubeconfig is the admin kubeconfig, for commands run inside the node's namespace.
	Kubeconfig string
	// Config and Client reach the API server from the test process, as admin.
	Config *rest.Config
	// Client is the admin's clientset, from Config.
	Client kubernetes.Interface
	// Cgroup is the run's cgroup, relative to each hierarchy's root (see [CgroupHierarchies]):
	// every process of the node, the pods' included, is below it.
	Cgroup string

	opts   Options
	holder *holderClient
	pki    *pki

	// cp is the control-plane node a node joined (cluster.go); nil on the control-plane node.
	cp *Node
	// fams are the node's address and pods' range in each family of the cluster, the primary
	// first (IP and PodSubnet are the first's, but on an IPv6-only cluster, where IP is the
	// node's IPv4 address outside the cluster).
	fams []nodeFamily

	mu sync.Mutex
	// pids are the running components' processes; a component stopped on purpose is not here.
	pids map[string]int
	// mayExit are the components whose exit is no failure (ExpectExit).
	mayExit map[string]bool
	// joined are the nodes that joined this control-plane node and have not left, by name.
	joined map[string]*Node
	// kubelet is the kubelet's release since [Node.ReplaceKubelet] swapped it ("": Options').
	kubelet string
}

// Start brings a node up; Stop tears it down. Nothing it does outlives Stop on the host: its
// mounts live in its own mount namespace, its links in its own network namespace, its
// processes in its own cgroup tree, its files in Dir.
func Start(ctx context.Context, binDir string, opts Options) (n *Node, err error) {
	base := os.Getenv("DETOUR_E2E_DIR")
	if base == "" {
		base = filepath.Join(os.TempDir(), "detour-e2e")
	}
	sweep(base)
	suffix := make([]byte, 3)
	rand.Read(suffix)
	name := fmt.Sprintf("detour-e2e-%d-%s", os.Getpid(), hex.EncodeToString(suffix))
	if err := opts.Families.check(opts); err != nil {
		return nil, err
	}
	fams := opts.Families.nodeFamilies(0)
	n = &Node{
		Name: NodeName, IP: NodeIP, PodSubnet: fams[0].pods, fams: fams,
		Dir: filepath.Join(base, name), BinDir: binDir, opts: opts, Cgroup: name, pids: map[string]int{},
		joined: map[string]*Node{},
	}
	n.CNIConfDir = filepath.Join(n.Dir, "cni", "net.d")
	n.CNIBinDir = filepath.Join(n.Dir, "cni", "bin")
	if err := os.MkdirAll(n.Dir, 0o755); err != nil {
		return nil, err
	}
	if err := writeOwner(n.Dir); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			n.Stop()
			n = nil
		}
	}()
	if err := n.checkKubernetesBinaries(); err != nil {
		return n, err
	}
	if err := createCgroup(name); err != nil {
		return n, err
	}
	if err := n.writeFiles(); err != nil {
		return n, fmt.Errorf("write the node's files: %w", err)
	}
	n.holder, err = startHolder(holderSpec{
		RunDir: n.Dir, Cgroup: name, Sysctls: machineSysctls(), Binds: n.ciliumBinds(),
		Net: n.netSpec(),
	}, n.logPath("holder"))
	if err != nil {
		return n, err
	}
	n.Config, err = n.pki.restConfig(n.apiURL(), "admin")
	if err != nil {
		return n, err
	}
	n.Config.Dial = netnsDialer{n.holder.netns()}.DialContext
	n.Config.QPS, n.Config.Burst = 100, 200
	if n.Client, err = kubernetes.NewForConfig(n.Config); err != nil {
		return n, err
	}
	for _, c := range []string{"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "containerd"} {
		if err := n.StartComponent(ctx, c); err != nil {
			return n, err
		}
	}
	if opts.FlannelImage != "" {
		if err := n.deployFlannel(ctx, opts.FlannelImage); err != nil {
			return n, err
		}
	}
	if opts.Cilium != nil {
		c := *opts.Cilium
		n.opts.Cilium = &c
		if err := n.applyCilium(ctx, c, true); err != nil {
			return n, err
		}
	}
	if err := n.startKubelet(ctx); err != nil {
		return n, err
	}
	if n.kubeProxy() {
		if err := n.StartComponent(ctx, "kube-proxy"); err != nil {
			return n, err
		}
	}
	if err := n.WaitServiceAccount(ctx, metav1.NamespaceDefault); err != nil {
		return n, err
	}
	if opts.DNSImage != "" {
		return n, n.deployDNS(ctx, opts.DNSImage)
	}
	return n, nil
}

// startKubelet imports the node's images into containerd and starts the kubelet. On the
// flannel and Cilium clusters, the node's pod range is then the one the controller-manager
// allocated, and it returns once flanneld, or cilium-agent, runs there.
func (n *Node) startKubelet(ctx context.Context) error {
	for _, img := range n.opts.Images {
		if _, err := n.Run(ctx, n.Ctr("images", "import", "--snapshotter", "overlayfs", img)...); err != nil {
			return fmt.Errorf("import %s into containerd: %w", img, err)
		}
	}
	if n.cilium() {
		if err := n.launchCilium(ctx); err != nil {
			return err
		}
	}
	if err := n.StartComponent(ctx, "kubelet"); err != nil {
		return err
	}
	if !n.flannel() && !n.cilium() {
		return nil
	}
	if err := n.takePodCIDR(ctx); err != nil {
		return err
	}
	if n.cilium() {
		return n.waitCilium(ctx)
	}
	return n.waitFlannel(ctx)
}

// root is the control-plane node of n's cluster.
func (n *Node) root() *Node {
	if n.cp != nil {
		return n.cp
	}
	return n
}

// flannel reports whether flannel is the cluster's primary CNI.
func (n *Node) flannel() bool { return n.root().opts.FlannelImage != "" }

// Stop ends every process of the node (on the control-plane node, after the nodes that
// joined it have left), then removes its cgroups and, unless DETOUR_E2E_KEEP=1, its directory.
func (n *Node) Stop() error {
	if n.cp != nil {
		return n.Leave()
	}
	var errs []error
	for _, w := range n.Nodes()[1:] {
		errs = append(errs, w.Leave())
	}
	return errors.Join(append(errs, n.teardown())...)
}

// teardown ends the node's holder and with it every process of the node, removes its cgroups
// and, unless DETOUR_E2E_KEEP=1, its directory.
func (n *Node) teardown() error {
	var errs []error
	if n.holder != nil {
		errs = append(errs, n.holder.close())
	}
	// The holder kills the cgroup's processes; if it could not start or died, do it here.
	errs = append(errs, killCgroup(n.Cgroup, 0), removeCgroup(n.Cgroup))
	if os.Getenv("DETOUR_E2E_KEEP") != "1" {
		errs = append(errs, os.RemoveAll(n.Dir))
	}
	return errors.Join(errs...)
}

func (n *Node) apiURL() string { return fmt.Sprintf("https://%s:%d", NodeIP, APIPort) }

func (n *Node) logPath(component string) string {
	return filepath.Join(n.Dir, "logs", component+".log")
}

// Log returns a component's log (for failure messages and assertions).
func (n *Node) Log(component string) string {
	data, _ := os.ReadFile(n.logPath(component))
	return string(data)
}

// WaitServiceAccount waits for the controller manager to create ns's default ServiceAccount
// and its kube-root-ca.crt ConfigMap, without which no pod of ns can be created.
func (n *Node) WaitServiceAccount(ctx context.Context, ns string) error {
	return wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		if _, err := n.Client.CoreV1().ServiceAccounts(ns).Get(ctx, "default", metav1.GetOptions{}); err != nil {
			return false, nil
		}
		_, err := n.Client.CoreV1().ConfigMaps(ns).Get(ctx, "kube-root-ca.crt", metav1.GetOptions{})
		return err == nil, nil
	})
}
