package framework

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"strings"

	"github.com/vishvananda/netlink"

	"github.com/detourmesh/detour/internal/nsutil"
)

// Families are the IP families of a cluster: of its node IPs, its pods and its Services
// (Options.Families). A dual-stack or IPv6-only cluster runs on the primary's bridge network
// (flannel and Cilium are IPv4 only here); the nodes that join it take its families.
type Families string

const (
	// IPv4Only is every address IPv4 (the default).
	IPv4Only Families = ""
	// DualStack is IPv4 and IPv6, IPv4 the primary family: the kubelet's first node IP, a
	// Service's family when it names none, the cluster DNS's address.
	DualStack Families = "dual"
	// IPv6Only is the kubelet's node IP, the pods and the Services IPv6 only. The node's link
	// keeps its IPv4 address for what runs outside the cluster (the test process's connection
	// to the API server, containerd's to the registry), as a node keeps its management network.
	IPv6Only Families = "ipv6"
)

// family is one IP family's addresses in a cluster.
type family struct {
	name string // "ipv4", "ipv6"
	// nodeIP is the control-plane node's address on the underlay.
	nodeIP netip.Addr
	// podSubnet is the control-plane node's pods' range; clusterCIDR holds every node's.
	podSubnet, clusterCIDR netip.Prefix
	// serviceCIDR is the Services' range; serviceIP the kubernetes Service's address in it,
	// dnsIP kube-dns's.
	serviceCIDR      netip.Prefix
	serviceIP, dnsIP netip.Addr
	underlay         netip.Prefix
}

var (
	// nodeIP6 is the control-plane node's IPv6 address, on a dual-stack or IPv6-only cluster.
	nodeIP6 = netip.MustParseAddr("fd00:200::1")

	ipv4 = family{name: "ipv4", nodeIP: NodeIP, podSubnet: podSubnet, clusterCIDR: ClusterCIDR,
		serviceCIDR: serviceCIDR, serviceIP: serviceIP, dnsIP: dnsIP, underlay: underlay}
	// ipv6's ranges are unique local addresses; the Service range is a /112, the largest the
	// API server's allocator takes for IPv6 being a /108.
	ipv6 = family{name: "ipv6", nodeIP: nodeIP6,
		podSubnet: netip.MustParsePrefix("fd00:88::/64"), clusterCIDR: netip.MustParsePrefix("fd00:88::/56"),
		serviceCIDR: netip.MustParsePrefix("fd00:96::/112"),
		serviceIP:   netip.MustParseAddr("fd00:96::1"), dnsIP: netip.MustParseAddr("fd00:96::a"),
		underlay: netip.MustParsePrefix("fd00:200::/64")}
)

// list is f's families, the primary first.
func (f Families) list() []family {
	switch f {
	case DualStack:
		return []family{ipv4, ipv6}
	case IPv6Only:
		return []family{ipv6}
	default:
		return []family{ipv4}
	}
}

// check says what is wrong with f in opts, or nil.
func (f Families) check(opts Options) error {
	switch f {
	case IPv4Only:
		return nil
	case DualStack, IPv6Only:
		if opts.FlannelImage != "" || opts.Cilium != nil {
			return fmt.Errorf("Options.Families %q: a dual-stack or IPv6-only cluster runs on the bridge primary only, not flannel or Cilium", f)
		}
		return nil
	default:
		return fmt.Errorf("Options.Families %q: use %q (IPv4 only), %q or %q", f, IPv4Only, DualStack, IPv6Only)
	}
}

// Has6 reports whether f gives the pods IPv6 addresses.
func (f Families) Has6() bool { return f == DualStack || f == IPv6Only }

// Has4 reports whether f gives the pods IPv4 addresses.
func (f Families) Has4() bool { return f != IPv6Only }

// serviceCIDRs are f's Service ranges, comma-separated, the primary first (the API server's
// and the controller manager's --service-cluster-ip-range).
func (f Families) serviceCIDRs() string {
	return f.joinPrefixes(func(fam family) netip.Prefix { return fam.serviceCIDR })
}

// clusterCIDRs are f's ranges of every node's pods, comma-separated, the primary first.
func (f Families) clusterCIDRs() string {
	return f.joinPrefixes(func(fam family) netip.Prefix { return fam.clusterCIDR })
}

func (f Families) joinPrefixes(of func(family) netip.Prefix) string {
	var out []string
	for _, fam := range f.list() {
		out = append(out, of(fam).String())
	}
	return strings.Join(out, ",")
}

// at is node i's address on the underlay and its pods' range in fam (node 0 is the
// control-plane node: nodeIP and podSubnet).
func (fam family) at(i int) (netip.Addr, netip.Prefix) {
	ip, pods := fam.nodeIP.As16(), fam.podSubnet.Addr().As16()
	ip[15] += byte(i)
	if fam.nodeIP.Is4() {
		pods[14] += byte(i) // the third byte of the IPv4 address: 10.88.i.0/24
		return netip.AddrFrom16(ip).Unmap(), netip.PrefixFrom(netip.AddrFrom16(pods).Unmap(), fam.podSubnet.Bits())
	}
	pods[7] += byte(i) // fd00:88:0:i::/64
	return netip.AddrFrom16(ip), netip.PrefixFrom(netip.AddrFrom16(pods), fam.podSubnet.Bits())
}

// nodeFamily is a node's address and pods' range in one family of the cluster.
type nodeFamily struct {
	family
	ip   netip.Addr
	pods netip.Prefix
}

// nodeFamilies are node i's addresses and pods' ranges in f's families, the primary first.
func (f Families) nodeFamilies(i int) []nodeFamily {
	var out []nodeFamily
	for _, fam := range f.list() {
		ip, pods := fam.at(i)
		out = append(out, nodeFamily{fam, ip, pods})
	}
	return out
}

// Families is the cluster's IP families.
func (n *Node) Families() Families { return n.root().opts.Families }

// IPs are the node's addresses as its kubelet reports them (--node-ip), the primary first.
func (n *Node) IPs() []netip.Addr {
	var out []netip.Addr
	for _, f := range n.fams {
		out = append(out, f.ip)
	}
	return out
}

// PodSubnets are the node's pods' ranges, the primary first.
func (n *Node) PodSubnets() []netip.Prefix {
	var out []netip.Prefix
	for _, f := range n.fams {
		out = append(out, f.pods)
	}
	return out
}

// netSpec is the node's network: its IPv4 address on the underlay, and its IPv6 one when the
// cluster has IPv6.
func (n *Node) netSpec() netSpec {
	spec := netSpec{Link: "node0", NodeIP: n.IP}
	for _, f := range n.fams {
		if f.ip.Is6() {
			spec.NodeIP6 = f.ip
		}
	}
	return spec
}

// AddIPv6 turns n's running IPv4-only cluster into a dual-stack one, IPv4 the primary, the
// way Kubernetes' docs upgrade a cluster: the node gets its IPv6 address, the API server and
// the controller manager a second Service range, kube-proxy a second cluster CIDR, the
// primary's conflist an IPv6 range and the kubelet a second node IP, each restarted. The pods
// that run keep their IPv4 address alone: nothing runs their CNI ADD again. Pods created after
// get an address of each family. n is the control-plane node of a cluster of one node on the
// bridge primary.
func (n *Node) AddIPv6(ctx context.Context) error {
	n.mu.Lock()
	joined := len(n.joined)
	n.mu.Unlock()
	switch {
	case n.cp != nil || joined > 0:
		return fmt.Errorf("AddIPv6: %s is not the only node of its cluster", n.Name)
	case n.Families() != IPv4Only:
		return fmt.Errorf("AddIPv6: the cluster's families are %q already, not IPv4 only", n.Families())
	case n.flannel() || n.cilium():
		return errors.New("AddIPv6: a dual-stack cluster runs on the bridge primary only, not flannel or Cilium")
	}
	n.opts.Families = DualStack
	n.fams = DualStack.nodeFamilies(0)
	ip6 := n.fams[1].ip
	err := nsutil.Do(n.holder.netns(), func() error {
		l, err := netlink.LinkByName(n.netSpec().Link)
		if err != nil {
			return err
		}
		if err := netlink.AddrAdd(l, nodeAddr(ip6)); err != nil {
			return fmt.Errorf("give %s the node IP %s: %w", l.Attrs().Name, ip6, err)
		}
		return routeServices(l, ip6)
	})
	if err != nil {
		return err
	}
	for _, c := range []string{"kube-apiserver", "kube-controller-manager"} {
		if err := n.RestartComponent(ctx, c); err != nil {
			return fmt.Errorf("restart %s with both Service ranges: %w", c, err)
		}
	}
	if err := n.WritePrimaryConfig(); err != nil {
		return err
	}
	for _, c := range []string{"kubelet", "kube-proxy"} {
		if err := n.RestartComponent(ctx, c); err != nil {
			return fmt.Errorf("restart %s on both families: %w", c, err)
		}
	}
	return nil
}
