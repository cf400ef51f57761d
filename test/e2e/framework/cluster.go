package framework

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/detourmesh/detour/internal/nsutil"
)

// A cluster is the control-plane node and the nodes that join it. A node that joins runs its
// own containerd and kubelet in a network namespace, a mount namespace and a cgroup subtree of
// its own, as the control-plane node does, and shares the control plane: its kubelet registers
// with the same API server under its own name and certificate.
//
// The underlay is a bridge in the control-plane node's network namespace ("the switch of the
// rack"): each node's address lies in the underlay prefix on its own veth, whose peer end is
// a port of that bridge. Each node's pods have their own /24 of 10.88.0.0/16 (and /64 of
// fd00:88::/56 on a cluster with IPv6: families.go), on the primary CNI's bridge, and every
// node routes the others' pod ranges through their node IPs of the same family — what a
// host-gw primary (flannel's host-gw backend, Calico without encapsulation) does on one L2
// segment.

// underlayBridge is the bridge of the underlay, in the control-plane node's namespace.
const underlayBridge = "underlay0"

// Join starts a node named name that joins cp's cluster with opts (its images, taints,
// labels and sandbox image, cp's when empty). The node is Ready when Join returns.
func (cp *Node) Join(ctx context.Context, name string, opts Options) (n *Node, err error) {
	if cp.cp != nil {
		return nil, fmt.Errorf("join %s: %s is not the control-plane node", name, cp.Name)
	}
	if port := underlayPort(name); len(port) > 15 {
		return nil, fmt.Errorf("join %s: the name is too long for its underlay port's link name %s (15 bytes at most)", name, port)
	}
	if opts.PauseImage == "" {
		opts.PauseImage = cp.opts.PauseImage
	}
	cp.mu.Lock()
	if cp.joined[name] != nil {
		cp.mu.Unlock()
		return nil, fmt.Errorf("join %s: a node of that name is already in the cluster", name)
	}
	index := cp.freeIndex()
	if index < 0 {
		cp.mu.Unlock()
		return nil, fmt.Errorf("join %s: the underlay %s has no address left", name, underlay)
	}
	fams := cp.Families().nodeFamilies(index)
	n = &Node{
		Name: name, IP: UnderlayAddr(index), PodSubnet: fams[0].pods, fams: fams,
		Dir: filepath.Join(cp.Dir, "nodes", name), BinDir: cp.BinDir, opts: opts,
		Cgroup: cp.Cgroup + "/" + name, pids: map[string]int{}, cp: cp,
		Config: cp.Config, Client: cp.Client,
	}
	n.CNIConfDir = filepath.Join(n.Dir, "cni", "net.d")
	n.CNIBinDir = filepath.Join(n.Dir, "cni", "bin")
	cp.joined[name] = n
	cp.mu.Unlock()
	defer func() {
		if err != nil {
			err = errors.Join(err, n.Leave())
			n = nil
		}
	}()
	if err := os.MkdirAll(n.Dir, 0o755); err != nil {
		return n, err
	}
	if err := createCgroup(n.Cgroup); err != nil {
		return n, err
	}
	if err := n.writeFiles(); err != nil {
		return n, fmt.Errorf("write %s's files: %w", name, err)
	}
	n.holder, err = startHolder(holderSpec{
		RunDir: n.Dir, Cgroup: n.Cgroup, Sysctls: machineSysctls(),
		// One chart for every node: the paths it names are the control-plane node's, and
		// each node mounts its own directories over them.
		Binds: append([]bindMount{
			{Source: filepath.Join(n.Dir, "cni"), Target: filepath.Join(cp.Dir, "cni")},
			{Source: filepath.Join(n.Dir, "logs"), Target: filepath.Join(cp.Dir, "logs")},
		}, n.ciliumBinds()...),
		Net: n.netSpec(),
	}, n.logPath("holder"))
	if err != nil {
		return n, err
	}
	if err := n.plugIntoUnderlay(); err != nil {
		return n, fmt.Errorf("connect %s to the underlay: %w", name, err)
	}
	if err := n.StartComponent(ctx, "containerd"); err != nil {
		return n, err
	}
	if err := n.startKubelet(ctx); err != nil {
		return n, err
	}
	if !n.kubeProxy() {
		return n, nil
	}
	return n, n.StartComponent(ctx, "kube-proxy")
}

// Leave ends a node that joined (its processes, cgroups, directory, and the other nodes'
// routes to its pods); the Node object in the API is left to the caller, as a machine that
// goes away leaves it.
func (n *Node) Leave() error {
	cp := n.cp
	if cp == nil {
		return fmt.Errorf("%s is the control-plane node: Stop it", n.Name)
	}
	cp.mu.Lock()
	if cp.joined[n.Name] != n {
		cp.mu.Unlock()
		return nil
	}
	delete(cp.joined, n.Name)
	cp.mu.Unlock()
	var errs []error
	for _, o := range cp.Nodes() {
		errs = append(errs, o.routePods(n, false))
	}
	return errors.Join(append(errs, n.teardown())...)
}

// Nodes returns the cluster's nodes: the control-plane node first, then the nodes that joined
// it, by name.
func (cp *Node) Nodes() []*Node {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	out := []*Node{cp}
	for _, name := range slices.Sorted(maps.Keys(cp.joined)) {
		out = append(out, cp.joined[name])
	}
	return out
}

// freeIndex returns the lowest node index no node uses (0 is the control-plane node's), or -1.
// cp.mu is held.
func (cp *Node) freeIndex() int {
	used := map[netip.Addr]bool{cp.IP: true}
	for _, n := range cp.joined {
		used[n.IP] = true
	}
	for i := 1; i < 250; i++ {
		if !used[UnderlayAddr(i)] {
			return i
		}
	}
	return -1
}

// UnderlayAddr is node i's IPv4 address: the underlay's (i+1)th.
func UnderlayAddr(i int) netip.Addr {
	ip, _ := ipv4.at(i)
	return ip
}

// plugIntoUnderlay moves the peer end of the node's veth into the control-plane node's
// namespace, makes it a port of the underlay's bridge (created, with the control-plane node's
// own peer end as its first port, when the first node joins), and routes pod ranges both ways
// between the new node and every other one.
func (n *Node) plugIntoUnderlay() error {
	cp := n.cp
	port := underlayPort(n.Name)
	cpNS, err := os.Open(cp.holder.netns())
	if err != nil {
		return err
	}
	defer cpNS.Close()
	err = nsutil.Do(n.holder.netns(), func() error {
		l, err := netlink.LinkByName("node0p")
		if err != nil {
			return err
		}
		if err := netlink.LinkSetName(l, port); err != nil {
			return fmt.Errorf("rename node0p to %s: %w", port, err)
		}
		return netlink.LinkSetNsFd(l, int(cpNS.Fd()))
	})
	if err != nil {
		return fmt.Errorf("move %s's underlay port into %s's namespace: %w", n.Name, cp.Name, err)
	}
	err = nsutil.Do(cp.holder.netns(), func() error {
		br, err := netlink.LinkByName(underlayBridge)
		if _, missing := err.(netlink.LinkNotFoundError); err != nil && !missing {
			return err
		}
		if err != nil {
			br = &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: underlayBridge}}
			if err := netlink.LinkAdd(br); err != nil {
				return fmt.Errorf("add the underlay's bridge: %w", err)
			}
			if err := enslave("node0p", br); err != nil {
				return err
			}
			// A switch, not a router: frames between two other nodes do not pass through the
			// control-plane node's netfilter (br_netfilter is on by default in a namespace).
			for _, f := range []string{"bridge-nf-call-iptables", "bridge-nf-call-ip6tables"} {
				err := os.WriteFile("/proc/sys/net/bridge/"+f, []byte("0"), 0o644)
				if err != nil && !os.IsNotExist(err) {
					return fmt.Errorf("turn %s off: %w", f, err)
				}
			}
			if err := netlink.LinkSetUp(br); err != nil {
				return err
			}
		}
		return enslave(port, br)
	})
	if err != nil {
		return err
	}
	for _, o := range cp.Nodes() {
		if o == n {
			continue
		}
		if err := o.routePods(n, true); err != nil {
			return err
		}
		if err := n.routePods(o, true); err != nil {
			return err
		}
	}
	return nil
}

// underlayPort is the name of node's port on the underlay's bridge.
func underlayPort(node string) string { return "u-" + node }

// enslave makes link name a port of bridge br and brings it up.
func enslave(name string, br netlink.Link) error {
	l, err := netlink.LinkByName(name)
	if err != nil {
		return err
	}
	if err := netlink.LinkSetMaster(l, br); err != nil {
		return fmt.Errorf("make %s a port of %s: %w", name, br.Attrs().Name, err)
	}
	return netlink.LinkSetUp(l)
}

// routePods adds (or, with add unset, removes) n's route to the pods of other, through
// other's node IP on the underlay. Flannel and Cilium route them themselves.
func (n *Node) routePods(other *Node, add bool) error {
	if n.holder == nil || other == n || n.flannel() || n.cilium() {
		return nil
	}
	return nsutil.Do(n.holder.netns(), func() error {
		l, err := netlink.LinkByName("node0")
		if err != nil {
			return err
		}
		for _, f := range other.fams {
			dst := &net.IPNet{IP: f.pods.Addr().AsSlice(), Mask: net.CIDRMask(f.pods.Bits(), f.pods.Addr().BitLen())}
			r := &netlink.Route{LinkIndex: l.Attrs().Index, Dst: dst, Gw: f.ip.AsSlice()}
			if add {
				if err := netlink.RouteReplace(r); err != nil {
					return fmt.Errorf("route %s's pods %s via %s on %s: %w", other.Name, f.pods, f.ip, n.Name, err)
				}
				continue
			}
			if err := netlink.RouteDel(r); err != nil && !errors.Is(err, unix.ESRCH) {
				return fmt.Errorf("remove %s's route to %s's pods %s: %w", n.Name, other.Name, f.pods, err)
			}
		}
		return nil
	})
}
