package framework

import (
	"context"
	"fmt"
	"net"
	"net/netip"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"

	"github.com/detourmesh/detour/internal/nsutil"
)

// netSpec is the node's network: its IP on a veth pair kept inside the node's namespace (the
// kubelet refuses a loopback node IP and this kernel has no dummy links). The node IP lies in
// the underlay's prefix: when a node joins the cluster, the peer end of its veth moves into the
// control-plane node's namespace and becomes a port of the underlay's bridge (cluster.go).
// Services are kube-proxy's, which runs on every node (components.go).
type netSpec struct {
	Link   string
	NodeIP netip.Addr
	// NodeIP6, when valid, is the node's IPv6 address (a dual-stack or IPv6-only cluster).
	NodeIP6 netip.Addr
}

// setUpNodeNetwork runs in the holder, inside the node's fresh network namespace.
func setUpNodeNetwork(n netSpec) error {
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return err
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		return fmt.Errorf("bring lo up: %w", err)
	}
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: n.Link}, PeerName: n.Link + "p"}
	if err := netlink.LinkAdd(veth); err != nil {
		return fmt.Errorf("add the node's veth %s: %w", n.Link, err)
	}
	ips := []netip.Addr{n.NodeIP}
	if n.NodeIP6.IsValid() {
		ips = append(ips, n.NodeIP6)
	}
	for _, ip := range ips {
		if err := netlink.AddrAdd(veth, nodeAddr(ip)); err != nil {
			return fmt.Errorf("give %s the node IP %s: %w", n.Link, ip, err)
		}
	}
	for _, name := range []string{n.Link, n.Link + "p"} {
		l, err := netlink.LinkByName(name)
		if err != nil {
			return err
		}
		if err := netlink.LinkSetUp(l); err != nil {
			return fmt.Errorf("bring %s up: %w", name, err)
		}
	}
	l, err := netlink.LinkByName(n.Link)
	if err != nil {
		return err
	}
	for _, ip := range ips {
		if err := routeServices(l, ip); err != nil {
			return err
		}
	}
	return addPodBridge(podBridge)
}

// nodeAddr is the node IP ip as its link holds it: in the underlay's prefix of its family. An
// IPv6 one skips duplicate address detection: the address is the namespace's own, and an
// address still tentative cannot be bound (the API server's, the test server's).
func nodeAddr(ip netip.Addr) *netlink.Addr {
	if ip.Is4() {
		return &netlink.Addr{IPNet: &net.IPNet{IP: ip.AsSlice(), Mask: net.CIDRMask(underlay.Bits(), 32)}}
	}
	return &netlink.Addr{IPNet: &net.IPNet{IP: ip.AsSlice(), Mask: net.CIDRMask(ipv6.underlay.Bits(), 128)},
		Flags: unix.IFA_F_NODAD}
}

// routeServices routes the Service range of ip's family over l from ip, as a node's default
// route does: without one, a host-network process's connect to a ClusterIP fails before
// kube-proxy's output hook can translate it ("network is unreachable").
func routeServices(l netlink.Link, ip netip.Addr) error {
	services := ipv4.serviceCIDR
	if ip.Is6() {
		services = ipv6.serviceCIDR
	}
	dst := &net.IPNet{IP: services.Addr().AsSlice(), Mask: net.CIDRMask(services.Bits(), services.Addr().BitLen())}
	route := &netlink.Route{LinkIndex: l.Attrs().Index, Dst: dst, Src: ip.AsSlice(), Scope: netlink.SCOPE_LINK}
	if err := netlink.RouteAdd(route); err != nil {
		return fmt.Errorf("route the Service range %s over %s: %w", services, l.Attrs().Name, err)
	}
	return nil
}

// podBridge is the primary CNI's bridge (its conflist's "bridge").
const podBridge = "cni0"

// addPodBridge creates the primary's bridge before its plugin does (which then uses it as it
// finds it), with the bridge's own switch to pass bridged IPv4 through netfilter: a pod that
// reaches a Service whose endpoint is on the same bridge gets its reply un-NATed only so. On a
// real node the machine-wide bridge-nf-call-iptables does this; here the control-plane node
// turns that one off for the underlay's bridge once a node joins (cluster.go).
func addPodBridge(name string) error {
	req := nl.NewNetlinkRequest(unix.RTM_NEWLINK, unix.NLM_F_CREATE|unix.NLM_F_EXCL|unix.NLM_F_ACK)
	req.AddData(nl.NewIfInfomsg(unix.AF_UNSPEC))
	req.AddData(nl.NewRtAttr(unix.IFLA_IFNAME, nl.ZeroTerminated(name)))
	info := nl.NewRtAttr(unix.IFLA_LINKINFO, nil)
	info.AddRtAttr(nl.IFLA_INFO_KIND, nl.NonZeroTerminated("bridge"))
	data := info.AddRtAttr(nl.IFLA_INFO_DATA, nil)
	data.AddRtAttr(nl.IFLA_BR_NF_CALL_IPTABLES, nl.Uint8Attr(1))
	req.AddData(info)
	if _, err := req.Execute(unix.NETLINK_ROUTE, 0); err != nil {
		return fmt.Errorf("add the pods' bridge %s: %w", name, err)
	}
	return nil
}

// netnsDialer dials from inside a network namespace: the socket is created there, and keeps
// that namespace wherever its goroutines run.
type netnsDialer struct{ path string }

func (d netnsDialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	var conn net.Conn
	err := nsutil.Do(d.path, func() error {
		var err error
		conn, err = (&net.Dialer{}).DialContext(ctx, network, addr)
		return err
	})
	return conn, err
}
