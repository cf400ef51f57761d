package cli

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/containernetworking/cni/libcni"
	"github.com/spf13/cobra"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	utilversion "k8s.io/apimachinery/pkg/util/version"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/cniplugin"
	"github.com/detourmesh/detour/internal/manifest"
	"github.com/detourmesh/detour/internal/nsutil"
	"github.com/detourmesh/detour/internal/version"
	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/nodeagent"
	"github.com/detourmesh/detour/validator"
)

// newCheckCommand returns `detour check`, the node-side diagnosis.
func newCheckCommand() *cobra.Command {
	var confDir, file, netns, backend string
	var cl clusterFlags
	cmd := &cobra.Command{
		Use:   "check",
		Short: "Diagnose a node (iptables, the CNI configuration, a pod's live rules) or, with --cluster, the whole installation",
		Long: `check runs on a node (or in the node agent's container) and reports, one line each with ✓ or ✗:
the iptables backends available for IPv4 and IPv6; the CNI configuration the runtime uses, whether
detour-cni is its last plugin with a valid entry, and whether the plugin's kubeconfig is there; and,
given a pod's network namespace and its injected YAML, whether the live nat rules are exactly the
ones detour-cni installs for it (the first difference in words otherwise). It exits 1 when any
check fails.

With --cluster it runs from anywhere with a kubeconfig (found as kubectl finds it) and checks the
installation through the API server, one line each with ✓, ‼ (warning) or ✗ and the fix: the
webhook's configuration, Service endpoints, the certificate its pods serve against the caBundle,
the API server's own call to it (a pod created with dryRun=All, never stored), its Deployment;
the node agent on every node; nodes still carrying the startup taint or lacking
the ready label; opted-in namespaces; injected pods whose validator failed; the repair
controller's recent Events; image skew between the components. It exits 1 when any check shows ✗.`,
		Example: `  # The node's state, from the host:
  detour check --cni-conf-dir=/etc/cni/net.d

  # A pod's rules (find its network namespace with crictl inspectp):
  kubectl get pod web-7d4b9 -o yaml > pod.yaml
  detour check -f pod.yaml --netns /var/run/netns/cni-1234abcd

  # The whole cluster, from a laptop (the current kubectl context):
  detour check --cluster
  detour check --cluster --context prod -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if cl.enabled {
				for _, f := range []string{"cni-conf-dir", "filename", "netns", "iptables-backend"} {
					if cmd.Flags().Changed(f) {
						return fmt.Errorf("--%s checks a node: run it without --cluster, on the node", f)
					}
				}
				return cl.run(cmd)
			}
			for _, f := range []string{"kubeconfig", "context", "namespace", "since", "output", "webhook-dial"} {
				if cmd.Flags().Changed(f) {
					return fmt.Errorf("--%s goes with --cluster", f)
				}
			}
			b, err := iptables.ParseBackend(backend)
			if err != nil {
				return fmt.Errorf("--iptables-backend: %w", err)
			}
			if (file == "") != (netns == "") {
				return errors.New("-f and --netns go together: the pod's injected YAML and its network namespace")
			}
			c := &checker{out: cmd.OutOrStdout(), exec: iptables.NewExecutor(iptables.WithBackend(b))}
			c.iptables()
			if confDir != "" {
				c.cniConfig(confDir)
			}
			if netns != "" {
				c.podRules(cmd, file, netns)
			}
			if c.failed > 0 {
				return fmt.Errorf("%d check(s) failed; see docs/troubleshooting.md", c.failed)
			}
			return nil
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&confDir, "cni-conf-dir", "/etc/cni/net.d", `the node's CNI configuration directory; "" skips the check`)
	fl.StringVarP(&file, "filename", "f", "", "the injected pod's YAML (kubectl get pod -o yaml); - reads standard input")
	fl.StringVar(&netns, "netns", "", "the pod's network namespace, e.g. /var/run/netns/cni-...")
	fl.StringVar(&backend, "iptables-backend", "auto", "auto, legacy, nft or nftables, as in the plugin's configuration")
	cl.addFlags(fl)
	return cmd
}

type checker struct {
	out    io.Writer
	exec   *iptables.Executor
	failed int
}

func (c *checker) ok(format string, args ...any) {
	fmt.Fprintf(c.out, "✓ %s\n", fmt.Sprintf(format, args...))
}

// warn reports what degrades detour without failing it (‼); it does not fail the check.
func (c *checker) warn(format string, args ...any) {
	fmt.Fprintf(c.out, "‼ %s\n", fmt.Sprintf(format, args...))
}

func (c *checker) fail(format string, args ...any) {
	c.failed++
	fmt.Fprintf(c.out, "✗ %s\n", fmt.Sprintf(format, args...))
}

func (c *checker) iptables() {
	for _, f := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
		switch err := c.exec.Usable(f); {
		case err != nil:
			c.fail("%s: %v", f, err)
		case c.exec.Backend() == iptables.BackendNFTables:
			c.ok("%s: the kernel answers nf_tables requests (nftables backend, no tools needed)", f)
		case c.exec.Backend() == iptables.BackendAuto && iptables.NFTablesUsable() == nil:
			c.ok("%s: the kernel answers nf_tables requests (auto: the nftables backend in pod namespaces without legacy rules, no tools needed)", f)
		default:
			c.ok("%s: iptables-save and iptables-restore found", f)
		}
	}
	switch err := c.exec.InboundLookupUsable(context.Background()); {
	case err == nil:
		c.ok("inbound: the kernel's socket lookup works: pods with detour.dev/redirect-inbound: listening get inbound connections redirected only where they listen")
	case os.Geteuid() != 0:
		c.warn("inbound: cannot tell whether the kernel does socket lookups (it takes root to try in a scratch network namespace): %v", err)
	default:
		c.warn("inbound: %v; detour-cni falls back to redirecting every inbound connection (as detour.dev/inbound-capture: all) and counts it in detour_cni_inbound_fallbacks_total: load xt_socket (iptables backends) or nft_socket (nftables)", err)
	}
}

// cniConfig checks the configuration file the runtime uses, as the node agent maintains it.
func (c *checker) cniConfig(dir string) {
	primary, err := nodeagent.Primary(dir)
	switch {
	case err != nil:
		c.fail("CNI configuration in %s: %v", dir, err)
		return
	case primary == "":
		c.fail("CNI configuration in %s: none found; the primary CNI has not written its configuration yet, and the node agent waits for it", dir)
		return
	}
	if files, fixes, err := nodeagent.RenamedAway(dir); err != nil {
		c.fail("CNI configuration in %s: %v", dir, err)
	} else if len(files) > 0 {
		c.fail("the primary CNI renamed detour's configuration away (%s), and the node agent keeps the node unlabelled: %s; then delete the renamed file", strings.Join(files, ", "), fixes[0])
	}
	data, err := os.ReadFile(primary)
	if err != nil {
		c.fail("read %s: %v", primary, err)
		return
	}
	netList, err := nodeagent.LoadNetwork(primary, data)
	if err != nil {
		c.fail("%s cannot be loaded as a CNI configuration: %v", primary, err)
		return
	} else if err := nodeagent.CheckCNIVersion(netList); err != nil {
		c.fail("%s: %v (the node agent refuses to chain into it and removes detour's entry)", filepath.Base(primary), err)
		return
	}
	var list struct {
		Plugins []json.RawMessage `json:"plugins"`
	}
	if err := json.Unmarshal(data, &list); err != nil || len(list.Plugins) == 0 {
		c.fail("%s is not a conflist with plugins; the node agent converts a .conf when it installs detour", primary)
		return
	}
	// detour's entry must come after the primary plugin; another chained plugin may follow it.
	var conf *cniplugin.Config
	for i, raw := range list.Plugins {
		if pluginType(raw) != cniplugin.PluginType {
			continue
		}
		if i == 0 {
			c.fail("%s: %s is the first plugin; it must follow the primary CNI plugin", primary, cniplugin.PluginType)
			return
		}
		if conf, err = cniplugin.ParseConfig(raw); err != nil {
			c.fail("%s: %s's configuration: %v", primary, cniplugin.PluginType, err)
			return
		}
	}
	dropIn, dropInConf, ok := c.dropIn(dir, netList)
	if !ok {
		return
	}
	switch {
	case conf != nil && dropIn != "":
		c.fail("%s holds a %s entry and %s is detour's drop-in as well: the runtime runs the plugin twice; the node agent keeps one of them (cniConfigMode), so restart it or remove one", primary, cniplugin.PluginType, dropIn)
		return
	case dropIn != "":
		why := "the primary rewriting its conflist leaves it alone"
		if mode, reason := nodeagent.ReadModeFile(dir); mode == nodeagent.ModeDropIn {
			why = reason
		}
		c.ok("%s (the configuration the runtime uses) loads %s from the drop-in %s after its plugins (mode drop-in: %s)", filepath.Base(primary), cniplugin.PluginType, dropIn, why)
		conf = dropInConf
	case conf == nil:
		c.fail("%s (the configuration the runtime uses) has no %s entry and no drop-in in %s: the node agent is not running on this node, or the primary CNI rewrote the file since (the agent puts the entry back within its resync interval)", primary, cniplugin.PluginType, filepath.Join(dir, netList.Name))
		return
	default:
		why := "cniConfigMode chained-entry, or auto on a runtime that loads no drop-ins (the node agent's log says which)"
		if mode, reason := nodeagent.ReadModeFile(dir); mode == nodeagent.ModeChainedEntry {
			why = reason
		}
		switch {
		case filepath.Ext(primary) != ".conflist":
			why = "a single-plugin .conf gets no drop-ins"
		case netList.LoadOnlyInlinedPlugins:
			why = `the conflist sets "loadOnlyInlinedPlugins": true, so the runtime ignores drop-ins`
		}
		c.ok("%s (the configuration the runtime uses) chains %s after the primary plugin (mode chained-entry: %s)", filepath.Base(primary), cniplugin.PluginType, why)
	}
	if conf.Kubeconfig != "" {
		if _, err := os.Stat(conf.Kubeconfig); err != nil {
			c.fail("the plugin's kubeconfig: %v; the node agent writes it", err)
		} else {
			c.ok("the plugin's kubeconfig %s is there", conf.Kubeconfig)
		}
	}
}

// dropIn finds detour's drop-in for the network in <dir>/<network name>/: the file, its parsed
// configuration, and false when it reported a failure (a drop-in the runtime ignores or runs
// before another one, or one the plugin cannot parse).
func (c *checker) dropIn(dir string, list *libcni.NetworkConfigList) (string, *cniplugin.Config, bool) {
	sub := filepath.Join(dir, list.Name)
	files, err := libcni.ConfFiles(sub, []string{".conf"})
	if err != nil {
		c.fail("list the drop-ins in %s: %v", sub, err)
		return "", nil, false
	}
	sort.Strings(files)
	found := ""
	var conf *cniplugin.Config
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			c.fail("read %s: %v", f, err)
			return "", nil, false
		}
		if pluginType(data) != cniplugin.PluginType {
			if found != "" {
				c.fail("%s runs after detour's drop-in %s: rename it to sort before %s", f, found, nodeagent.DropInName)
				return "", nil, false
			}
			continue
		}
		if found != "" {
			c.fail("%s and %s are both detour drop-ins: the runtime runs the plugin twice", found, f)
			return "", nil, false
		}
		if conf, err = cniplugin.ParseConfig(data); err != nil {
			c.fail("%s: %s's configuration: %v", f, cniplugin.PluginType, err)
			return "", nil, false
		}
		found = f
	}
	if found != "" && list.LoadOnlyInlinedPlugins {
		c.fail(`%s is detour's drop-in, but the conflist sets "loadOnlyInlinedPlugins": true, so the runtime ignores it; the node agent moves detour into the conflist`, found)
		return "", nil, false
	}
	return found, conf, true
}

func pluginType(raw []byte) string {
	var p struct {
		Type string `json:"type"`
	}
	if json.Unmarshal(raw, &p) != nil {
		return ""
	}
	return p.Type
}

// podRules compares the live rules in netns with the ones the pod's annotations call for.
func (c *checker) podRules(cmd *cobra.Command, file, netns string) {
	in, closeIn, err := openInput(cmd, file)
	if err != nil {
		c.fail("%v", err)
		return
	}
	defer closeIn()
	name, a, err := manifest.PodAnnotations(in)
	switch {
	case err != nil:
		c.fail("read %s: %v", file, err)
		return
	case !annotations.IsInjected(a):
		c.fail("%s is not injected (no %s annotation): detour-cni installs no rules for it", name, annotations.Injected)
		return
	}
	r, err := annotations.ParseRedirect(a)
	if err != nil {
		c.fail("%s: %v", name, err)
		return
	}
	if r.CheckPort != 0 {
		c.checkPortFree(name, netns, r)
	}
	ctx := context.Background()
	for _, f := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
		rs, err := iptables.Build(iptables.ConfigFromRedirect(r, f))
		if err != nil {
			c.fail("%s: %v", name, err)
			return
		}
		if f == iptables.IPv6 {
			// The plugin installs IPv6 rules for pods with an IPv6 address (or ipv6: always).
			has, err := hasGlobalIPv6(netns)
			if err != nil {
				c.fail("read the addresses in %s: %v", netns, err)
				continue
			}
			saved, _, _ := c.exec.Save(ctx, netns, f)
			if !has && !strings.Contains(saved, iptables.OutboundChain) && !strings.Contains(saved, iptables.NFTOutboundChain(f)) {
				c.ok("%s: no IPv6 address in %s, and no IPv6 rules", name, netns)
				continue
			}
		}
		how, err := c.exec.CheckInstalled(ctx, netns, rs)
		var diff *iptables.DiffError
		switch newer := injectedByNewer(a[annotations.Injected]); {
		case err != nil && newer != "" && errors.As(err, &diff) && !diff.Missing:
			// After a rollback: the newer release's plugin may have installed rules this one
			// does not know of, so a rule that differs says nothing of the pod's redirect. A
			// missing table, chain, jump or redirect is a hole whatever the release.
			c.warn("%s: %v; the pod was injected by detour %s, newer than this one (%s), whose rules this check cannot judge: run that release's detour check, or recreate the pod (kubectl rollout restart) to give it this release's rules", name, err, newer, version.Version)
		case err != nil:
			c.fail("%s: %v", name, err)
		case how == iptables.InboundFallbackInstalled:
			c.warn("%s: the %s rules in %s are the fallback detour-cni installs where the kernel refuses the socket lookup of %s: listening — every inbound connection goes to the proxy, as with %s: all; load nft_socket (nftables backend) or xt_socket (iptables backends) on the node and recreate the pod", name, f, netns, annotations.RedirectInbound, annotations.InboundCapture)
		case how == iptables.V010Installed:
			c.warn("%s: the %s rules in %s are what detour-cni v0.1.0 installs for this pod, injected by detour %s: that plugin knows neither %s: listening nor %s, so every inbound connection goes to the proxy and the check's connections to its outbound port; the pod started while its node still ran v0.1.0's agent (an upgrade) — recreate it (kubectl rollout restart) once detour-node-agent runs this release on the node", name, f, netns, cmp.Or(a[annotations.Injected], "a newer release"), annotations.RedirectInbound, annotations.ValidatorCheckPort)
		default:
			c.ok("%s: the %s rules in %s are exactly what detour-cni installs", name, f, netns)
		}
	}
}

// checkPortFree reports whether a container of the pod listens on the port of the check at the
// proxy's start. The check passed when the pod started, before the app ran; at the proxy's next
// start it finds the port taken, exits 43 and the proxy crash-loops for the pod's life. Only
// the check itself, as the proxy's UID and for a moment, may listen there.
func (c *checker) checkPortFree(name, netns string, r annotations.Redirect) {
	var held []validator.Listener
	err := nsutil.Do(netns, func() error {
		var err error
		held, err = validator.ListenersOn(r.CheckPort)
		return err
	})
	if err != nil {
		c.fail("%s: read the sockets listening in %s: %v", name, netns, err)
		return
	}
	var others []string
	for _, l := range held {
		if l.UID != r.ProxyUID {
			others = append(others, fmt.Sprintf("%s (uid %d)", l.Addr, l.UID))
		}
	}
	if len(others) == 0 {
		c.ok("%s: nothing of the pod listens on the check port %d (%s)", name, r.CheckPort, annotations.ValidatorCheckPort)
		return
	}
	c.fail("%s: a container of the pod listens on the check port %d (%s) at %s: the check at the proxy's next start will find it taken, exit %d, and the proxy will crash-loop until the pod is recreated; move that container's port, or have the cluster admin set the webhook's validator.checkPort to a port no container uses, then recreate the pod",
		name, r.CheckPort, annotations.ValidatorCheckPort, strings.Join(others, " and "), validator.ExitPortInUse)
}

// injectedByNewer returns the version in a pod's detour.dev/injected when it is a release
// newer than this binary's (a pod created before a rollback), else "". Only releases count: a
// development build (v0.3.0-dev.<commit>) and the pods of its release's other builds are the
// same release, whose rules it knows. A version that does not parse is not newer: the check
// judges the pod.
func injectedByNewer(injected string) string {
	pod, err := release(injected)
	if err != nil {
		return ""
	}
	self, err := release(version.Version)
	if err != nil || !pod.GreaterThan(self) {
		return ""
	}
	return injected
}

// release is the release of the semantic version v: its major, minor and patch, without
// pre-release or build metadata.
func release(v string) (*utilversion.Version, error) {
	sv, err := utilversion.ParseSemantic(v)
	if err != nil {
		return nil, err
	}
	return utilversion.ParseSemantic(fmt.Sprintf("%d.%d.%d", sv.Major(), sv.Minor(), sv.Patch()))
}

// hasGlobalIPv6 reports whether the network namespace at path has a global IPv6 address.
func hasGlobalIPv6(path string) (bool, error) {
	h, err := netns.GetFromPath(path)
	if err != nil {
		return false, err
	}
	defer h.Close()
	nl, err := netlink.NewHandleAt(h)
	if err != nil {
		return false, err
	}
	defer nl.Close()
	addrs, err := nl.AddrList(nil, netlink.FAMILY_V6)
	if err != nil {
		return false, err
	}
	for _, a := range addrs {
		if a.IP.IsGlobalUnicast() {
			return true, nil
		}
	}
	return false, nil
}
