package framework

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/test/images"
)

// Proxy is the proxy of every meshed pod in a run: what the webhook's configuration injects,
// and how a story reads from the proxy's log and the app's reply that a connection went through
// it. The test proxy is the default; DETOUR_E2E_PROXY=haproxy makes it HAProxy (the HAProxy
// image, its configuration, what it needs mounted), as `make e2e-haproxy` and
// `make conformance-haproxy` run.
type Proxy struct {
	// Name is the value of DETOUR_E2E_PROXY that selects it.
	Name string
	// Command is the proxy's command line as the webhook's configuration sets it (the check at
	// the proxy's start execs it).
	Command []string
	// config is the rest of the webhook's proxy section (YAML at the proxy section's indent).
	config string
	// ref picks the proxy's image from the test images.
	ref func(images.Refs) string
	// inbound matches the log line of an inbound connection; outbound is the log line of an
	// outbound connection's original destination (%s: host:port).
	inbound  *regexp.Regexp
	outbound string
	// fromProxy reports whether a connection the app accepted on local came from the proxy at
	// peer.
	fromProxy func(peer, local netip.Addr) bool
	// unmounted is the proxy for a release whose webhook cannot mount volumes (v0.1.0), or nil
	// when the proxy needs none: what the upgrade story installs the previous release with.
	unmounted *Proxy
}

// TestProxy is the test proxy (test/images/testproxy): it hands inbound connections to the
// app on 127.0.0.1 and logs "proxy inbound" and "-> <original destination>".
var TestProxy = &Proxy{
	Name: "testproxy",
	// A name, found on the image's PATH as the runtime would.
	Command: []string{"testproxy"},
	config: `      startupProbe:
        tcpSocket: {port: 4191}
        periodSeconds: 1
        failureThreshold: 30
`,
	ref:       func(r images.Refs) string { return r.Proxy },
	inbound:   regexp.MustCompile(`proxy inbound `),
	outbound:  "-> %s",
	fromProxy: func(peer, _ netip.Addr) bool { return peer.IsLoopback() },
}

// HAProxy is HAProxy 2.6 with the HAProxy image's configuration (test/images/haproxy.cfg): it
// connects to each connection's original destination (an inbound one reaches the app on the
// pod's own address), logs "original=<destination>" when the connection ends, answers its
// start gate on /ready with the downward API's pod name and IP, and needs a writable
// /run/haproxy and an identity token, which the webhook mounts (proxy.volumes). A release
// whose webhook cannot mount them runs the image's unmounted configuration instead.
var HAProxy = func() *Proxy {
	p := *haproxyUnmounted
	p.Command = images.HAProxyCommand
	p.config += `      volumes:
      - {name: proxy-run, emptyDir: {medium: Memory}}
      - name: proxy-identity
        projected: {sources: [{serviceAccountToken: {audience: mesh.detour.test, expirationSeconds: 3600, path: token}}]}
      volumeMounts:
      - {name: proxy-run, mountPath: /run/haproxy}
      - {name: proxy-identity, mountPath: /var/run/secrets/mesh, readOnly: true}
`
	p.unmounted = haproxyUnmounted
	return &p
}()

// haproxyUnmounted is HAProxy with the image's unmounted configuration (no admin socket, no
// /identity), for a release whose webhook cannot mount volumes.
var haproxyUnmounted = &Proxy{
	Name:    "haproxy",
	Command: images.HAProxyUnmountedCommand,
	config: `      startupProbe:
        httpGet: {path: /ready, port: 4191}
        periodSeconds: 1
        failureThreshold: 30
      readinessProbe:
        httpGet: {path: /ready, port: 4191}
        periodSeconds: 5
      env:
      - {name: POD_NAME, valueFrom: {fieldRef: {fieldPath: metadata.name}}}
      - {name: POD_IP, valueFrom: {fieldRef: {fieldPath: status.podIP}}}
`,
	ref:      func(r images.Refs) string { return r.HAProxy },
	inbound:  regexp.MustCompile(`detour-haproxy inbound \S+ original=`),
	outbound: "original=%s ",
	// HAProxy connects to the app on the pod's own address (loopback is the pod's own traffic,
	// never redirected).
	fromProxy: func(peer, local netip.Addr) bool { return peer == local && !peer.IsLoopback() },
}

// proxyFromEnv is the proxy DETOUR_E2E_PROXY names (the test proxy when unset).
func proxyFromEnv() (*Proxy, error) {
	switch v := os.Getenv("DETOUR_E2E_PROXY"); v {
	case "", TestProxy.Name:
		return TestProxy, nil
	case HAProxy.Name:
		return HAProxy, nil
	default:
		return nil, fmt.Errorf("DETOUR_E2E_PROXY=%q: use %s or %s", v, TestProxy.Name, HAProxy.Name)
	}
}

// webhookConfig is the webhook configuration's proxy section for p with the images of img.
func (p *Proxy) webhookConfig(img imageSet) string {
	quoted := make([]string, len(p.Command))
	for i, c := range p.Command {
		quoted[i] = fmt.Sprintf("%q", c)
	}
	return fmt.Sprintf(`    proxy:
      image: %s
      imagePullPolicy: %s
      # Known to the webhook, so that the validator's check runs at the proxy's start
      # (validator.mode auto on this 1.37 node with containerd 2.4).
      command: [%s]
`, p.ref(img.refs), img.pull, strings.Join(quoted, ", ")) + p.config
}

// InboundLogged reports whether the proxy's log shows an inbound connection.
func (p *Proxy) InboundLogged(log string) bool { return p.inbound.MatchString(log) }

// OutboundLogged reports whether the proxy's log shows a connection it carried to its original
// destination dst (host:port).
func (p *Proxy) OutboundLogged(log, dst string) bool { return p.OutboundCount(log, dst) > 0 }

// OutboundCount counts the connections to dst in the proxy's log.
func (p *Proxy) OutboundCount(log, dst string) int {
	return strings.Count(log, fmt.Sprintf(p.outbound, dst))
}

// replyAddrs are the addresses in the workload's serve line: "... peer=<remote> local=<local>".
var replyAddrs = regexp.MustCompile(`peer=(\S+) local=(\S+)`)

// Proxied reports whether the app's reply (the workload's serve line) shows a connection the
// proxy made to it.
func (p *Proxy) Proxied(reply string) bool {
	m := replyAddrs.FindStringSubmatch(reply)
	if m == nil {
		return false
	}
	peer, err := netip.ParseAddrPort(m[1])
	if err != nil {
		return false
	}
	local, err := netip.ParseAddrPort(m[2])
	return err == nil && p.fromProxy(peer.Addr().Unmap(), local.Addr().Unmap())
}

// ForRelease is the proxy to install release r with: p, or what p runs without volumes when
// r's webhook cannot mount them (every release before proxy.volumes: v0.1.0).
func (p *Proxy) ForRelease(r *Release) *Proxy {
	if p.unmounted != nil && r != nil && r.Version == "v0.1.0" {
		return p.unmounted
	}
	return p
}

// UseProxy makes p the proxy of the pods injected from the next install of detour
// ([Env.InstallDetour]) on; the stories read the proxy's log and the app's replies through it.
func (e *Env) UseProxy(p *Proxy) { e.Proxy = p }

// ProxyImage is the image of e.Proxy as the webhook injects it now (imported, or the cluster's
// registry once a story moved to it).
func (e *Env) ProxyImage() string { return e.Proxy.ref(e.img.refs) }

// WaitProxyInjected waits until the webhook injects e.Proxy into a pod of the opted-in
// namespace ns (a dry-run create): after an install that changed the proxy, a webhook replica of
// the previous configuration may still answer while it drains.
func (e *Env) WaitProxyInjected(t testing.TB, ctx context.Context, ns string) {
	t.Helper()
	want := e.ProxyImage()
	WaitFor(t, ctx, "the webhook to inject "+e.Proxy.Name, 2*time.Minute, func() (bool, error) {
		p, err := e.Node.Client.CoreV1().Pods(ns).Create(ctx, e.Pod("dry-run", ns), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		if err != nil {
			return false, err
		}
		for _, c := range append(p.Spec.InitContainers, p.Spec.Containers...) {
			if c.Name == annotations.ProxyContainer {
				return c.Image == want, Seen("the proxy's image is %s", c.Image)
			}
		}
		return false, Seen("no proxy injected")
	})
}
