// The plugin's own token (--plugin-service-account) through every part of the agent it
// touches: the flags, the reconcile, the run loop's timer and /readyz. One fixture, a settable
// clock and a fake TokenRequest API, serves them all, so the file stays whole past 400 lines.

package nodeagent_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/nodeagent"
)

// clock is a settable clock for the agent.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func newClock() *clock { return &clock{now: time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)} }

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// tokenAPI answers the fake clientset's TokenRequests the way the API server does: a new token
// each time, expiring expirationSeconds after the clock's now — or with err, when set.
type tokenAPI struct {
	mu       sync.Mutex
	clock    func() time.Time
	err      error
	requests []*authenticationv1.TokenRequest // every request, failed ones too
	names    []string                         // namespace/name of each
	issued   int
}

func (api *tokenAPI) install(client *fake.Clientset) {
	client.PrependReactor("create", "serviceaccounts", func(action k8stesting.Action) (bool, runtime.Object, error) {
		if action.GetSubresource() != "token" {
			return false, nil, nil
		}
		create := action.(k8stesting.CreateActionImpl)
		tr := create.GetObject().(*authenticationv1.TokenRequest).DeepCopy()
		api.mu.Lock()
		defer api.mu.Unlock()
		api.requests = append(api.requests, tr)
		api.names = append(api.names, action.GetNamespace()+"/"+create.Name)
		if api.err != nil {
			return true, nil, api.err
		}
		api.issued++
		tr.Status = authenticationv1.TokenRequestStatus{
			Token:               fmt.Sprintf("plugin-token-%d", api.issued),
			ExpirationTimestamp: metav1.NewTime(api.clock().Add(time.Duration(*tr.Spec.ExpirationSeconds) * time.Second)),
		}
		return true, tr, nil
	})
}

func (api *tokenAPI) calls() int {
	api.mu.Lock()
	defer api.mu.Unlock()
	return len(api.requests)
}

func (api *tokenAPI) fail(err error) {
	api.mu.Lock()
	api.err = err
	api.mu.Unlock()
}

var errForbidden = apierrors.NewForbidden(schema.GroupResource{Resource: "serviceaccounts/token"}, "detour-cni",
	errors.New(`User "system:serviceaccount:detour-system:detour-node" cannot create resource "serviceaccounts/token"`))

// pluginSAEnv is an env whose agent requests the plugin's token for detour-system/detour-cni
// (the namespace read from the service-account directory).
func pluginSAEnv(t *testing.T) *env {
	t.Helper()
	e := newEnv(t)
	writeFile(t, filepath.Join(e.saDir, "namespace"), "detour-system\n")
	e.flags.PluginServiceAccount = "detour-cni"
	return e
}

func readyz(t *testing.T, a *nodeagent.Agent) (int, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	a.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/readyz", nil))
	return rec.Code, rec.Body.String()
}

// The plugin's token is requested for its own service account, written where its kubeconfig
// points, renewed at 80% of its lifetime, kept while renewals fail and it is still valid, and
// the agent is not ready once it expired — while the entry stays in place.
func TestPluginTokenLifecycle(t *testing.T) {
	clk := newClock()
	client := fake.NewClientset(&corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: "node-1"},
		Spec:       corev1.NodeSpec{Taints: []corev1.Taint{{Key: annotations.CNINotReadyTaint, Value: "true", Effect: corev1.TaintEffectNoSchedule}}},
	})
	api := &tokenAPI{clock: clk.Now}
	api.install(client)
	e := pluginSAEnv(t)
	e.flags.NodeName = "node-1"
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	a := e.agent(t, nodeagent.WithNodeClient(client), nodeagent.WithClock(clk.Now))
	ctx := context.Background()
	tokenFile := filepath.Join(e.confDir, "detour-cni.token")

	s, err := a.Reconcile(ctx)
	if err != nil || !s.ConfigInPlace || !s.NodeReady {
		t.Fatalf("Reconcile = %+v, %v", s, err)
	}
	if got := readFile(t, tokenFile); got != "plugin-token-1" {
		t.Errorf("token file holds %q, want the requested token (not the agent's token-1)", got)
	}
	if st, _ := os.Stat(tokenFile); st.Mode().Perm() != 0o600 {
		t.Errorf("token file mode %v", st.Mode().Perm())
	}
	kc, err := clientcmd.LoadFromFile(filepath.Join(e.confDir, "detour-cni.kubeconfig"))
	if err != nil || kc.AuthInfos["detour-cni"].TokenFile != tokenFile {
		t.Fatalf("kubeconfig %+v, %v", kc, err)
	}
	req := api.requests[0]
	if api.names[0] != "detour-system/detour-cni" || *req.Spec.ExpirationSeconds != 3600 || len(req.Spec.Audiences) != 0 || req.Spec.BoundObjectRef != nil {
		t.Errorf("TokenRequest for %s: %+v; want detour-system/detour-cni, 3600s, the API audience", api.names[0], req.Spec)
	}
	if want := clk.Now().Add(time.Hour); !s.PluginTokenExpires.Equal(want) {
		t.Errorf("PluginTokenExpires %v, want %v", s.PluginTokenExpires, want)
	}
	if code, body := readyz(t, a); code != 200 || !strings.Contains(body, "detour-system/detour-cni is valid until") {
		t.Errorf("/readyz = %d %q", code, body)
	}

	// Before 80% of the hour: the same token, no request.
	clk.Advance(47 * time.Minute)
	if _, err := a.Reconcile(ctx); err != nil || api.calls() != 1 {
		t.Fatalf("Reconcile at 47m: %v, %d requests", err, api.calls())
	}
	// At 80%: a new token replaces the old.
	clk.Advance(time.Minute)
	if _, err := a.Reconcile(ctx); err != nil || api.calls() != 2 || readFile(t, tokenFile) != "plugin-token-2" {
		t.Fatalf("Reconcile at 48m: %v, %d requests, token %q", err, api.calls(), readFile(t, tokenFile))
	}

	// Renewals fail (RBAC removed): the valid token stays in use, retried with backoff.
	api.fail(errForbidden)
	clk.Advance(48 * time.Minute) // 80% of the second token's hour
	if s, err := a.Reconcile(ctx); err != nil || !s.ConfigInPlace || api.calls() != 3 {
		t.Fatalf("failed renewal with a valid token: %+v, %v, %d requests", s, err, api.calls())
	}
	if ok, _ := a.Ready(); !ok || readFile(t, tokenFile) != "plugin-token-2" {
		t.Errorf("a failed renewal made the agent not ready or changed the token")
	}
	if _, err := a.Reconcile(ctx); err != nil || api.calls() != 3 {
		t.Errorf("a reconcile during the backoff requested a token: %v, %d requests", err, api.calls())
	}
	for _, wait := range []time.Duration{time.Second, 2 * time.Second, 4 * time.Second} {
		clk.Advance(wait)
		calls := api.calls()
		a.Reconcile(ctx)
		if api.calls() != calls+1 {
			t.Errorf("no retry after %s", wait)
		}
	}

	// Still failing when the token expires: not ready, says why, the entry kept in place even
	// when the primary drops it.
	clk.Advance(12 * time.Minute)
	if ok, reason := a.Ready(); ok || !strings.Contains(reason, "expired") {
		t.Errorf("Ready at expiry = %v %q", ok, reason)
	}
	writeAtomic(t, primary, calico)
	s, err = a.Reconcile(ctx)
	for _, want := range []string{"the plugin's token for service account detour-system/detour-cni expired at", "could not be renewed",
		"forbidden", "create on serviceaccounts/token in namespace detour-system with resourceNames [detour-cni]"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Reconcile after expiry: %v; want it to contain %q", err, want)
		}
	}
	if code, body := readyz(t, a); code != http.StatusServiceUnavailable || !strings.Contains(body, "could not be renewed") {
		t.Errorf("/readyz after expiry = %d %q", code, body)
	}
	if types := pluginTypes(t, readFile(t, primary)); !slices.Equal(types, []string{"calico", "portmap", "detour-cni"}) {
		t.Errorf("entry not kept in place while the token is expired: %v", types)
	}

	// The permission is back: the next retry gets a token and the agent is ready again.
	api.fail(nil)
	clk.Advance(time.Minute)
	if s, err := a.Reconcile(ctx); err != nil || !s.ConfigInPlace || !s.NodeReady || readFile(t, tokenFile) != "plugin-token-3" {
		t.Fatalf("after recovery: %+v, %v, token %q", s, err, readFile(t, tokenFile))
	}
	if ok, _ := a.Ready(); !ok {
		t.Error("not ready after recovery")
	}
}

// Without the permission to request the plugin's token, the agent writes no kubeconfig or
// token and never marks the node, and says what RBAC it needs; the entry goes in place all the
// same (issue 15.5: it never waits for the API — pods whose annotations come from the runtime
// need no token, the others fail closed and are retried).
func TestPluginTokenForbidden(t *testing.T) {
	clk := newClock()
	client := fake.NewClientset(&corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: "node-1"},
		Spec:       corev1.NodeSpec{Taints: []corev1.Taint{{Key: annotations.CNINotReadyTaint, Value: "true", Effect: corev1.TaintEffectNoSchedule}}},
	})
	api := &tokenAPI{clock: clk.Now, err: errForbidden}
	api.install(client)
	e := pluginSAEnv(t)
	e.flags.NodeName = "node-1"
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	a := e.agent(t, nodeagent.WithNodeClient(client), nodeagent.WithClock(clk.Now))

	for range 3 {
		_, err := a.Reconcile(context.Background())
		if err == nil || !strings.Contains(err.Error(), "request a token for service account detour-system/detour-cni") ||
			!strings.Contains(err.Error(), "resourceNames [detour-cni]") || !strings.Contains(err.Error(), "retrying in") {
			t.Errorf("Reconcile = %v", err)
		}
		clk.Advance(time.Minute)
	}
	for _, f := range []string{"detour-cni.token", "detour-cni.kubeconfig"} {
		if _, err := os.Stat(filepath.Join(e.confDir, f)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s written without the plugin's token: %v", f, err)
		}
	}
	if types := pluginTypes(t, readFile(t, primary)); !slices.Equal(types, []string{"calico", "portmap", "detour-cni"}) {
		t.Errorf("plugins %v: the entry must not wait for the plugin's token", types)
	}
	for _, act := range client.Actions() {
		if act.GetResource().Resource == "nodes" && act.GetVerb() != "get" {
			t.Errorf("the node was changed without the plugin's token: %v", act)
		}
	}
	node, _ := client.CoreV1().Nodes().Get(context.Background(), "node-1", metav1.GetOptions{})
	if len(node.Spec.Taints) != 1 {
		t.Errorf("taints %v: the startup taint stays until the token is written", node.Spec.Taints)
	}
	if code, body := readyz(t, a); code != http.StatusServiceUnavailable || !strings.Contains(body, "serviceaccounts/token") {
		t.Errorf("/readyz = %d %q", code, body)
	}
}

// Run renews the token on its own schedule (here at 0.1% of a 10-minute token, 600ms), without
// file events or resyncs.
func TestRunRenewsPluginToken(t *testing.T) {
	client := fake.NewClientset()
	api := &tokenAPI{clock: time.Now}
	api.install(client)
	e := pluginSAEnv(t)
	e.flags.PluginTokenTTL = 10 * time.Minute
	e.flags.Resync = time.Hour
	writeFile(t, filepath.Join(e.confDir, "10-calico.conflist"), calico)
	a := e.agent(t, nodeagent.WithNodeClient(client), nodeagent.WithTokenRefreshFraction(0.001))
	run(t, a)
	tokenFile := filepath.Join(e.confDir, "detour-cni.token")
	eventually(t, "the first token is written", func() bool { b, _ := os.ReadFile(tokenFile); return string(b) == "plugin-token-1" })
	eventually(t, "the token is renewed twice", func() bool { b, _ := os.ReadFile(tokenFile); return string(b) == "plugin-token-3" })
	if ok, _ := a.Ready(); !ok {
		t.Error("not ready with a renewed token")
	}
	if *api.requests[0].Spec.ExpirationSeconds != 600 {
		t.Errorf("expirationSeconds %d, want 600", *api.requests[0].Spec.ExpirationSeconds)
	}
}

// Without --plugin-service-account the plugin keeps getting a copy of the agent's token and
// no token is requested.
func TestPluginTokenCopyWithoutServiceAccount(t *testing.T) {
	client := fake.NewClientset()
	api := &tokenAPI{clock: time.Now}
	api.install(client)
	e := newEnv(t)
	writeFile(t, filepath.Join(e.confDir, "10-calico.conflist"), calico)
	a := e.agent(t, nodeagent.WithNodeClient(client))
	if s, err := a.Reconcile(context.Background()); err != nil || !s.ConfigInPlace || !s.PluginTokenExpires.IsZero() {
		t.Fatalf("Reconcile = %+v, %v", s, err)
	}
	if got := readFile(t, filepath.Join(e.confDir, "detour-cni.token")); got != "token-1" || api.calls() != 0 {
		t.Errorf("token %q, %d token requests", got, api.calls())
	}
}

func TestPluginServiceAccountFlags(t *testing.T) {
	e := pluginSAEnv(t)
	cfg, err := e.flags.Parse()
	if err != nil || cfg.PluginServiceAccount != "detour-cni" || cfg.PluginServiceAccountNamespace != "detour-system" || cfg.PluginTokenTTL != time.Hour {
		t.Fatalf("Parse = %+v, %v", cfg, err)
	}
	f := e.flags
	f.PluginServiceAccountNamespace, f.PluginTokenTTL = "cni", 10*time.Minute
	if cfg, err := f.Parse(); err != nil || cfg.PluginServiceAccountNamespace != "cni" || cfg.PluginTokenTTL != 10*time.Minute {
		t.Errorf("Parse with a namespace and the minimum TTL = %+v, %v", cfg, err)
	}
	for _, tc := range []struct {
		modify func(*nodeagent.Flags)
		want   string
	}{
		{func(f *nodeagent.Flags) { f.PluginServiceAccount = "Detour_CNI" }, `invalid --plugin-service-account "Detour_CNI"`},
		{func(f *nodeagent.Flags) { f.PluginServiceAccountNamespace = "a.b" }, `invalid --plugin-service-account-namespace "a.b"`},
		{func(f *nodeagent.Flags) { f.PluginTokenTTL = 9 * time.Minute }, `invalid --plugin-token-ttl "9m0s": it must be from 10m0s`},
		{func(f *nodeagent.Flags) { f.PluginTokenTTL = 25 * time.Hour }, `invalid --plugin-token-ttl "25h0m0s"`},
		{func(f *nodeagent.Flags) { f.PluginServiceAccount = ""; f.PluginServiceAccountNamespace = "cni" }, "only applies with --plugin-service-account"},
	} {
		f := e.flags
		tc.modify(&f)
		if _, err := f.Parse(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Parse error %v, want one containing %q", err, tc.want)
		}
	}
	f = e.flags
	f.ServiceAccountDir = t.TempDir()
	if _, err := f.Parse(); err == nil || !strings.Contains(err.Error(), "set --plugin-service-account-namespace") {
		t.Errorf("no namespace file: %v", err)
	}
}

// A token due for refresh while the reconcile cannot reach it (the primary is gone) does not
// make Run spin: it waits for the next event or resync.
func TestRunTokenDueWithoutPrimaryDoesNotSpin(t *testing.T) {
	client := fake.NewClientset()
	api := &tokenAPI{clock: time.Now}
	api.install(client)
	e := pluginSAEnv(t)
	e.flags.PluginTokenTTL = 10 * time.Minute
	e.flags.Resync = time.Hour
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	var mu sync.Mutex
	calls := 0
	now := func() time.Time { mu.Lock(); calls++; mu.Unlock(); return time.Now() }
	// The token is due after 600ms.
	a := e.agent(t, nodeagent.WithNodeClient(client), nodeagent.WithTokenRefreshFraction(0.001), nodeagent.WithClock(now))
	run(t, a)
	eventually(t, "the agent is ready", func() bool { ok, _ := a.Ready(); return ok })
	// The token was requested before the agent was ready: it is due by 600ms from now.
	due := time.Now().Add(time.Second)
	os.Remove(primary)
	eventually(t, "the agent sees the primary gone", func() bool { _, r := a.Ready(); return strings.Contains(r, "waiting for the primary") })
	mu.Lock()
	before := calls
	mu.Unlock()
	// Once the token is due, a file event makes the agent look again; the pass it finishes then
	// began past the refresh time, where a spinning agent would have started to spin.
	eventually(t, "the token is due", func() bool { return time.Now().After(due) })
	passes := nodeagent.Passes(a)
	writeFile(t, filepath.Join(e.binDir, "unrelated"), "a file event")
	eventually(t, "the agent has looked again", func() bool { return nodeagent.Passes(a) > passes })
	mu.Lock()
	defer mu.Unlock()
	if calls-before > 50 {
		t.Errorf("the agent read its clock %d times past the refresh time without a primary: it spins", calls-before)
	}
	if api.calls() != 1 {
		t.Errorf("%d token requests without a primary, want only the first", api.calls())
	}
}

// The primary CNI rewriting its file while the agent waits for the plugin's token is never
// undone: the agent does not write back the copy it read before, and adds its entry to the new
// file on the next pass.
func TestReconcileKeepsAPrimaryRewriteDuringTheTokenRequest(t *testing.T) {
	clk := newClock()
	client := fake.NewClientset()
	e := pluginSAEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	rewritten := strings.Replace(calico, `"datastore_type": "kubernetes"`, `"datastore_type": "kubernetes", "mtu": 1400`, 1)
	if rewritten == calico {
		t.Fatal("the test's rewrite changes nothing")
	}
	api := &tokenAPI{clock: clk.Now}
	api.install(client)
	client.PrependReactor("create", "serviceaccounts", func(k8stesting.Action) (bool, runtime.Object, error) {
		writeFile(t, primary, rewritten) // the primary CNI, while the request is in flight
		return false, nil, nil
	})
	a := e.agent(t, nodeagent.WithNodeClient(client), nodeagent.WithClock(clk.Now))

	if _, err := a.Reconcile(context.Background()); err == nil || !strings.Contains(err.Error(), "changed while detour's entry was being prepared") {
		t.Fatalf("Reconcile while the primary rewrites its file = %v", err)
	}
	if got := readFile(t, primary); got != rewritten {
		t.Fatalf("the primary's rewrite was overwritten:\n%s", got)
	}
	if s, err := a.Reconcile(context.Background()); err != nil || !s.ConfigInPlace {
		t.Fatalf("second Reconcile = %+v, %v", s, err)
	}
	got := readFile(t, primary)
	if !strings.Contains(got, `"mtu": 1400`) || !slices.Equal(pluginTypes(t, got), []string{"calico", "portmap", "detour-cni"}) {
		t.Errorf("the entry must be added to the rewritten file:\n%s", got)
	}
}

// Issue 15.5: after a reboot the primary writes its file first, and the API server is not
// reachable yet (kube-proxy is not up). The restarted agent puts its entry back at once: the
// kubeconfig and token the previous agent wrote stay and keep working; it is not ready, and the
// node keeps its label, until the token can be requested.
func TestRestartedAgentRestoresEntryWithoutTheAPI(t *testing.T) {
	clk := newClock()
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}})
	api := &tokenAPI{clock: clk.Now}
	api.install(client)
	e := pluginSAEnv(t)
	e.flags.NodeName = "node-1"
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	if s, err := e.agent(t, nodeagent.WithNodeClient(client), nodeagent.WithClock(clk.Now)).Reconcile(context.Background()); err != nil || !s.NodeReady {
		t.Fatalf("first agent: %+v, %v", s, err)
	}
	token := readFile(t, filepath.Join(e.confDir, "detour-cni.token"))
	kubeconfig := readFile(t, filepath.Join(e.confDir, "detour-cni.kubeconfig"))

	// The reboot: the primary's file without the entry, a new agent, no API server.
	writeFile(t, primary, calico)
	api.fail(errors.New("dial tcp 10.96.0.1:443: connect: connection refused"))
	clk.Advance(time.Minute)
	a := e.agent(t, nodeagent.WithNodeClient(client), nodeagent.WithClock(clk.Now))
	s, err := a.Reconcile(context.Background())
	if err == nil || !strings.Contains(err.Error(), "connection refused") || s.ConfigInPlace || !s.EntryInPlace {
		t.Fatalf("restarted agent without the API: %+v, %v; want the entry in place, not ready", s, err)
	}
	if types := pluginTypes(t, readFile(t, primary)); !slices.Equal(types, []string{"calico", "portmap", "detour-cni"}) {
		t.Errorf("plugins %v: the entry waited for the API", types)
	}
	if readFile(t, filepath.Join(e.confDir, "detour-cni.token")) != token || readFile(t, filepath.Join(e.confDir, "detour-cni.kubeconfig")) != kubeconfig {
		t.Error("the previous agent's token or kubeconfig was changed")
	}
	if code, _ := readyz(t, a); code != http.StatusServiceUnavailable {
		t.Errorf("/readyz = %d, want 503 until the token is requested", code)
	}
	node, _ := client.CoreV1().Nodes().Get(context.Background(), "node-1", metav1.GetOptions{})
	if node.Labels[annotations.CNIReadyLabel] != "true" {
		t.Errorf("labels %v: with the entry in place the label stays", node.Labels)
	}
	// The API comes back: ready.
	api.fail(nil)
	clk.Advance(time.Minute)
	if s, err := a.Reconcile(context.Background()); err != nil || !s.ConfigInPlace || !s.NodeReady {
		t.Fatalf("API back: %+v, %v", s, err)
	}
}
