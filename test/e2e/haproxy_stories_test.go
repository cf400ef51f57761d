package e2e

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/test/e2e/framework"
)

// The stories of HAProxy as the proxy (issue 43): make e2e-haproxy runs the core stories with
// it (TestE2EHAProxy, build tag haproxy); TestE2E, and so CI, runs haproxySmoke.

// haproxySmoke is CI's share of make e2e-haproxy: detour installed again with HAProxy as the
// proxy (the HAProxy image, its volumes, env and start gate), a pod whose check ran at HAProxy's
// start is captured both ways and HAProxy has what it needs; then the test proxy again, and the
// namespace goes.
func haproxySmoke(t *testing.T, ctx context.Context, e *framework.Env) {
	if e.Proxy != framework.TestProxy {
		t.Skipf("the run's proxy is %s already (make e2e-haproxy runs every story with it)", e.Proxy.Name)
	}
	// The stories after this one run with the test proxy again, whatever happens here.
	e.UseProxy(framework.HAProxy)
	t.Cleanup(func() {
		e.UseProxy(framework.TestProxy)
		e.InstallDetour(t, ctx, "")
		e.Namespace(t, ctx, "haproxy", true)
		e.WaitProxyInjected(t, ctx, "haproxy")
		e.DropNamespaces(t, ctx, "haproxy")
	})
	e.InstallDetour(t, ctx, "")
	e.Namespace(t, ctx, "haproxy", true)
	e.WaitProxyInjected(t, ctx, "haproxy")
	if _, err := e.Node.Client.CoreV1().Pods("haproxy").Create(ctx, e.Pod("web", "haproxy"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p := e.WaitReady(t, ctx, "haproxy", "name=web", 1)[0]
	if !framework.ChecksAtProxyStart(&p) || p.Spec.InitContainers[0].Image != e.ProxyImage() {
		t.Errorf("first init container %s (image %s), detour.dev/validator %q: want HAProxy with the check at its start",
			p.Spec.InitContainers[0].Name, p.Spec.InitContainers[0].Image, p.Annotations[annotations.Validator])
	}
	e.AssertCaptured(t, ctx, p, "web")
	haproxyHasWhatItNeeds(t, ctx, e, "haproxy", "web")
}

// haproxyHasWhatItNeeds: the pod ns/name runs HAProxy with what it needs from the webhook — its
// admin frontend answers /ready with the pod's name and IP from the downward API, /identity with
// the projected token (for the audience the configuration names, of the pod's service account),
// and /metrics with HAProxy's Prometheus exporter.
func haproxyHasWhatItNeeds(t *testing.T, ctx context.Context, e *framework.Env, ns, name string) {
	p, err := e.Node.Client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, v := range p.Spec.Volumes {
		names = append(names, v.Name)
	}
	for _, want := range []string{"proxy-run", "proxy-identity", annotations.ValidatorVolume} {
		if !slices.Contains(names, want) {
			t.Errorf("pod volumes %v lack %s", names, want)
		}
	}
	admin := fmt.Sprintf("%s:4191", p.Status.PodIP)
	get := func(path string) string {
		t.Helper()
		conn, err := e.Node.Dial(ctx, "tcp", admin)
		if err != nil {
			t.Fatalf("dial HAProxy's admin frontend %s: %v", admin, err)
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(5 * time.Second))
		fmt.Fprintf(conn, "GET %s HTTP/1.0\r\n\r\n", path)
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatalf("GET %s%s: %v", admin, path, err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %s%s: %s %s", admin, path, resp.Status, body)
		}
		return string(body)
	}
	if got, want := get("/ready"), fmt.Sprintf("ready %s %s\n", name, p.Status.PodIP); got != want {
		t.Errorf("/ready = %q, want %q (POD_NAME and POD_IP from the downward API)", got, want)
	}
	token := strings.TrimSpace(get("/identity"))
	parts := strings.Split(token, ".")
	if len(parts) != 3 {
		t.Fatalf("/identity = %q, want a JWT", token)
	}
	payload, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		t.Fatal(err)
	}
	var claims struct {
		Aud []string `json:"aud"`
		Sub string   `json:"sub"`
	}
	if err := json.Unmarshal(payload, &claims); err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(claims.Aud, "mesh.detour.test") || claims.Sub != "system:serviceaccount:"+ns+":default" {
		t.Errorf("the proxy's token: audiences %q, subject %q; want mesh.detour.test and the pod's service account", claims.Aud, claims.Sub)
	}
	if m := get("/metrics"); !strings.Contains(m, "haproxy_process_") {
		t.Errorf("/metrics has no haproxy_process_ series:\n%s", framework.Tail(m, 10))
	}
}

// haproxyEndsOnSIGTERM: a meshed pod with a long grace period is gone within seconds of its
// deletion: HAProxy, a native sidecar the kubelet stops after the app, ends on SIGTERM instead
// of holding the pod until the grace period's SIGKILL.
func haproxyEndsOnSIGTERM(t *testing.T, ctx context.Context, e *framework.Env) {
	const grace = 60
	pod := e.Pod("graceful", "fold")
	pod.Spec.TerminationGracePeriodSeconds = ptr.To[int64](grace)
	if _, err := e.Node.Client.CoreV1().Pods("fold").Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p := e.WaitReady(t, ctx, "fold", "name=graceful", 1)[0]
	for _, c := range p.Status.InitContainerStatuses {
		if c.Name == annotations.ProxyContainer && c.RestartCount != 0 {
			t.Errorf("the proxy restarted %d times: %+v", c.RestartCount, c)
		}
	}
	start := time.Now()
	if err := e.Node.Client.CoreV1().Pods("fold").Delete(ctx, "graceful", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	framework.WaitFor(t, ctx, "the pod to be gone", 2*time.Minute, func() (bool, error) {
		_, err := e.Node.Client.CoreV1().Pods("fold").Get(ctx, "graceful", metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		return false, framework.Seen("still there after %s (%v)", time.Since(start).Round(time.Second), err)
	})
	if took := time.Since(start); took > 20*time.Second {
		t.Errorf("the pod took %s to go with a grace period of %ds: its proxy did not end on SIGTERM", took.Round(time.Second), grace)
	} else {
		t.Logf("the pod was gone %s after its deletion (grace period %ds)", took.Round(100*time.Millisecond), grace)
	}
}
