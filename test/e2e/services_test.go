package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/test/e2e/framework"
)

// servicesAndDNS: a Service in front of an injected server answers, by its DNS names and its
// ClusterIP, an injected client (its proxy carries the connection to the ClusterIP, which
// kube-proxy translates after the pod), an uninjected client of another namespace, and a
// process of the node itself — the cluster's kube-proxy (nftables mode) and CoreDNS, as on a
// real cluster, with detour in the path.
func servicesAndDNS(t *testing.T, ctx context.Context, e *framework.Env) {
	if mode := kubeProxyMode(ctx, e.Node); mode != "nftables" {
		t.Errorf("kube-proxy's /proxyMode says %q, want nftables", mode)
	}
	e.Namespace(t, ctx, "svc", true)
	e.Namespace(t, ctx, "svc-plain", false)
	defer e.DropNamespaces(t, ctx, "svc", "svc-plain")
	if _, err := e.Node.Client.CoreV1().Pods("svc").Create(ctx, e.Pod("web", "svc"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	svc, err := e.Node.Client.CoreV1().Services("svc").Create(ctx, &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Namespace: "svc"},
		Spec: corev1.ServiceSpec{
			Selector: map[string]string{"name": "web"},
			Ports:    []corev1.ServicePort{{Port: 80, TargetPort: intstr.FromInt32(8080)}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	clusterIP := svc.Spec.ClusterIP + ":80"
	web := e.WaitReady(t, ctx, "svc", "name=web", 1)[0]
	if !annotations.IsInjected(web.Annotations) {
		t.Fatalf("the server was not injected: %v", web.Annotations)
	}
	// Each client dials every address it is given, then serves: it is Ready only once every
	// dial got the server's line (a failed dial exits, and the kubelet restarts it).
	clients := []struct{ name, ns string }{{"client", "svc"}, {"client", "svc-plain"}}
	addrs := map[string][]string{
		"svc":       {"web:80", "web.svc.svc.cluster.local:80", clusterIP},
		"svc-plain": {"web.svc:80", clusterIP},
	}
	for _, c := range clients {
		p := e.Pod(c.name, c.ns)
		var args []string
		for _, a := range addrs[c.ns] {
			args = append(args, "dial", "-must", "-retry", "60s", "-addr", a, "then")
		}
		p.Spec.Containers[0].Args = append(args, "serve", "-listen", ":8080")
		if _, err := e.Node.Client.CoreV1().Pods(c.ns).Create(ctx, p, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range clients {
		p := e.WaitReady(t, ctx, c.ns, "name="+c.name, 1)[0]
		log := e.Logs(ctx, c.ns, p.Name, "app")
		for _, a := range addrs[c.ns] {
			if !strings.Contains(log, fmt.Sprintf("dial %s ok: web", a)) {
				t.Errorf("client %s/%s did not reach the Service at %s:\n%s", c.ns, p.Name, a, log)
			}
		}
		injected := annotations.IsInjected(p.Annotations)
		if injected != (c.ns == "svc") {
			t.Errorf("client %s/%s injected=%v, want %v", c.ns, p.Name, injected, c.ns == "svc")
		}
		if injected {
			// The proxy saw the ClusterIP as the original destination of each connection,
			// the names included: kube-proxy's translation comes after the pod.
			if proxyLog := e.LogsAll(ctx, c.ns, p.Name, "detour-proxy"); strings.Count(proxyLog, "-> "+clusterIP) < len(addrs[c.ns]) {
				t.Errorf("the client's proxy did not carry its %d connections to %s:\n%s\n%s", len(addrs[c.ns]), clusterIP, proxyLog, e.Describe(ctx, c.ns))
			}
		}
	}
	// The server's app saw every connection come through its proxy.
	if proxyLog := e.LogsAll(ctx, "svc", web.Name, "detour-proxy"); strings.Count(proxyLog, "proxy inbound") < len(addrs["svc"])+len(addrs["svc-plain"]) {
		t.Errorf("the server's proxy logged fewer inbound connections than the clients made:\n%s\n%s", proxyLog, e.Describe(ctx, "svc"))
	}
	// A process of the node (host network) reaches the ClusterIP through kube-proxy's output hook.
	if greeting, err := e.Node.Greeting(ctx, clusterIP); err != nil || !strings.HasPrefix(greeting, "web") {
		t.Errorf("the node's own connection to %s: %q, %v", clusterIP, greeting, err)
	}
}

// kubeProxyMode is what node's kube-proxy says its mode is (its metrics server's /proxyMode).
func kubeProxyMode(ctx context.Context, n *framework.Node) string {
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: n.Dial}}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://127.0.0.1:10249/proxyMode", nil)
	if err != nil {
		return err.Error()
	}
	resp, err := client.Do(req)
	if err != nil {
		return err.Error()
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return strings.TrimSpace(string(body))
}
