// Package netlab is a small network lab for detour's integration tests and its local demo:
// network namespaces kept alive by bind mounts, veth links between them, and routes — all
// made from Go (no ip netns exec, no nsenter).
package netlab

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strconv"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/detourmesh/detour/internal/nsutil"
)

// NetNS is a network namespace bound to a file; Path is what CNI_NETNS and nsutil.Do take.
type NetNS struct {
	Name string
	Path string
}

// ProcessDir is a directory under root for the namespaces of the calling process, so that
// namespaces of concurrent processes never share a directory (see Sweep).
func ProcessDir(root string) string { return filepath.Join(root, strconv.Itoa(os.Getpid())) }

// Create makes a new network namespace with loopback up, bound to a file in dir.
func Create(dir string) (*NetNS, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	var suffix [4]byte
	_, _ = rand.Read(suffix[:])
	ns := &NetNS{Name: "ns-" + hex.EncodeToString(suffix[:])}
	ns.Path = filepath.Join(dir, ns.Name)
	f, err := os.Create(ns.Path)
	if err != nil {
		return nil, err
	}
	f.Close()

	// Create the namespace on a locked thread of its own, bind-mount it to keep it alive, and
	// let the thread die with it (it is never unlocked).
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("unshare: %w", err)
			return
		}
		self := fmt.Sprintf("/proc/self/task/%d/ns/net", unix.Gettid())
		if err := unix.Mount(self, ns.Path, "none", unix.MS_BIND, ""); err != nil {
			errc <- fmt.Errorf("bind-mount %s: %w", ns.Path, err)
			return
		}
		errc <- nil
	}()
	if err := <-errc; err != nil {
		os.Remove(ns.Path)
		return nil, err
	}
	if err := ns.Handle(func(h *netlink.Handle) error {
		lo, err := h.LinkByName("lo")
		if err != nil {
			return err
		}
		return h.LinkSetUp(lo)
	}); err != nil {
		ns.Remove()
		return nil, fmt.Errorf("bring up loopback: %w", err)
	}
	return ns, nil
}

// Remove unmounts and deletes the namespace; it is safe to call twice.
func (ns *NetNS) Remove() error {
	if err := unix.Unmount(ns.Path, unix.MNT_DETACH); err != nil && err != unix.EINVAL && err != unix.ENOENT {
		return fmt.Errorf("unmount %s: %w", ns.Path, err)
	}
	if err := os.Remove(ns.Path); err != nil && !os.IsNotExist(err) {
		return err
	}
	return nil
}

// Do runs fn inside the namespace (see nsutil.Do).
func (ns *NetNS) Do(fn func() error) error { return nsutil.Do(ns.Path, fn) }

// Handle runs fn with a netlink handle bound to the namespace, without switching threads.
func (ns *NetNS) Handle(fn func(*netlink.Handle) error) error {
	fd, err := netns.GetFromPath(ns.Path)
	if err != nil {
		return err
	}
	defer fd.Close()
	h, err := netlink.NewHandleAt(fd)
	if err != nil {
		return err
	}
	defer h.Close()
	return fn(h)
}

// Sweep removes the namespaces under root left by processes that no longer run (a process
// killed by a timeout runs no cleanup); each process keeps its own in ProcessDir(root).
func Sweep(root string) {
	dirs, _ := os.ReadDir(root)
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		if _, err := os.Stat(filepath.Join("/proc", d.Name())); err == nil {
			continue // still running
		}
		dir := filepath.Join(root, d.Name())
		entries, _ := os.ReadDir(dir)
		for _, e := range entries {
			(&NetNS{Path: filepath.Join(dir, e.Name())}).Remove()
		}
		os.Remove(dir)
	}
}

// Link connects namespaces a and b with a veth pair named ifA (in a) and ifB (in b), gives each
// end its addresses and brings both up. IPv6 addresses skip duplicate address detection so they
// work at once.
func Link(a *NetNS, ifA string, addrsA []netip.Prefix, b *NetNS, ifB string, addrsB []netip.Prefix) error {
	err := a.Handle(func(ha *netlink.Handle) error {
		peerNS, err := netns.GetFromPath(b.Path)
		if err != nil {
			return err
		}
		defer peerNS.Close()
		veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: ifA}, PeerName: ifB, PeerNamespace: netlink.NsFd(peerNS)}
		if err := ha.LinkAdd(veth); err != nil {
			return fmt.Errorf("add veth %s/%s: %w", ifA, ifB, err)
		}
		return configure(ha, ifA, addrsA)
	})
	if err == nil {
		err = b.Handle(func(hb *netlink.Handle) error { return configure(hb, ifB, addrsB) })
	}
	if err != nil {
		return fmt.Errorf("link %s and %s: %w", a.Name, b.Name, err)
	}
	return nil
}

func configure(h *netlink.Handle, name string, addrs []netip.Prefix) error {
	link, err := h.LinkByName(name)
	if err != nil {
		return err
	}
	for _, p := range addrs {
		addr := &netlink.Addr{IPNet: IPNet(p)}
		if p.Addr().Is6() {
			addr.Flags = unix.IFA_F_NODAD
		}
		if err := h.AddrAdd(link, addr); err != nil {
			return fmt.Errorf("add %s to %s: %w", p, name, err)
		}
	}
	return h.LinkSetUp(link)
}

// AddRoute adds a route to dst via gw inside the namespace (default routes use 0.0.0.0/0 or ::/0).
func AddRoute(ns *NetNS, dst netip.Prefix, gw netip.Addr) error {
	err := ns.Handle(func(h *netlink.Handle) error {
		return h.RouteAdd(&netlink.Route{Dst: IPNet(dst), Gw: gw.AsSlice()})
	})
	if err != nil {
		return fmt.Errorf("route %s via %s in %s: %w", dst, gw, ns.Name, err)
	}
	return nil
}

// IPNet converts a prefix to the net.IPNet netlink takes.
func IPNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}
