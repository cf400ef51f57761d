package e2e

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// The node's fixed addresses. They live in the node's own network namespace, so they never
// meet the host's or another run's.
var (
	nodeIP      = netip.MustParseAddr("10.200.0.1")
	serviceIP   = netip.MustParseAddr("10.96.0.1")
	podSubnet   = netip.MustParsePrefix("10.88.0.0/24")
	serviceCIDR = "10.96.0.0/24"
	// dnsIP is the cluster DNS's ClusterIP (the kube-dns Service, the kubelet's clusterDNS).
	dnsIP = netip.MustParseAddr("10.96.0.10")
	// clusterCIDR holds every node's pod range (podRange).
	clusterCIDR = netip.MustParsePrefix("10.88.0.0/16")
	// underlay is the nodes' network: the control-plane node is nodeIP, the nodes that join
	// it the next addresses (cluster.go).
	underlay = netip.MustParsePrefix("10.200.0.0/24")
)

const (
	apiPort = 6443
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
	// DNSImage, when set, is CoreDNS's image (DNSImage; already in one of Images): the
	// control-plane node deploys it as the cluster's DNS, kube-dns.
	DNSImage string
}

// Node is one Kubernetes node with its control plane: etcd, kube-apiserver,
// kube-controller-manager, kube-scheduler, containerd, the kubelet and kube-proxy (and, with
// Options.DNSImage, CoreDNS as the cluster's DNS), all built from their Go
// modules by hack/test-binaries.sh, in a network and mount namespace of their own.
type Node struct {
	// Name is the node's name; IP its address on the underlay; PodSubnet its pods' range.
	Name      string
	IP        netip.Addr
	PodSubnet netip.Prefix
	// Dir is the run's directory; everything the node writes is under it.
	Dir    string
	BinDir string
	// CNIConfDir and CNIBinDir are the runtime's CNI directories (the chart's nodeAgent
	// cniConfDir and cniBinDir).
	CNIConfDir, CNIBinDir string
	// Kubeconfig is the admin kubeconfig, for commands run inside the node's namespace.
	Kubeconfig string
	// Config and Client reach the API server from the test process, as admin.
	Config *rest.Config
	Client kubernetes.Interface

	opts   Options
	cgroup string
	holder *holderClient
	pki    *pki

	// cp is the control-plane node a node joined (cluster.go); nil on the control-plane node.
	cp *Node

	mu sync.Mutex
	// pids are the running components' processes; a component stopped on purpose is not here.
	pids map[string]int
	// mayExit are the components whose exit is no failure (ExpectExit).
	mayExit map[string]bool
	// joined are the nodes that joined this control-plane node and have not left, by name.
	joined map[string]*Node
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
	n = &Node{
		Name: NodeName, IP: nodeIP, PodSubnet: podSubnet,
		Dir: filepath.Join(base, name), BinDir: binDir, opts: opts, cgroup: name, pids: map[string]int{},
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
	if err := createCgroup(name); err != nil {
		return n, err
	}
	if err := n.writeFiles(); err != nil {
		return n, fmt.Errorf("write the node's files: %w", err)
	}
	n.holder, err = startHolder(holderSpec{
		RunDir: n.Dir, Cgroup: name, Sysctls: machineSysctls(),
		Net: netSpec{Link: "node0", NodeIP: nodeIP},
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
	if err := n.startKubelet(ctx); err != nil {
		return n, err
	}
	if err := n.StartComponent(ctx, "kube-proxy"); err != nil {
		return n, err
	}
	if err := n.waitServiceAccount(ctx, metav1.NamespaceDefault); err != nil {
		return n, err
	}
	if opts.DNSImage != "" {
		return n, n.deployDNS(ctx, opts.DNSImage)
	}
	return n, nil
}

// startKubelet imports the node's images into containerd and starts the kubelet. On the
// flannel cluster, the node's pod range is then the one the controller-manager allocated, and
// it returns once flanneld runs there.
func (n *Node) startKubelet(ctx context.Context) error {
	for _, img := range n.opts.Images {
		if _, err := n.Run(ctx, n.ctr("images", "import", "--snapshotter", "overlayfs", img)...); err != nil {
			return fmt.Errorf("import %s into containerd: %w", img, err)
		}
	}
	if err := n.StartComponent(ctx, "kubelet"); err != nil {
		return err
	}
	if !n.flannel() {
		return nil
	}
	if err := n.takePodCIDR(ctx); err != nil {
		return err
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
	errs = append(errs, killCgroup(n.cgroup, 0), removeCgroup(n.cgroup))
	if os.Getenv("DETOUR_E2E_KEEP") != "1" {
		errs = append(errs, os.RemoveAll(n.Dir))
	}
	return errors.Join(errs...)
}

func (n *Node) apiURL() string { return fmt.Sprintf("https://%s:%d", nodeIP, apiPort) }

func (n *Node) logPath(component string) string {
	return filepath.Join(n.Dir, "logs", component+".log")
}

// Log returns a component's log (for failure messages and assertions).
func (n *Node) Log(component string) string {
	data, _ := os.ReadFile(n.logPath(component))
	return string(data)
}

// machineSysctls are the machine-wide kernel settings the kubelet rewrites (setupKernelTunables);
// the node gets stand-in files that start with the host's values.
func machineSysctls() map[string]string {
	m := map[string]string{}
	for _, f := range []string{
		"vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
		"kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes",
	} {
		p := "/proc/sys/" + f
		if v, err := os.ReadFile(p); err == nil {
			m[p] = strings.TrimSpace(string(v))
		}
	}
	return m
}

// StartComponent starts one of the node's processes and waits until it is ready.
func (n *Node) StartComponent(ctx context.Context, name string) error {
	argv, env := n.command(name)
	pid, err := n.holder.start(argv, env, n.logPath(name), "")
	if err != nil {
		return fmt.Errorf("start %s: %w", name, err)
	}
	n.mu.Lock()
	n.pids[name] = pid
	n.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, 90*time.Second)
	defer cancel()
	err = wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		if exited, code, _ := n.holder.wait(pid, 0); exited {
			return false, fmt.Errorf("exited with code %d", code)
		}
		return n.ready(ctx, name), nil
	})
	if err != nil {
		return fmt.Errorf("%s is not ready: %w; its log %s ends with:\n%s", name, err, n.logPath(name), tail(n.Log(name), 30))
	}
	return nil
}

// containerdBooted is what containerd logs once its CRI service is initialized: it serves its
// socket (and answers `ctr version`) seconds before, while CRI calls still fail with "server is
// not initialized yet" — a kubelet started then exits.
const containerdBooted, containerdStarting = "containerd successfully booted", `msg="starting containerd"`

// StopComponent stops one of the node's processes (SIGTERM, then SIGKILL after 10 s).
func (n *Node) StopComponent(name string) error {
	n.mu.Lock()
	pid, ok := n.pids[name]
	delete(n.pids, name)
	n.mu.Unlock()
	if !ok {
		return fmt.Errorf("%s is not running", name)
	}
	return n.holder.stop(pid, 10*time.Second)
}

// RestartComponent stops and starts one of the node's processes; it is started even when it
// could not be stopped (it was not running).
func (n *Node) RestartComponent(ctx context.Context, name string) error {
	return errors.Join(n.StopComponent(name), n.StartComponent(ctx, name))
}

// pid returns the process of a running component.
func (n *Node) pid(name string) int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.pids[name]
}

// exited returns the exit code of a component that was started and has exited since without
// being stopped.
func (n *Node) exited(name string) (code int, ok bool) {
	pid := n.pid(name)
	if pid == 0 {
		return 0, false
	}
	exited, code, err := n.holder.wait(pid, 0)
	// Still its process (not stopped on purpose meanwhile)?
	return code, err == nil && exited && n.pid(name) == pid
}

// EnsureRunning starts, in order, each of the components that is not running — stopped, or
// exited — trying up to three times each: what a fault stopped comes back whichever of its
// steps failed.
func (n *Node) EnsureRunning(ctx context.Context, names ...string) error {
	var errs []error
	for _, name := range names {
		if _, dead := n.exited(name); !dead && n.pid(name) != 0 {
			continue
		}
		n.StopComponent(name) // forget an exited process
		var err error
		for attempt := range 3 {
			if err = n.StartComponent(ctx, name); err == nil || ctx.Err() != nil {
				break
			}
			n.StopComponent(name)
			sleepCtx(ctx, time.Duration(attempt+1)*2*time.Second)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("start %s again: %w", name, err))
		}
	}
	return errors.Join(errs...)
}

// Watch returns a context that ends, with the reason as its cause, when a component of the
// node, or of a node that joined it, exits without being stopped: every wait on that context
// then ends at once and says why, instead of waiting out its timeout on a dead node.
func (n *Node) Watch(parent context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(parent)
	go func() {
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			for _, node := range n.Nodes() {
				name, code, ok := node.deadComponent()
				// A node that leaves is out of the cluster before its components are killed.
				if !ok || (node != n && !slices.Contains(n.Nodes(), node)) {
					continue
				}
				cancel(fmt.Errorf("node %s: component %s exited with code %d; its log %s ends with:\n%s",
					node.Name, name, code, node.logPath(name), tail(node.Log(name), 20)))
				return
			}
		}
	}()
	return ctx, func() { cancel(context.Canceled) }
}

// ExpectExit tells Watch that component name may exit from now on: kube-proxy exits when its
// node's Node object is deleted ("Node is being deleted"), as a node that leaves the cluster
// expects.
func (n *Node) ExpectExit(name string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.mayExit == nil {
		n.mayExit = map[string]bool{}
	}
	n.mayExit[name] = true
}

// deadComponent returns the first component (by name) that exited without being stopped or
// expected to.
func (n *Node) deadComponent() (name string, code int, ok bool) {
	n.mu.Lock()
	var names []string
	for name := range n.pids {
		if !n.mayExit[name] {
			names = append(names, name)
		}
	}
	n.mu.Unlock()
	slices.Sort(names)
	for _, name := range names {
		if code, ok := n.exited(name); ok {
			return name, code, true
		}
	}
	return "", 0, false
}

// ready reports whether component name answers.
func (n *Node) ready(ctx context.Context, name string) bool {
	switch name {
	case "etcd":
		return n.httpOK(ctx, "http://127.0.0.1:2379/health", false)
	case "kube-apiserver":
		return n.httpOK(ctx, n.apiURL()+"/readyz", true)
	case "kube-controller-manager":
		return n.httpOK(ctx, "https://127.0.0.1:10257/healthz", false)
	case "kube-scheduler":
		return n.httpOK(ctx, "https://127.0.0.1:10259/healthz", false)
	case "kube-proxy":
		// Healthy once it has written its rules from the API's Services.
		return n.httpOK(ctx, "http://127.0.0.1:10256/healthz", false)
	case "prometheus":
		return n.httpOK(ctx, "http://"+PrometheusAddr+"/-/ready", false)
	case "containerd":
		// Its log is appended to across restarts: this start's part follows the last start line.
		log := n.Log(name)
		if !strings.Contains(log[max(strings.LastIndex(log, containerdStarting), 0):], containerdBooted) {
			return false
		}
		_, err := n.Run(ctx, n.ctr("version")...)
		return err == nil
	case "kubelet":
		// Its own health endpoint first: the Node's Ready condition outlives a kubelet that
		// died (a kubelet that exited at start, its runtime restarting, still read as ready).
		if !n.httpOK(ctx, "http://127.0.0.1:10248/healthz", false) {
			return false
		}
		node, err := n.Client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
		if err != nil {
			return false
		}
		for _, c := range node.Status.Conditions {
			if c.Type == corev1.NodeReady {
				return c.Status == corev1.ConditionTrue
			}
		}
	}
	return false
}

// httpOK GETs url inside the node (as admin when admin is set) and reports a 200.
func (n *Node) httpOK(ctx context.Context, url string, admin bool) bool {
	client := &http.Client{Timeout: 2 * time.Second}
	if admin {
		rt, err := rest.TransportFor(n.Config)
		if err != nil {
			return false
		}
		client.Transport = rt
	} else {
		client.Transport = &http.Transport{
			DialContext:     netnsDialer{n.holder.netns()}.DialContext,
			TLSClientConfig: insecureTLS(),
		}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return false
	}
	resp, err := client.Do(req)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// waitServiceAccount waits for the controller manager to create ns's default ServiceAccount
// and its kube-root-ca.crt ConfigMap, without which no pod of ns can be created.
func (n *Node) waitServiceAccount(ctx context.Context, ns string) error {
	return wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		if _, err := n.Client.CoreV1().ServiceAccounts(ns).Get(ctx, "default", metav1.GetOptions{}); err != nil {
			return false, nil
		}
		_, err := n.Client.CoreV1().ConfigMaps(ns).Get(ctx, "kube-root-ca.crt", metav1.GetOptions{})
		return err == nil, nil
	})
}

// Run runs argv inside the node's namespaces and returns its stdout; an exit code other than
// 0 is an error that carries stderr.
func (n *Node) Run(ctx context.Context, argv ...string) (string, error) {
	stdout, stderr, err := n.RunSplit(ctx, nil, argv...)
	if err != nil {
		return stdout, fmt.Errorf("%w\n%s", err, stderr)
	}
	return stdout, nil
}

// RunSplit runs argv (with env added to the node's environment) inside the node's
// namespaces and returns its stdout and stderr apart.
func (n *Node) RunSplit(ctx context.Context, env []string, argv ...string) (stdout, stderr string, err error) {
	dir, err := os.MkdirTemp(filepath.Join(n.Dir, "run"), "cmd-")
	if err != nil {
		return "", "", err
	}
	defer os.RemoveAll(dir)
	outPath, errPath := filepath.Join(dir, "stdout"), filepath.Join(dir, "stderr")
	pid, err := n.holder.start(argv, append(n.env(), env...), outPath, errPath)
	if err != nil {
		return "", "", err
	}
	for {
		exited, code, werr := n.holder.wait(pid, time.Second)
		out, _ := os.ReadFile(outPath)
		errOut, _ := os.ReadFile(errPath)
		stdout, stderr = string(out), string(errOut)
		switch {
		case werr != nil:
			return stdout, stderr, werr
		case exited && code != 0:
			return stdout, stderr, fmt.Errorf("%s: exit code %d", strings.Join(argv, " "), code)
		case exited:
			return stdout, stderr, nil
		}
		if ctx.Err() != nil {
			n.holder.stop(pid, time.Second)
			return stdout, stderr, fmt.Errorf("%s: %w", strings.Join(argv, " "), ctx.Err())
		}
	}
}

// Kubectl runs the real kubectl inside the node as admin.
func (n *Node) Kubectl(ctx context.Context, args ...string) (stdout, stderr string, err error) {
	return n.RunSplit(ctx, nil, append([]string{n.bin("kubectl"), "--kubeconfig", n.Kubeconfig}, args...)...)
}

// Helm runs the real helm inside the node as admin.
func (n *Node) Helm(ctx context.Context, args ...string) (string, error) {
	home := filepath.Join(n.Dir, "helm")
	env := []string{"HELM_CACHE_HOME=" + home + "/cache", "HELM_CONFIG_HOME=" + home + "/config", "HELM_DATA_HOME=" + home + "/data"}
	stdout, stderr, err := n.RunSplit(ctx, env, append([]string{n.bin("helm"), "--kubeconfig", n.Kubeconfig}, args...)...)
	if err != nil {
		return stdout, fmt.Errorf("%w\n%s", err, stderr)
	}
	return stdout, nil
}

// Dial connects to addr from the node's network namespace (the host, as pods see it).
func (n *Node) Dial(ctx context.Context, network, addr string) (net.Conn, error) {
	return netnsDialer{n.holder.netns()}.DialContext(ctx, network, addr)
}

// Greeting connects to addr from the node's network namespace and returns what the server
// there says first (the workload's serve names the connection's peer).
func (n *Node) Greeting(ctx context.Context, addr string) (string, error) {
	dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := n.Dial(dctx, "tcp", addr)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 512)
	got, err := conn.Read(buf)
	if got == 0 {
		return "", fmt.Errorf("no greeting from %s: %w", addr, err)
	}
	return string(buf[:got]), nil
}

func (n *Node) bin(name string) string { return filepath.Join(n.BinDir, name) }

func (n *Node) ctr(args ...string) []string {
	return append([]string{n.bin("ctr"), "--address", n.containerdSocket(), "--namespace", "k8s.io"}, args...)
}

func (n *Node) containerdSocket() string {
	return filepath.Join(n.Dir, "containerd", "containerd.sock")
}

func tail(s string, lines int) string {
	l := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(l) > lines {
		l = l[len(l)-lines:]
	}
	return strings.Join(l, "\n")
}

// sleepCtx sleeps for d and reports whether ctx is still live.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	select {
	case <-ctx.Done():
		return false
	case <-time.After(d):
		return true
	}
}
