package framework

import (
	"net/netip"
	"testing"
)

// Each node's addresses follow the control-plane node's in every family, one per node index.
func TestNodeFamilies(t *testing.T) {
	for _, c := range []struct {
		f    Families
		i    int
		ips  []string
		pods []string
	}{
		{IPv4Only, 0, []string{"10.200.0.1"}, []string{"10.88.0.0/24"}},
		{IPv4Only, 2, []string{"10.200.0.3"}, []string{"10.88.2.0/24"}},
		{DualStack, 0, []string{"10.200.0.1", "fd00:200::1"}, []string{"10.88.0.0/24", "fd00:88::/64"}},
		{DualStack, 1, []string{"10.200.0.2", "fd00:200::2"}, []string{"10.88.1.0/24", "fd00:88:0:1::/64"}},
		{IPv6Only, 3, []string{"fd00:200::4"}, []string{"fd00:88:0:3::/64"}},
	} {
		fams := c.f.nodeFamilies(c.i)
		if len(fams) != len(c.ips) {
			t.Fatalf("%q node %d: %d families, want %d", c.f, c.i, len(fams), len(c.ips))
		}
		for k, f := range fams {
			if f.ip != netip.MustParseAddr(c.ips[k]) || f.pods != netip.MustParsePrefix(c.pods[k]) {
				t.Errorf("%q node %d, %s: %s and %s, want %s and %s", c.f, c.i, f.name, f.ip, f.pods, c.ips[k], c.pods[k])
			}
			if !f.clusterCIDR.Contains(f.pods.Addr()) || !f.underlay.Contains(f.ip) {
				t.Errorf("%q node %d, %s: %s or %s outside the cluster's %s and %s", c.f, c.i, f.name, f.pods, f.ip, f.clusterCIDR, f.underlay)
			}
		}
	}
	if err := Families("dual-stack").check(Options{}); err == nil {
		t.Error(`Families "dual-stack" passed its check`)
	}
	if err := DualStack.check(Options{FlannelImage: "flannel"}); err == nil {
		t.Error("a dual-stack flannel cluster passed its check")
	}
}
