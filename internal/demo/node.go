package demo

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/types"
	types100 "github.com/containernetworking/cni/pkg/types/100"
	"github.com/vishvananda/netlink"
	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/inject"
	"github.com/detourmesh/detour/internal/netlab"
	"github.com/detourmesh/detour/internal/origdst"
	"github.com/detourmesh/detour/iptables"
)

const (
	bridgeName   = "detour-demo0"
	bridgeSubnet = "10.213.77.0/24"
	networkName  = "demo"
	nsRoot       = "/run/detour-demo"
	remotePort   = 80
	appPort      = 8080
)

// node is the state of the node half.
type node struct {
	confDir, binDir string
	agent           *process
	agentArgs       []string
	agentLog        string
	cni             *libcni.CNIConfig
	remote          *netlab.NetNS
	remoteIP        netip.Addr
	sandboxes       []*attachment
}

// attachment is a sandbox's network as the runtime created it; del tears it down once.
type attachment struct {
	ns      *netlab.NetNS
	list    *libcni.NetworkConfigList
	rt      *libcni.RuntimeConf
	deleted bool
}

func (nd *node) del(ctx context.Context, a *attachment) error {
	if a.deleted {
		return nil
	}
	a.deleted = true
	return nd.cni.DelNetworkList(ctx, a.list, a.rt)
}

// playNode plays one node: primary CNI, node agent, the plugin through libcni, and the pod's
// containers as processes in its network namespace.
func (d *demo) playNode(ctx context.Context) error {
	d.n.Section("Node: the primary CNI, the node agent and detour-cni")
	nd, err := d.setUpNode(ctx)
	if err != nil {
		return err
	}
	d.n.Section("Pod sandbox")
	sandbox, ip, err := d.sandbox(ctx, nd, d.pod)
	if err != nil {
		return err
	}
	d.n.OK("sandbox of %s created through libcni (bridge, then detour-cni): pod IP %s", d.pod.Name, ip)
	rules, backend, err := iptables.NewExecutor().Save(ctx, sandbox.Path, iptables.IPv4)
	if err != nil {
		return err
	}
	if backend != iptables.BackendNFTables {
		rules = onlyRules(rules)
	}
	if strings.TrimSpace(rules) == "" {
		return fmt.Errorf("detour-cni installed no rules in the pod's network namespace (%s backend)", backend)
	}
	d.n.Note("The rules detour-cni installed in the pod's network namespace (%s backend):", backend)
	d.n.Block(rules)

	d.n.Section("The pod starts: init containers first, while no proxy runs")
	redirect, err := annotations.ParseRedirect(d.pod.Annotations)
	if err != nil {
		return err
	}
	d.runValidator(ctx, sandbox, redirect)
	fetchURL := fmt.Sprintf("http://%s/", netip.AddrPortFrom(nd.remoteIP, remotePort))
	d.n.Note("The init container's download stands in for its FETCH_URL; a server in a \"remote\" namespace answers at %s.", fetchURL)
	fetch := containerNamed(d.pod.Spec.InitContainers, "fetch")
	if fetch == nil {
		return errors.New("the demo workload has no init container named fetch")
	}
	fetchID, _ := containerIdentity(d.pod, *fetch)
	if out, err := d.child(ctx, sandbox, fetchID, "fetch", fetchURL); err != nil {
		d.n.Fail("init container fetch (%s) could not download %s: %v", fetchID, fetchURL, err)
	} else {
		d.n.OK("init container fetch (%s) downloaded %s directly: %s", fetchID, fetchURL, out)
	}

	d.n.Section("The app runs behind the proxy")
	proxyEvents, err := d.standInProxy(sandbox, redirect)
	if err != nil {
		return err
	}
	d.n.OK("stand-in proxy listening in the pod on :%d (outbound) and :%d (inbound), as uid %d would", redirect.OutboundPort, redirect.InboundPort, redirect.ProxyUID)
	web := &d.pod.Spec.Containers[0]
	webID, _ := containerIdentity(d.pod, *web)
	target := netip.AddrPortFrom(nd.remoteIP, remotePort)
	out, err := d.child(ctx, sandbox, webID, "connect", target.String())
	switch {
	case err != nil:
		d.n.Fail("app %s (%s): connection to %s failed: %v", web.Name, webID, target, err)
	case strings.HasPrefix(out, "proxy"):
		d.n.OK("app %s (%s) connected to %s and was captured: %s", web.Name, webID, target, <-proxyEvents)
	default:
		d.n.Fail("app %s (%s): connection to %s was not captured, the remote answered %q", web.Name, webID, target, out)
	}
	// The app listens on its port; the plugin redirects inbound connections to the proxy only
	// where a socket of the pod listens (detour.dev/redirect-inbound: listening).
	if err := d.standInApp(sandbox); err != nil {
		return err
	}
	inbound := netip.AddrPortFrom(ip, appPort)
	out, err = d.child(ctx, nd.remote, netlab.Identity{}, "connect", inbound.String())
	if err == nil && strings.HasPrefix(out, "proxy") {
		d.n.OK("a client in the remote namespace connected to the app's port %d and reached the proxy's inbound listener: %s", appPort, <-proxyEvents)
	} else {
		d.n.Fail("inbound connection to %s: %q, %v", inbound, out, err)
	}
	closed := netip.AddrPortFrom(ip, appPort+1)
	if out, err = d.child(ctx, nd.remote, netlab.Identity{}, "connect", closed.String()); err != nil && strings.Contains(err.Error(), "refused") {
		d.n.OK("a connection to port %d, where nothing in the pod listens, was refused, as without a mesh: the proxy gets only what the app serves", appPort+1)
	} else {
		d.n.Fail("inbound connection to %s, where nothing listens: %q, %v; want refused", closed, out, err)
	}

	d.withoutExemptions(ctx, nd, fetchURL)
	d.rolloutAndUninstall(ctx, nd)
	return nil
}

// rolloutAndUninstall tears the sandboxes down through CNI DEL, then stops the node agent as a
// rollout would (its entry stays, so no pod starts without the plugin) and uninstalls it as
// the chart's uninstall hook does.
func (d *demo) rolloutAndUninstall(ctx context.Context, nd *node) {
	d.n.Section("Pods deleted, node agent rolled out, detour uninstalled")
	for _, a := range nd.sandboxes {
		if err := nd.del(ctx, a); err != nil {
			d.n.Fail("CNI DEL of %s: %v", a.rt.ContainerID, err)
			continue
		}
		rules, _, err := iptables.NewExecutor().Save(ctx, a.ns.Path, iptables.IPv4)
		if err == nil && strings.Contains(rules, "DETOUR") {
			d.n.Fail("CNI DEL of %s left detour's rules", a.rt.ContainerID)
			continue
		}
		d.n.OK("CNI DEL of %s removed its rules (the namespace's nat table holds nothing of detour's)", a.rt.ContainerID)
	}
	primary := filepath.Join(nd.confDir, "10-"+networkName+".conflist")
	nd.agent.stop()
	if b, _ := os.ReadFile(primary); strings.Contains(string(b), `"detour-cni"`) {
		d.n.OK("node agent stopped with SIGTERM (a rollout): detour's entry stays in place, so no pod starts without the plugin")
	} else {
		d.n.Fail("stopping the node agent removed detour's entry")
	}
	out, err := exec.CommandContext(ctx, d.Detour, append([]string{"install-cni", "--uninstall"}, nd.agentArgs...)...).CombinedOutput()
	if err != nil {
		d.n.Fail("detour install-cni --uninstall: %v\n%s", err, out)
		return
	}
	b, _ := os.ReadFile(primary)
	_, binErr := os.Stat(filepath.Join(nd.binDir, "detour-cni"))
	if !strings.Contains(string(b), `"detour-cni"`) && errors.Is(binErr, os.ErrNotExist) && !d.nodeLabelled(ctx) {
		d.n.OK("detour install-cni --uninstall removed the entry (%s chains: %s), the plugin binary and the node's ready label", filepath.Base(primary), pluginTypes(b))
	} else {
		d.n.Fail("after --uninstall: conflist %s, plugin binary: %v, label still set: %v", pluginTypes(b), binErr, d.nodeLabelled(ctx))
	}
}

// setUpNode plays the node's start: its CNI directories, the Node object and the plugin's
// service account, then the node agent before and after the primary CNI writes its config, and
// the "remote" network the pod talks to.
func (d *demo) setUpNode(ctx context.Context) (*node, error) {
	nd := &node{confDir: filepath.Join(d.work, "etc/cni/net.d"), binDir: filepath.Join(d.work, "opt/cni/bin")}
	for _, dir := range []string{nd.confDir, nd.binDir} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, err
		}
	}
	if err := d.registerNode(ctx); err != nil {
		return nil, err
	}
	saDir, err := d.pluginServiceAccount(ctx)
	if err != nil {
		return nil, err
	}
	if err := d.startAgent(ctx, nd, saDir); err != nil {
		return nil, err
	}
	if err := d.writePrimary(ctx, nd); err != nil {
		return nil, err
	}
	if err := d.attachRemote(ctx, nd); err != nil {
		return nil, err
	}
	return nd, nil
}

// noPrimaryLog is what the node agent logs (nodeagent's not-ready reason) after a reconcile pass
// that found no primary CNI config (a documented readiness reason: docs/troubleshooting.md).
const noPrimaryLog = "waiting for the primary CNI to write its configuration into"

// startAgent starts the node agent before the primary CNI has written its config, and shows
// that its first reconcile pass writes nothing and leaves the startup taint.
func (d *demo) startAgent(ctx context.Context, nd *node, saDir string) error {
	nd.agentLog = filepath.Join(d.work, "install-cni.log")
	nd.agentArgs = []string{"--cni-conf-dir", nd.confDir, "--host-cni-conf-dir", nd.confDir, "--cni-bin-dir", nd.binDir,
		"--plugin-source", d.DetourCNI, "--service-account-dir", saDir, "--api-server", d.cfg.Host,
		"--node-name", nodeName, "--kubeconfig", d.kubeconfig, "--resync-interval", "1s", "--health-probe-bind-address", "127.0.0.1:0"}
	d.onCleanup(func() {
		// Also after an interruption: leave nothing of detour's in the demo's CNI directories.
		_ = exec.Command(d.Detour, append([]string{"install-cni", "--uninstall"}, nd.agentArgs...)...).Run()
	})
	var err error
	if nd.agent, err = d.start(ctx, nd.agentLog, d.Detour, append([]string{"install-cni"}, nd.agentArgs...)...); err != nil {
		return err
	}
	// The agent logs why it is not ready when that changes, after the reconcile pass that found
	// it: this line proves one full pass with no primary config, whose result the checks below see.
	if err := waitFor(ctx, 15*time.Second, func() (bool, error) {
		if !nd.agent.running() {
			return false, errors.New("the node agent exited")
		}
		b, _ := os.ReadFile(nd.agentLog)
		return strings.Contains(string(b), noPrimaryLog), nil
	}); err != nil {
		return fmt.Errorf("the node agent did not log %q after its first reconcile pass: %w\n%s", noPrimaryLog, err, tail(nd.agentLog))
	}
	entries, _ := os.ReadDir(nd.confDir)
	if len(entries) == 0 && d.nodeTainted(ctx) {
		d.n.OK("node agent started before the primary CNI's config: its first pass found none, wrote nothing and left the node its startup taint %s", annotations.CNINotReadyTaint)
	} else {
		d.n.Fail("with no primary CNI config the agent wrote %d file(s) or removed the taint", len(entries))
	}
	return nil
}

// writePrimary writes the primary CNI's config and waits until the agent has chained detour's
// entry to it and removed the taint.
func (d *demo) writePrimary(ctx context.Context, nd *node) error {
	primary := filepath.Join(nd.confDir, "10-"+networkName+".conflist")
	if err := os.WriteFile(primary, bridgeConfList(d.work), 0o644); err != nil {
		return err
	}
	d.onCleanup(func() {
		if link, err := netlink.LinkByName(bridgeName); err == nil {
			_ = netlink.LinkDel(link)
		}
	})
	d.n.OK("the primary CNI (the reference bridge plugin) wrote %s", filepath.Base(primary))
	start := time.Now()
	if err := waitFor(ctx, 15*time.Second, func() (bool, error) {
		b, _ := os.ReadFile(primary)
		return strings.Contains(string(b), `"detour-cni"`) && !d.nodeTainted(ctx), nil
	}); err != nil {
		return fmt.Errorf("the node agent did not install detour's entry and remove the taint: %w\n%s", err, tail(nd.agentLog))
	}
	d.n.OK("node agent appended detour-cni to it, installed the plugin and its kubeconfig, removed the taint and labelled the node %s=true (%s)",
		annotations.CNIReadyLabel, time.Since(start).Round(100*time.Millisecond))
	b, _ := os.ReadFile(primary)
	d.n.Note("%s now chains: %s", filepath.Base(primary), pluginTypes(b))
	return nil
}

// attachRemote installs the primary's plugins for libcni and attaches the "remote" network
// namespace to the bridge, with a server in it.
func (d *demo) attachRemote(ctx context.Context, nd *node) error {
	for _, p := range []string{"bridge", "host-local", "loopback"} {
		if err := copyFile(filepath.Join(d.TestBinDir, p), filepath.Join(nd.binDir, p)); err != nil {
			return err
		}
	}
	nd.cni = libcni.NewCNIConfigWithCacheDir([]string{nd.binDir}, filepath.Join(d.work, "cni-cache"),
		&invoke.DefaultExec{RawExec: &invoke.RawExec{Stderr: io.Discard}})

	// The "remote" network: another sandbox on the bridge, with the primary plugin only.
	var err error
	if nd.remote, err = d.newNetNS(); err != nil {
		return err
	}
	remoteList, err := libcni.ConfListFromBytes(bridgeConfList(d.work))
	if err != nil {
		return err
	}
	rt := &libcni.RuntimeConf{ContainerID: "remote", NetNS: nd.remote.Path, IfName: "eth0"}
	res, err := nd.cni.AddNetworkList(ctx, remoteList, rt)
	if err != nil {
		return fmt.Errorf("attach the remote namespace: %w", err)
	}
	d.onCleanup(func() { _ = nd.cni.DelNetworkList(context.Background(), remoteList, rt) })
	if nd.remoteIP, err = firstIP(res); err != nil {
		return err
	}
	return serveRemote(nd.remote)
}

// sandbox creates the pod's network namespace and runs the node's CNI configuration for it,
// as containerd does: the first config file in the directory, with the pod's annotations in
// runtimeConfig.
func (d *demo) sandbox(ctx context.Context, nd *node, pod *corev1.Pod) (*netlab.NetNS, netip.Addr, error) {
	ns, err := d.newNetNS()
	if err != nil {
		return nil, netip.Addr{}, err
	}
	files, err := libcni.ConfFiles(nd.confDir, []string{".conf", ".conflist", ".json"})
	if err != nil || len(files) == 0 {
		return nil, netip.Addr{}, fmt.Errorf("no CNI config in %s: %v", nd.confDir, err)
	}
	slices.Sort(files)
	list, err := libcni.ConfListFromFile(files[0])
	if err != nil {
		return nil, netip.Addr{}, err
	}
	rt := &libcni.RuntimeConf{
		ContainerID: pod.Name, NetNS: ns.Path, IfName: "eth0",
		Args: [][2]string{{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", pod.Namespace}, {"K8S_POD_NAME", pod.Name},
			{"K8S_POD_INFRA_CONTAINER_ID", pod.Name}, {"K8S_POD_UID", string(pod.UID)}},
		CapabilityArgs: map[string]any{"io.kubernetes.cri.pod-annotations": pod.Annotations},
	}
	res, err := nd.cni.AddNetworkList(ctx, list, rt)
	if err != nil {
		return nil, netip.Addr{}, fmt.Errorf("CNI ADD for %s: %w", pod.Name, err)
	}
	a := &attachment{ns: ns, list: list, rt: rt}
	nd.sandboxes = append(nd.sandboxes, a)
	d.onCleanup(func() { _ = nd.del(context.Background(), a) })
	ip, err := firstIP(res)
	return ns, ip, err
}

func (d *demo) runValidator(ctx context.Context, sandbox *netlab.NetNS, r annotations.Redirect) {
	v := containerNamed(d.pod.Spec.InitContainers, annotations.ValidatorContainer)
	if v == nil {
		d.n.Fail("the pod has no %s init container", annotations.ValidatorContainer)
		return
	}
	id, _ := containerIdentity(d.pod, *v)
	args := v.Command[1:]
	cmd := id.Command(ctx, d.Detour, args...)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	start := time.Now()
	err := sandbox.Do(cmd.Run)
	msg := strings.TrimSpace(out.String())
	if err != nil {
		d.n.Fail("%s (%s) `detour %s`: %v: %s", v.Name, id, strings.Join(args, " "), err, msg)
		return
	}
	d.n.OK("%s (%s) ran `detour %s`: passed in %s — the redirect is in place", v.Name, id, strings.Join(args, " "), time.Since(start).Round(time.Millisecond))
	if msg != "" {
		d.n.Note("%s", msg)
	}
}

// standInProxy listens where the proxy would and reports each connection's original
// destination on the returned channel.
func (d *demo) standInProxy(sandbox *netlab.NetNS, r annotations.Redirect) (<-chan string, error) {
	events := make(chan string, 4)
	for _, port := range []uint16{r.OutboundPort, r.InboundPort} {
		var ln net.Listener
		if err := sandbox.Do(func() (err error) {
			ln, err = net.Listen("tcp4", fmt.Sprintf("0.0.0.0:%d", port))
			return err
		}); err != nil {
			return nil, fmt.Errorf("stand-in proxy: %w", err)
		}
		d.onCleanup(func() { ln.Close() })
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				dst, err := origdst.Get(c.(*net.TCPConn))
				what := fmt.Sprintf("the proxy's :%d listener got it, original destination %s", port, dst)
				if err != nil {
					what = fmt.Sprintf("the proxy's :%d listener got it (original destination unknown: %v)", port, err)
				}
				fmt.Fprintf(c, "proxy %s\n", dst)
				c.Close()
				events <- what
			}
		}()
	}
	return events, nil
}

// standInApp listens on the app's port in the pod, as the app would; the connections it would
// get go to the proxy instead, so it never answers.
func (d *demo) standInApp(sandbox *netlab.NetNS) error {
	var ln net.Listener
	if err := sandbox.Do(func() (err error) {
		ln, err = net.Listen("tcp4", fmt.Sprintf("0.0.0.0:%d", appPort))
		return err
	}); err != nil {
		return fmt.Errorf("stand-in app: %w", err)
	}
	d.onCleanup(func() { ln.Close() })
	d.n.OK("stand-in app listening in the pod on :%d", appPort)
	return nil
}

// withoutExemptions shows the seed-003 failure: the same pod with detour.dev/init-egress: none
// gets no exemption, so its init container's download is redirected to a proxy that is not
// running yet.
func (d *demo) withoutExemptions(ctx context.Context, nd *node, fetchURL string) {
	d.n.Section("The same pod without detour's exemptions (" + annotations.InitEgress + ": none)")
	pod, err := d.createDemoPod(ctx, "demo-no-egress-", map[string]string{annotations.InitEgress: "none"})
	if err != nil {
		d.n.Fail("%v", err)
		return
	}
	r, err := annotations.ParseRedirect(pod.Annotations)
	if err != nil || len(r.ExemptUIDs)+len(r.ExemptGIDs) != 0 {
		d.n.Fail("the pod should have no exemptions: %+v, %v", r, err)
		return
	}
	sandbox, _, err := d.sandbox(ctx, nd, pod)
	if err != nil {
		d.n.Fail("%v", err)
		return
	}
	fetch := containerNamed(pod.Spec.InitContainers, "fetch")
	id, _ := containerIdentity(pod, *fetch)
	if out, err := d.child(ctx, sandbox, id, "fetch", fetchURL); err != nil {
		d.n.Expected("init container fetch (%s): %v", id, err)
		d.n.Note("Expected: without an exemption its connection is redirected to port %d, where no proxy listens", r.OutboundPort)
		d.n.Note("yet — the init container would crash-loop (seed 003). The exemption above is what prevents it.")
	} else {
		d.n.Fail("without an exemption the download should fail, but it got: %s", out)
	}
}

// registerNode registers the demo node with the startup taint, as the kubelet does with
// --register-with-taints.
func (d *demo) registerNode(ctx context.Context) error {
	_, err := d.client.CoreV1().Nodes().Create(ctx, &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: nodeName},
		Spec:       corev1.NodeSpec{Taints: []corev1.Taint{{Key: annotations.CNINotReadyTaint, Effect: corev1.TaintEffectNoSchedule}}},
	}, metav1.CreateOptions{})
	if !d.n.Check(err, "node %s registered with the startup taint %s:NoSchedule (kubelet --register-with-taints)", nodeName, annotations.CNINotReadyTaint) {
		return err
	}
	return nil
}

func (d *demo) nodeLabelled(ctx context.Context) bool {
	n, err := d.client.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
	return err != nil || n.Labels[annotations.CNIReadyLabel] != ""
}

func (d *demo) nodeTainted(ctx context.Context) bool {
	n, err := d.client.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
	if err != nil {
		return true
	}
	return slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == annotations.CNINotReadyTaint }) ||
		n.Labels[annotations.CNIReadyLabel] != "true"
}

// pluginServiceAccount makes the node agent's service account as the chart would (a
// ServiceAccount allowed to get pods) and writes its token and CA where a pod would have them.
func (d *demo) pluginServiceAccount(ctx context.Context) (string, error) {
	core := d.client.CoreV1()
	if _, err := core.Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: detourNamespace}}, metav1.CreateOptions{}); err != nil {
		return "", err
	}
	if _, err := core.ServiceAccounts(detourNamespace).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "detour-cni"}}, metav1.CreateOptions{}); err != nil {
		return "", err
	}
	rbac := d.client.RbacV1()
	if _, err := rbac.ClusterRoles().Create(ctx, &rbacv1.ClusterRole{
		ObjectMeta: metav1.ObjectMeta{Name: "detour-cni"},
		Rules:      []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get"}}},
	}, metav1.CreateOptions{}); err != nil {
		return "", err
	}
	if _, err := rbac.ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "detour-cni"},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "detour-cni"},
		Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Name: "detour-cni", Namespace: detourNamespace}},
	}, metav1.CreateOptions{}); err != nil {
		return "", err
	}
	tr, err := core.ServiceAccounts(detourNamespace).CreateToken(ctx, "detour-cni", &authnv1.TokenRequest{}, metav1.CreateOptions{})
	if err != nil {
		return "", fmt.Errorf("request a service-account token: %w", err)
	}
	dir := filepath.Join(d.work, "serviceaccount")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	for name, data := range map[string][]byte{"token": []byte(tr.Status.Token), "ca.crt": d.cfg.CAData, "namespace": []byte(detourNamespace)} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			return "", err
		}
	}
	return dir, nil
}

func (d *demo) newNetNS() (*netlab.NetNS, error) {
	netlab.Sweep(nsRoot)
	ns, err := netlab.Create(netlab.ProcessDir(nsRoot))
	if err != nil {
		return nil, fmt.Errorf("create a network namespace: %w", err)
	}
	d.onCleanup(func() {
		ns.Remove()
		os.Remove(netlab.ProcessDir(nsRoot))
	})
	return ns, nil
}

// bridgeConfList is the primary CNI's configuration: the reference bridge plugin with
// host-local IPAM, as a node's CNI would write it.
func bridgeConfList(work string) []byte {
	b, _ := json.MarshalIndent(map[string]any{
		"cniVersion": "1.1.0",
		"name":       networkName,
		"plugins": []any{map[string]any{
			"type": "bridge", "bridge": bridgeName, "isGateway": true, "ipMasq": false,
			"ipam": map[string]any{
				"type":    "host-local",
				"ranges":  []any{[]any{map[string]any{"subnet": bridgeSubnet}}},
				"routes":  []any{map[string]any{"dst": "0.0.0.0/0"}},
				"dataDir": filepath.Join(work, "ipam"),
			},
		}},
	}, "", "  ")
	return b
}

func pluginTypes(conflist []byte) string {
	var l struct {
		Plugins []struct {
			Type string `json:"type"`
		} `json:"plugins"`
	}
	_ = json.Unmarshal(conflist, &l)
	var types []string
	for _, p := range l.Plugins {
		types = append(types, p.Type)
	}
	return strings.Join(types, " → ")
}

// serveRemote answers HTTP in the remote namespace, standing in for the internet.
func serveRemote(ns *netlab.NetNS) error {
	var ln net.Listener
	if err := ns.Do(func() (err error) {
		ln, err = net.Listen("tcp4", ":"+strconv.Itoa(remotePort))
		return err
	}); err != nil {
		return err
	}
	go http.Serve(ln, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "hello from the remote namespace")
	}))
	return nil
}

func firstIP(r types.Result) (netip.Addr, error) {
	res, err := types100.NewResultFromResult(r)
	if err != nil {
		return netip.Addr{}, err
	}
	for _, ip := range res.IPs {
		if a, ok := netip.AddrFromSlice(ip.Address.IP.To4()); ok {
			return a, nil
		}
	}
	return netip.Addr{}, errors.New("the CNI result has no IPv4 address")
}

func containerNamed(cs []corev1.Container, name string) *corev1.Container {
	for i := range cs {
		if cs[i].Name == name {
			return &cs[i]
		}
	}
	return nil
}

// containerIdentity is the UID and GID a container runs as, from its security context or the
// pod's; explicit is false when the UID is left to the image (the GID may still be set: a
// dedicated GID keeps the image's user).
func containerIdentity(pod *corev1.Pod, c corev1.Container) (id netlab.Identity, explicit bool) {
	if gid := inject.EffectiveGID(pod, &c); gid != nil {
		id.GID = uint32(*gid)
	}
	uid := inject.EffectiveUID(pod, &c)
	if uid == nil {
		return id, false
	}
	id.UID = uint32(*uid)
	return id, true
}

func copyFile(src, dst string) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, b, 0o755)
}

// onlyRules keeps detour's chains and rules of iptables-save output.
func onlyRules(save string) string {
	var b strings.Builder
	for line := range strings.Lines(save) {
		if strings.HasPrefix(line, "-A ") || strings.HasPrefix(line, ":DETOUR") {
			b.WriteString(line)
		}
	}
	return b.String()
}
