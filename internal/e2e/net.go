package e2e

import (
	"context"
	"fmt"
	"net"
	"net/netip"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/detourmesh/detour/internal/nsutil"
)

// netSpec is the node's network: its IP on a veth pair kept inside the node's namespace (the
// kubelet refuses a loopback node IP and this kernel has no dummy links), and the one Service
// the node needs without kube-proxy — the API server's ClusterIP, translated to the API
// server's own address for pods and host-network pods alike. The node IP lies in the
// underlay's prefix: when a node joins the cluster, the peer end of its veth moves into the
// control-plane node's namespace and becomes a port of the underlay's bridge (cluster.go).
type netSpec struct {
	Link      string
	NodeIP    netip.Addr
	ServiceIP netip.Addr // the kubernetes Service's ClusterIP (port 443)
	APIIP     netip.Addr // the API server's address (the control-plane node's IP)
	APIPort   uint16
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
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: n.NodeIP.AsSlice(), Mask: net.CIDRMask(underlay.Bits(), n.NodeIP.BitLen())}}
	if err := netlink.AddrAdd(veth, addr); err != nil {
		return fmt.Errorf("give %s the node IP %s: %w", n.Link, n.NodeIP, err)
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
	// A route to the Service range, as a node's default route gives it: without one, a
	// host-network process's connect to the ClusterIP fails before the output hook can
	// translate it ("network is unreachable").
	l, err := netlink.LinkByName(n.Link)
	if err != nil {
		return err
	}
	_, services, err := net.ParseCIDR(serviceCIDR)
	if err != nil {
		return err
	}
	route := &netlink.Route{LinkIndex: l.Attrs().Index, Dst: services, Src: n.NodeIP.AsSlice(), Scope: netlink.SCOPE_LINK}
	if err := netlink.RouteAdd(route); err != nil {
		return fmt.Errorf("route the Service range %s over %s: %w", serviceCIDR, n.Link, err)
	}
	return serviceDNAT(n)
}

// serviceDNAT plays kube-proxy for the kubernetes Service: ServiceIP:443 goes to
// APIIP:APIPort, from pods (prerouting) and from the node itself (output).
func serviceDNAT(n netSpec) error {
	c, err := nftables.New()
	if err != nil {
		return err
	}
	table := c.AddTable(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: "e2e-kube-proxy"})
	rule := []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: n.ServiceIP.AsSlice()},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(443)},
		&expr.Immediate{Register: 1, Data: n.APIIP.AsSlice()},
		&expr.Immediate{Register: 2, Data: binaryutil.BigEndian.PutUint16(n.APIPort)},
		&expr.NAT{Type: expr.NATTypeDestNAT, Family: unix.NFPROTO_IPV4, RegAddrMin: 1, RegProtoMin: 2},
	}
	for _, hook := range []struct {
		name string
		num  *nftables.ChainHook
	}{{"prerouting", nftables.ChainHookPrerouting}, {"output", nftables.ChainHookOutput}} {
		chain := c.AddChain(&nftables.Chain{
			Name: hook.name, Table: table, Type: nftables.ChainTypeNAT,
			Hooknum: hook.num, Priority: nftables.ChainPriorityNATDest,
		})
		c.AddRule(&nftables.Rule{Table: table, Chain: chain, Exprs: rule})
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("add the kubernetes Service's DNAT: %w", err)
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
