package framework

import (
	"slices"
	"strings"
	"testing"

	"github.com/detourmesh/detour/test/images"
)

// Each proxy recognises, in the app's serve line, a connection it made: the test proxy's come
// from loopback, HAProxy's from the pod's own address; the node's or a peer's never pass.
func TestProxied(t *testing.T) {
	for _, c := range []struct {
		p     *Proxy
		reply string
		want  bool
	}{
		{TestProxy, "app uid=1500 gid=1500 groups=1500 peer=127.0.0.1:43210 local=127.0.0.1:8080\n", true},
		{TestProxy, "app uid=1500 gid=1500 groups=1500 peer=[::1]:43210 local=[::1]:8080\n", true},
		{TestProxy, "app uid=1500 gid=1500 groups=1500 peer=10.88.0.1:43210 local=10.88.0.7:8080\n", false},
		{HAProxy, "app uid=1500 gid=1500 groups=1500 peer=10.88.0.7:43210 local=10.88.0.7:8080\n", true},
		{HAProxy, "dial 10.96.0.10:80 ok: app uid=1500 gid=1500 groups=1500 peer=10.88.0.7:43210 local=10.88.0.7:8080", true},
		{HAProxy, "app uid=1500 gid=1500 groups=1500 peer=10.88.0.1:43210 local=10.88.0.7:8080\n", false},
		{HAProxy, "app uid=1500 gid=1500 groups=1500 peer=127.0.0.1:43210 local=127.0.0.1:8080\n", false},
		{HAProxy, "no reply", false},
		{HAProxy, "app peer=nonsense local=10.88.0.7:8080", false},
	} {
		if got := c.p.Proxied(c.reply); got != c.want {
			t.Errorf("%s: Proxied(%q) = %v, want %v", c.p.Name, c.reply, got, c.want)
		}
	}
}

// A release before proxy.volumes (v0.1.0) gets HAProxy's unmounted configuration, without
// volumes; the working tree and later releases get the proxy as it is.
func TestForRelease(t *testing.T) {
	old, next := &Release{Version: "v0.1.0"}, &Release{Version: "v0.2.0"}
	mounts := func(p *Proxy) bool { return strings.Contains(p.config, "volumes:") }
	if p := HAProxy.ForRelease(old); !slices.Equal(p.Command, images.HAProxyUnmountedCommand) || mounts(p) {
		t.Errorf("HAProxy for v0.1.0: command %q, volumes %v; want the unmounted configuration and no volume", p.Command, mounts(p))
	}
	if p := HAProxy.ForRelease(next); p != HAProxy || !mounts(p) {
		t.Errorf("HAProxy for v0.2.0: %+v, want HAProxy with its volumes", p)
	}
	if p := TestProxy.ForRelease(old); p != TestProxy {
		t.Errorf("the test proxy for v0.1.0: %+v", p)
	}
}
