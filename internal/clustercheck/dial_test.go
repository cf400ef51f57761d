package clustercheck

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/httpstream"
	"k8s.io/apimachinery/pkg/util/httpstream/spdy"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// portForwardServer answers POST .../pods/POD/portforward as a kubelet's streaming server does
// (SPDY streams paired by requestID: an error stream and a data stream per connection), and
// connects every data stream to backend. A websocket upgrade is refused, as by an API server
// that does not tunnel, so the dialer's fallback to SPDY is exercised too.
func portForwardServer(t *testing.T, path, backend string) (*httptest.Server, func() []string) {
	var mu sync.Mutex
	var requests []string
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		mu.Lock()
		requests = append(requests, req.Method+" "+req.URL.Path)
		mu.Unlock()
		if req.URL.Path != path {
			http.NotFound(w, req)
			return
		}
		if _, err := httpstream.Handshake(req, w, []string{"portforward.k8s.io"}); err != nil {
			return
		}
		streams := make(chan httpstream.Stream, 4)
		conn := spdy.NewResponseUpgrader().UpgradeResponse(w, req, func(s httpstream.Stream, _ <-chan struct{}) error {
			streams <- s
			return nil
		})
		if conn == nil {
			return
		}
		defer conn.Close()
		for {
			select {
			case <-conn.CloseChan():
				return
			case s := <-streams:
				if s.Headers().Get(corev1.StreamType) != corev1.StreamTypeData {
					continue // the error stream: nothing to report
				}
				go func() {
					defer s.Close()
					c, err := net.Dial("tcp", backend)
					if err != nil {
						return
					}
					defer c.Close()
					go io.Copy(c, s)
					io.Copy(s, c)
				}()
			}
		}
	}))
	t.Cleanup(srv.Close)
	return srv, func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(requests)
	}
}

// PortForward reaches the pod through the API server and the check sees the certificate the
// pod serves.
func TestPortForwardDialer(t *testing.T) {
	ca := newCA(t, "detour webhook CA")
	backend := tlsServer(t, ca.serving(t, 365*24*time.Hour, serviceName))
	srv, requests := portForwardServer(t, "/api/v1/namespaces/"+ns+"/pods/detour-webhook-x1/portforward", backend)
	cfg := &rest.Config{Host: srv.URL, TLSClientConfig: rest.TLSClientConfig{Insecure: true}}
	client := kubernetes.NewForConfigOrDie(cfg)
	c := New(client, WithDialer(PortForward(cfg, client)))
	ref := &webhookRef{namespace: ns, service: WebhookService, port: 443}
	ref.roots, _ = parseBundle(ca.pem)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res := c.checkWebhookCertificate(ctx, ref, []Endpoint{{Namespace: ns, Pod: "detour-webhook-x1", Address: "10.244.0.10", Port: 9443}})
	if res.Status != OK {
		t.Fatalf("through a port-forward: %s %s", res.Status, res.Message)
	}
	pf := "/api/v1/namespaces/" + ns + "/pods/detour-webhook-x1/portforward"
	if got := requests(); !slices.Equal(got, []string{"GET " + pf, "POST " + pf}) {
		t.Errorf("requests %v, want a websocket GET, then the SPDY POST it falls back to", got)
	}
	res = c.checkWebhookCertificate(ctx, ref, []Endpoint{{Namespace: ns, Pod: "gone", Address: "10.244.0.11", Port: 9443}})
	if res.Status != Warning {
		t.Errorf("a pod that cannot be reached: %s %s, want a warning", res.Status, res.Message)
	}
	if !strings.Contains(res.Message, "port-forward to pod detour-system/gone port 9443") || !strings.Contains(res.Fix, "pods/portforward") {
		t.Errorf("the warning %q (fix %q) should name the pod and the permission", res.Message, res.Fix)
	}
}
