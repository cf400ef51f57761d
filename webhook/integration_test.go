package webhook_test

import (
	"bytes"
	"cmp"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/yaml"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/inject"
	"github.com/detourmesh/detour/internal/cli"
	"github.com/detourmesh/detour/iptables"
	"github.com/detourmesh/detour/test/testenv"
	"github.com/detourmesh/detour/webhook"
)

// warnings collects the admission warnings the API server returns to a client.
type warnings struct {
	mu  sync.Mutex
	all []string
}

func (w *warnings) HandleWarningHeader(_ int, _ string, text string) {
	w.mu.Lock()
	w.all = append(w.all, text)
	w.mu.Unlock()
}

func (w *warnings) take() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	all := w.all
	w.all = nil
	return all
}

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// adderHook is a second mutating webhook that adds an init container after detour ran, as
// Vault's agent injector does, to pods labelled add-init=yes.
func adderHook(t *testing.T) *httptest.Server {
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var review admissionv1.AdmissionReview
		if err := json.NewDecoder(r.Body).Decode(&review); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		var pod corev1.Pod
		if err := json.Unmarshal(review.Request.Object.Raw, &pod); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		resp := &admissionv1.AdmissionResponse{UID: review.Request.UID, Allowed: true}
		if !slices.ContainsFunc(pod.Spec.InitContainers, func(c corev1.Container) bool { return c.Name == "vault-agent-init" }) {
			patch := []map[string]any{{"op": "add", "path": "/spec/initContainers/-", "value": map[string]any{
				"name": "vault-agent-init", "image": "vault:1.17", "securityContext": map[string]any{"runAsUser": 100},
			}}}
			if len(pod.Spec.InitContainers) == 0 {
				patch[0]["path"], patch[0]["value"] = "/spec/initContainers", []any{patch[0]["value"]}
			}
			resp.Patch, _ = json.Marshal(patch)
			pt := admissionv1.PatchTypeJSONPatch
			resp.PatchType = &pt
		}
		review.Response, review.Request = resp, nil
		_ = json.NewEncoder(w).Encode(&review)
	}))
	t.Cleanup(srv.Close)
	return srv
}

func detourWebhookConfiguration() *admissionregistrationv1.MutatingWebhookConfiguration {
	path := strings.TrimPrefix(webhook.MutatePath, "/") // envtest joins host:port and path with a slash
	return &admissionregistrationv1.MutatingWebhookConfiguration{
		TypeMeta:   metav1.TypeMeta{APIVersion: "admissionregistration.k8s.io/v1", Kind: "MutatingWebhookConfiguration"},
		ObjectMeta: metav1.ObjectMeta{Name: "detour"},
		Webhooks: []admissionregistrationv1.MutatingWebhook{{
			Name:                    "inject.detour.dev",
			ClientConfig:            admissionregistrationv1.WebhookClientConfig{Service: &admissionregistrationv1.ServiceReference{Name: "detour-webhook", Namespace: "detour-system", Path: &path}},
			Rules:                   []admissionregistrationv1.RuleWithOperations{podCreate()},
			SideEffects:             ptr(admissionregistrationv1.SideEffectClassNone),
			AdmissionReviewVersions: []string{"v1"},
			ReinvocationPolicy:      ptr(admissionregistrationv1.IfNeededReinvocationPolicy),
			FailurePolicy:           ptr(admissionregistrationv1.Fail),
			TimeoutSeconds:          ptr(int32(10)),
		}},
	}
}

func podCreate() admissionregistrationv1.RuleWithOperations {
	return admissionregistrationv1.RuleWithOperations{
		Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create},
		Rule:       admissionregistrationv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"pods"}},
	}
}

func ptr[T any](v T) *T { return &v }

// env is a local API server with detour's webhook registered and served.
type env struct {
	client      *kubernetes.Clientset
	warnings    *warnings
	metricsAddr string
	certDir     string
	webhookAddr string
	// logs is the webhook's log, when the environment keeps it (envOptions.keepLog).
	logs *syncBuffer
	// healthAddr serves /readyz; stop ends the webhook's context (as SIGTERM does) and done
	// receives Run's result.
	healthAddr string
	stop       func()
	done       chan error
}

// syncBuffer is a bytes.Buffer that the webhook's logger and the test share.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// envOptions change the environment startEnvWith starts: the API server's flags, and the
// identity the webhook runs as (default the API server's admin).
type envOptions struct {
	apiServerArgs map[string]string
	// identity, when set, is given RBAC by the admin client and returns the REST config the
	// webhook runs with.
	identity func(t *testing.T, admin *rest.Config) *rest.Config
	keepLog  bool
	// config, when set, replaces the test configuration.
	config string
	// shutdownDelay is the webhook's ShutdownDelay.
	shutdownDelay time.Duration
}

// startEnv starts the API server and the webhook, its configuration the test one plus extra
// (YAML lines).
func startEnv(t *testing.T, extra ...string) *env {
	return startEnvWith(t, envOptions{}, extra...)
}

// startEnvWith is startEnv with opts.
func startEnvWith(t *testing.T, opts envOptions, extra ...string) *env {
	testenv.Binary(t, "kube-apiserver")
	testenv.Binary(t, "etcd")
	e := testenv.NewEnvironment()
	for k, v := range opts.apiServerArgs {
		e.ControlPlane.GetAPIServer().Configure().Set(k, v)
	}
	e.WebhookInstallOptions = envtest.WebhookInstallOptions{
		MutatingWebhooks: []*admissionregistrationv1.MutatingWebhookConfiguration{detourWebhookConfiguration()},
	}
	restCfg, err := e.Start()
	if err != nil {
		t.Fatalf("start the local control plane: %v", err)
	}
	t.Cleanup(func() {
		if err := e.Stop(); err != nil {
			t.Logf("stop the control plane: %v", err)
		}
	})

	base := cmp.Or(opts.config, `
proxy:
  image: proxy.example/proxy:test
  startupProbe: {tcpSocket: {port: 4191}}
validator:
  image: detour:test
`)
	cfg, err := inject.ParseConfig([]byte(base + strings.Join(extra, "\n")))
	if err != nil {
		t.Fatal(err)
	}
	w := e.WebhookInstallOptions
	out := &env{metricsAddr: freeAddr(t), certDir: w.LocalServingCertDir, webhookAddr: net.JoinHostPort(w.LocalServingHost, strconv.Itoa(w.LocalServingPort))}
	healthAddr := freeAddr(t)
	logOut := io.Discard
	if os.Getenv("DETOUR_TEST_WEBHOOK_LOG") == "1" {
		logOut = os.Stderr
	}
	if opts.keepLog {
		out.logs = &syncBuffer{}
		logOut = io.MultiWriter(logOut, out.logs)
	}
	webhookCfg := restCfg
	if opts.identity != nil {
		webhookCfg = opts.identity(t, restCfg)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- webhook.Run(ctx, webhook.Options{
			Config: cfg, RESTConfig: webhookCfg,
			Host: w.LocalServingHost, Port: w.LocalServingPort, CertDir: w.LocalServingCertDir,
			MetricsAddr: out.metricsAddr, HealthAddr: healthAddr, OwnNamespace: "detour-system",
			Logger:        slog.New(slog.NewTextHandler(logOut, &slog.HandlerOptions{Level: slog.LevelDebug})),
			ShutdownDelay: opts.shutdownDelay,
		})
	}()
	out.healthAddr, out.stop, out.done = healthAddr, cancel, done
	t.Cleanup(func() {
		cancel()
		if err, ok := <-done; ok && err != nil {
			t.Errorf("webhook.Run: %v", err)
		}
	})
	deadline := time.Now().Add(60 * time.Second)
	for {
		resp, err := http.Get("http://" + healthAddr + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		select {
		case err := <-done:
			t.Fatalf("the webhook stopped before it was ready: %v", err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("the webhook is not ready after 60s (last: %v)", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if resp, err := http.Get("http://" + healthAddr + "/healthz"); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("/healthz: %v %v", resp, err)
	}

	out.warnings = &warnings{}
	clientCfg := rest.CopyConfig(restCfg)
	clientCfg.WarningHandler = out.warnings
	out.client = kubernetes.NewForConfigOrDie(clientCfg)

	// The second webhook runs after detour's (webhooks are called in name order) and makes the
	// API server invoke detour again.
	adder := adderHook(t)
	url := adder.URL + "/add"
	caBundle := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: adder.Certificate().Raw})
	_, err = out.client.AdmissionregistrationV1().MutatingWebhookConfigurations().Create(context.Background(), &admissionregistrationv1.MutatingWebhookConfiguration{
		ObjectMeta: metav1.ObjectMeta{Name: "zz-vault-like"},
		Webhooks: []admissionregistrationv1.MutatingWebhook{{
			Name:                    "add.example.com",
			ClientConfig:            admissionregistrationv1.WebhookClientConfig{URL: &url, CABundle: caBundle},
			Rules:                   []admissionregistrationv1.RuleWithOperations{podCreate()},
			ObjectSelector:          &metav1.LabelSelector{MatchLabels: map[string]string{"add-init": "yes"}},
			SideEffects:             ptr(admissionregistrationv1.SideEffectClassNone),
			AdmissionReviewVersions: []string{"v1"},
			FailurePolicy:           ptr(admissionregistrationv1.Fail),
		}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func (e *env) namespace(t *testing.T, annotations map[string]string) string {
	t.Helper()
	ns, err := e.client.CoreV1().Namespaces().Create(context.Background(), &corev1.Namespace{
		ObjectMeta: metav1.ObjectMeta{GenerateName: "webhook-", Annotations: annotations},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return ns.Name
}

func uid(u int64) *corev1.SecurityContext { return &corev1.SecurityContext{RunAsUser: &u} }

func testPod(name string, ann map[string]string, inits ...corev1.Container) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Annotations: ann},
		Spec: corev1.PodSpec{
			InitContainers: inits,
			Containers:     []corev1.Container{{Name: "app", Image: "example/app:1", SecurityContext: uid(1000)}},
		},
	}
}

func names(cs []corev1.Container) []string {
	var n []string
	for _, c := range cs {
		n = append(n, c.Name)
	}
	return n
}

func hasWarning(all []string, s string) bool {
	return slices.ContainsFunc(all, func(w string) bool { return strings.Contains(w, s) })
}

// detourRules runs `detour rules -f` on pod and returns its output for one family.
func detourRules(t *testing.T, pod *corev1.Pod, family iptables.Family) string {
	t.Helper()
	b, err := yaml.Marshal(pod)
	if err != nil {
		t.Fatal(err)
	}
	f := filepath.Join(t.TempDir(), "pod.yaml")
	if err := os.WriteFile(f, append([]byte("apiVersion: v1\nkind: Pod\n"), b...), 0o644); err != nil {
		t.Fatal(err)
	}
	root := cli.NewRoot()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetArgs([]string{"rules", "-f", f, "--family=" + family.String()})
	if err := root.Execute(); err != nil {
		t.Fatalf("detour rules: %v", err)
	}
	return out.String()
}

func TestIntegrationWebhook(t *testing.T) {
	e := startEnv(t)
	ctx := context.Background()
	shop := e.namespace(t, map[string]string{annotations.Inject: "enabled", annotations.SkipOutboundPorts: "25"})
	pods := e.client.CoreV1().Pods(shop)

	var stored *corev1.Pod
	t.Run("container mode: exemptions, warnings to the client, annotations the plugin reads", func(t *testing.T) {
		e.warnings.take()
		pod := testPod("shop", map[string]string{annotations.SidecarMode: "container"},
			corev1.Container{Name: "migrate", Image: "example/migrate:1", SecurityContext: uid(0)},
			corev1.Container{Name: "fetch", Image: "example/fetch:1", SecurityContext: uid(1001)},
			corev1.Container{Name: "setup", Image: "example/setup:1"})
		got, err := pods.Create(ctx, pod, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("create the pod: %v", err)
		}
		stored, err = pods.Get(ctx, got.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if n := names(stored.Spec.InitContainers); !slices.Equal(n, []string{annotations.ValidatorContainer, "migrate", "fetch", "setup"}) {
			t.Errorf("init containers = %v", n)
		}
		if n := names(stored.Spec.Containers); !slices.Equal(n, []string{"app", annotations.ProxyContainer}) {
			t.Errorf("containers = %v", n)
		}
		if g := stored.Spec.InitContainers[1].SecurityContext.RunAsGroup; g == nil || *g != 2600 {
			t.Errorf("migrate runAsGroup = %v, want 2600", g)
		}
		if sc := stored.Spec.InitContainers[3].SecurityContext; sc == nil || sc.RunAsGroup == nil || *sc.RunAsGroup != 2601 || sc.RunAsUser != nil {
			t.Errorf("setup (image's user) security context = %+v, want runAsGroup 2601 and no runAsUser", sc)
		}
		w := e.warnings.take()
		for _, want := range []string{
			`detour: init container "migrate" runs as root; it keeps egress through GID 2600`,
			`detour: init container "fetch" runs as UID 1001; it keeps egress as UID 1001`,
			`detour: init container "setup" runs as its image's default user; it keeps egress through GID 2601`,
		} {
			if !hasWarning(w, want) {
				t.Errorf("the client got no warning %q; got %q", want, w)
			}
		}
		r, err := annotations.ParseRedirect(stored.Annotations)
		if err != nil {
			t.Fatalf("the plugin cannot read the stored pod: %v", err)
		}
		if !slices.Equal(r.ExemptUIDs, []uint32{1001}) || !slices.Equal(r.ExemptGIDs, []uint32{2600, 2601}) ||
			annotations.FormatPorts(r.SkipOutboundPorts) != "25" || annotations.FormatPorts(r.SkipInboundPorts) != "4191" {
			t.Errorf("redirect = %+v", r)
		}
		for _, f := range []iptables.Family{iptables.IPv4, iptables.IPv6} {
			rs, err := iptables.Build(iptables.ConfigFromRedirect(r, f))
			if err != nil {
				t.Fatal(err)
			}
			if got := detourRules(t, stored, f); got != rs.Restore() {
				t.Errorf("detour rules (%s) disagrees with the plugin's ruleset:\n%s\n---\n%s", f, got, rs.Restore())
			}
			if !strings.Contains(rs.Restore(), "--gid-owner 2600") || !strings.Contains(rs.Restore(), "--uid-owner 1001") {
				t.Errorf("the %s ruleset lacks the exemptions:\n%s", f, rs.Restore())
			}
		}
	})

	t.Run("re-admitting an injected pod changes nothing", func(t *testing.T) {
		if stored == nil {
			t.Skip("no stored pod")
		}
		again := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "shop-again", Annotations: stored.Annotations, Labels: stored.Labels}, Spec: *stored.Spec.DeepCopy()}
		again.Spec.NodeName = ""
		got, err := pods.Create(ctx, again, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if !equalJSON(t, got.Spec.InitContainers, stored.Spec.InitContainers) || !equalJSON(t, got.Spec.Containers, stored.Spec.Containers) ||
			!equalJSON(t, got.Annotations, stored.Annotations) {
			t.Errorf("re-admission changed the pod:\n%v\n%v", got.Annotations, stored.Annotations)
		}
	})

	t.Run("auto mode on a 1.29+ server: native sidecar", func(t *testing.T) {
		got, err := pods.Create(ctx, testPod("native", nil, corev1.Container{Name: "fetch", Image: "example/fetch:1"}), metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if n := names(got.Spec.InitContainers); !slices.Equal(n, []string{annotations.ValidatorContainer, annotations.ProxyContainer, "fetch"}) {
			t.Fatalf("init containers = %v", n)
		}
		if rp := got.Spec.InitContainers[1].RestartPolicy; rp == nil || *rp != corev1.ContainerRestartPolicyAlways {
			t.Errorf("the proxy's restartPolicy = %v", rp)
		}
		if got.Annotations[annotations.ExemptUIDs] != "" || got.Annotations[annotations.ExemptGIDs] != "" {
			t.Errorf("native mode exempts: %v", got.Annotations)
		}
	})

	t.Run("re-invocation after another webhook added an init container", func(t *testing.T) {
		pod := testPod("reinvoked", map[string]string{annotations.SidecarMode: "container"},
			corev1.Container{Name: "migrate", Image: "example/migrate:1", SecurityContext: uid(0)})
		pod.Labels = map[string]string{"add-init": "yes"}
		got, err := pods.Create(ctx, pod, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if n := names(got.Spec.InitContainers); !slices.Equal(n, []string{annotations.ValidatorContainer, "migrate", "vault-agent-init"}) {
			t.Fatalf("init containers = %v", n)
		}
		if got.Annotations[annotations.ExemptUIDs] != "100" || got.Annotations[annotations.ExemptGIDs] != "2600" {
			t.Errorf("the added init container is not exempt: %v", got.Annotations)
		}
		if !strings.Contains(got.Annotations[annotations.InitEgressStatus], "vault-agent-init uid 100") {
			t.Errorf("status = %q", got.Annotations[annotations.InitEgressStatus])
		}
	})

	t.Run("forged webhook annotations are overwritten", func(t *testing.T) {
		got, err := pods.Create(ctx, testPod("forged", map[string]string{
			annotations.Injected: "v9", annotations.ExemptUIDs: "1000", annotations.RedirectSkipOutboundCIDRs: "0.0.0.0/0",
		}), metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := got.Annotations[annotations.ExemptUIDs]; ok || got.Annotations[annotations.RedirectSkipOutboundCIDRs] != "" || got.Annotations[annotations.Injected] == "v9" {
			t.Errorf("forged values survived: %v", got.Annotations)
		}
	})

	t.Run("a malformed annotation is denied with the fix", func(t *testing.T) {
		_, err := pods.Create(ctx, testPod("bad", map[string]string{annotations.SkipOutboundCIDRs: "10.1.0.0/8"}), metav1.CreateOptions{})
		if !apierrors.IsForbidden(err) || !strings.Contains(err.Error(), "write the network as 10.0.0.0/8") {
			t.Errorf("create = %v, want a denial that says how to write the CIDR", err)
		}
	})

	t.Run("dry run", func(t *testing.T) {
		got, err := pods.Create(ctx, testPod("dry", nil), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		if err != nil || !annotations.IsInjected(got.Annotations) {
			t.Fatalf("dry-run create = %v, %v", got.Annotations, err)
		}
		if _, err := pods.Get(ctx, "dry", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
			t.Errorf("the dry-run pod was stored: %v", err)
		}
	})

	t.Run("namespaces not opted in, and detour's own, are left alone", func(t *testing.T) {
		for _, ns := range []string{e.namespace(t, nil), "detour-system"} {
			if ns == "detour-system" {
				_, err := e.client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{
					Name: ns, Annotations: map[string]string{annotations.Inject: "enabled"}}}, metav1.CreateOptions{})
				if err != nil {
					t.Fatal(err)
				}
			}
			got, err := e.client.CoreV1().Pods(ns).Create(ctx, testPod("plain", nil), metav1.CreateOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if annotations.IsInjected(got.Annotations) || len(got.Spec.InitContainers) != 0 {
				t.Errorf("the pod in %s was injected", ns)
			}
		}
	})

	t.Run("metrics", func(t *testing.T) {
		resp, err := http.Get("http://" + e.metricsAddr + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		for _, want := range []struct {
			metric string
			min    float64
		}{
			{`detour_webhook_admissions_total{outcome="injected"}`, 6},
			{`detour_webhook_admissions_total{outcome="denied"}`, 1},
			{`detour_webhook_admissions_total{outcome="skipped"}`, 2},
			{`detour_webhook_exemptions_granted_total{via="gid"}`, 3},
			{`detour_webhook_exemptions_granted_total{via="uid"}`, 2},
			{`detour_webhook_exemptions_refused_total`, 0}, // the image's user now gets a GID
			{`detour_webhook_admission_duration_seconds_count{outcome="injected"}`, 6},
		} {
			m := regexp.MustCompile("(?m)^" + regexp.QuoteMeta(want.metric) + ` (\S+)$`).FindSubmatch(body)
			if m == nil {
				t.Errorf("/metrics has no %s", want.metric)
				continue
			}
			if v, _ := strconv.ParseFloat(string(m[1]), 64); v < want.min {
				t.Errorf("%s = %v, want at least %v", want.metric, v, want.min)
			}
		}
	})

	// Last: the API server trusts only the first certificate.
	t.Run("a rotated certificate is served without a restart", func(t *testing.T) {
		fresh := envtest.WebhookInstallOptions{LocalServingHost: "127.0.0.1"}
		if err := fresh.PrepWithoutInstalling(); err != nil {
			t.Fatal(err)
		}
		defer fresh.Cleanup()
		for _, f := range []string{"tls.key", "tls.crt"} {
			b, err := os.ReadFile(filepath.Join(fresh.LocalServingCertDir, f))
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(e.certDir, f), b, 0o600); err != nil {
				t.Fatal(err)
			}
		}
		want, _ := pem.Decode(fresh.LocalServingCAData)
		deadline := time.Now().Add(30 * time.Second)
		for {
			served, err := servedCert(e.webhookAddr)
			if err == nil && bytes.Equal(served, want.Bytes) {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("the webhook still serves the old certificate after 30s (%v)", err)
			}
			time.Sleep(200 * time.Millisecond)
		}
	})
}

func servedCert(addr string) ([]byte, error) {
	conn, err := tls.Dial("tcp", addr, &tls.Config{InsecureSkipVerify: true}) //nolint:gosec // reads the certificate only
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	certs := conn.ConnectionState().PeerCertificates
	if len(certs) == 0 {
		return nil, errors.New("no certificate")
	}
	return certs[0].Raw, nil
}

func equalJSON(t *testing.T, a, b any) bool {
	t.Helper()
	x, err1 := json.Marshal(a)
	y, err2 := json.Marshal(b)
	if err1 != nil || err2 != nil {
		t.Fatal(err1, err2)
	}
	if !bytes.Equal(x, y) {
		t.Logf("differs:\n%s\n%s", x, y)
		return false
	}
	return true
}

// With --cert-secret the webhook makes its own CA and certificate, serves it, and sets the
// caBundle of its webhook configuration.
// With defaultInject enabled the API server's pods are injected mesh-wide: every namespace
// that does not say otherwise, but the excluded ones and detour's own; namespaces and pods opt
// out with detour.dev/inject: disabled, and a pod opts back in.
func TestIntegrationWebhookMeshWide(t *testing.T) {
	e := startEnv(t, "defaultInject: enabled")
	ctx := context.Background()
	plain := e.namespace(t, nil)
	legacy := e.namespace(t, map[string]string{annotations.Inject: "disabled"})
	if _, err := e.client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "detour-system"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	hostNetwork := testPod("host", nil)
	hostNetwork.Spec.HostNetwork = true
	for _, tc := range []struct {
		ns       string
		pod      *corev1.Pod
		injected bool
	}{
		{plain, testPod("plain", nil), true},
		{plain, testPod("opted-out", map[string]string{annotations.Inject: "disabled"}), false},
		{plain, hostNetwork, false},
		{legacy, testPod("legacy", nil), false},
		{legacy, testPod("opted-in", map[string]string{annotations.Inject: "enabled"}), true},
		{"kube-public", testPod("public", nil), false}, // excludeNamespaces' default
		{"detour-system", testPod("own", nil), false},  // the webhook's own namespace
	} {
		got, err := e.client.CoreV1().Pods(tc.ns).Create(ctx, tc.pod, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("create %s/%s: %v", tc.ns, tc.pod.Name, err)
		}
		if injected := annotations.IsInjected(got.Annotations); injected != tc.injected {
			t.Errorf("pod %s/%s: injected %v, want %v (containers %v, init %v)", tc.ns, tc.pod.Name, injected, tc.injected, names(got.Spec.Containers), names(got.Spec.InitContainers))
		}
	}
}

func TestIntegrationSelfManagedCertificates(t *testing.T) {
	restCfg := testenv.ControlPlane(t)
	client := kubernetes.NewForConfigOrDie(restCfg)
	ctx := context.Background()
	ns, err := client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "detour-"}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	url := "https://detour-webhook.invalid" + webhook.MutatePath
	mwc := &admissionregistrationv1.MutatingWebhookConfiguration{
		ObjectMeta: metav1.ObjectMeta{GenerateName: "detour-selfcert-"},
		Webhooks: []admissionregistrationv1.MutatingWebhook{{
			Name: "inject.detour.dev", ClientConfig: admissionregistrationv1.WebhookClientConfig{URL: &url},
			// Matches nothing: this test only checks the caBundle.
			ObjectSelector:          &metav1.LabelSelector{MatchLabels: map[string]string{"never": "matches"}},
			Rules:                   []admissionregistrationv1.RuleWithOperations{podCreate()},
			SideEffects:             ptr(admissionregistrationv1.SideEffectClassNone),
			AdmissionReviewVersions: []string{"v1"},
		}},
	}
	if mwc, err = client.AdmissionregistrationV1().MutatingWebhookConfigurations().Create(ctx, mwc, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	cfg, err := inject.ParseConfig([]byte("proxy: {image: p}\n"))
	if err != nil {
		t.Fatal(err)
	}
	addr, health := freeAddr(t), freeAddr(t)
	host, portStr, _ := net.SplitHostPort(addr)
	port, _ := strconv.Atoi(portStr)
	certDir := filepath.Join(t.TempDir(), "tls")
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- webhook.Run(runCtx, webhook.Options{
			Config: cfg, RESTConfig: restCfg, Host: host, Port: port, CertDir: certDir,
			MetricsAddr: "0", HealthAddr: health, OwnNamespace: ns.Name,
			CertSecret: "detour-webhook-tls", ServiceName: "detour-webhook", WebhookConfiguration: mwc.Name,
		})
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("webhook.Run: %v", err)
		}
	}()
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get("http://" + health + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("not ready after 30s: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	got, err := client.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, mwc.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(got.Webhooks[0].ClientConfig.CABundle) {
		t.Fatalf("the caBundle was not set: %q", got.Webhooks[0].ClientConfig.CABundle)
	}
	conn, err := tls.Dial("tcp", addr, &tls.Config{RootCAs: pool, ServerName: "detour-webhook." + ns.Name + ".svc"})
	if err != nil {
		t.Fatalf("the served certificate does not verify against the caBundle for the service name: %v", err)
	}
	conn.Close()
	if _, err := client.CoreV1().Secrets(ns.Name).Get(ctx, "detour-webhook-tls", metav1.GetOptions{}); err != nil {
		t.Errorf("the certificate secret: %v", err)
	}
}

// What a production proxy needs (issue 43) reaches the stored pod exactly as the webhook wrote
// it: the API server's defaults on the proxy's volumes, hooks and downward-API env are the
// webhook's own, so the proxy container and its volumes equal what `detour inject` writes
// offline for the same pod, field for field, and a re-invocation has nothing to patch.
func TestIntegrationWebhookProxyVolumes(t *testing.T) {
	const kit = `
proxy:
  image: proxy.example/haproxy:test
  command: [/usr/sbin/haproxy, -W, -db, -f, /usr/local/etc/haproxy/haproxy.cfg]
  startupProbe: {httpGet: {path: /ready, port: 4191}}
  env:
  - {name: POD_NAME, valueFrom: {fieldRef: {fieldPath: metadata.name}}}
  volumes:
  - {name: proxy-config, configMap: {name: haproxy, optional: true}}
  - {name: proxy-info, downwardAPI: {items: [{path: labels, fieldRef: {fieldPath: metadata.labels}}]}}
  - name: proxy-identity
    projected: {sources: [{serviceAccountToken: {audience: mesh.example, path: token}}]}
  - {name: proxy-run, emptyDir: {}}
  volumeMounts:
  - {name: proxy-config, mountPath: /etc/haproxy}
  - {name: proxy-info, mountPath: /etc/podinfo}
  - {name: proxy-identity, mountPath: /var/run/secrets/mesh}
  - {name: proxy-run, mountPath: /run/haproxy}
  lifecycle: {preStop: {httpGet: {port: 4191}}}
validator:
  image: detour:test
  mode: init-container
sidecarMode: native
`
	e := startEnvWith(t, envOptions{config: kit})
	ctx := context.Background()
	nsAnnotations := map[string]string{annotations.Inject: "enabled"}
	ns := e.namespace(t, nsAnnotations)
	pod := testPod("kit", nil)
	pod.Spec.AutomountServiceAccountToken = ptr(false) // no kube-api-access volume in the way
	// What the ServiceAccount admission plugin, off in this API server, sets before the webhooks
	// run; a projected token needs it.
	pod.Spec.ServiceAccountName = "default"
	stored, err := e.client.CoreV1().Pods(ns).Create(ctx, pod.DeepCopy(), metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}

	cfg, err := inject.ParseConfig([]byte(kit))
	if err != nil {
		t.Fatal(err)
	}
	offline := pod.DeepCopy()
	offline.Namespace = ns
	if _, err := inject.Mutate(offline, inject.Input{NamespaceAnnotations: nsAnnotations, NativeSidecars: true, Validator: annotations.ValidatorInitContainer}, cfg); err != nil {
		t.Fatal(err)
	}
	proxy := func(p *corev1.Pod) corev1.Container {
		for _, c := range p.Spec.InitContainers {
			if c.Name == annotations.ProxyContainer {
				return c
			}
		}
		t.Fatalf("no proxy in %s", p.Name)
		return corev1.Container{}
	}
	if !equalJSON(t, proxy(stored), proxy(offline)) {
		t.Error("the stored proxy container differs from what the webhook writes (see the log above)")
	}
	if !equalJSON(t, stored.Spec.Volumes, offline.Spec.Volumes) {
		t.Error("the stored volumes differ from what the webhook writes (see the log above)")
	}
}
