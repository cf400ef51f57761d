package nodeagent_test

import (
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/containernetworking/cni/libcni"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/cniplugin"
	"github.com/detourmesh/detour/nodeagent"
	"github.com/detourmesh/detour/test/testenv"
)

// rbacFixture is a namespace on the local API server laid out as the chart lays it out: the
// plugin's service account detour-cni, allowed only to get pods, and the agent's service
// accounts, with a pod to read.
type rbacFixture struct {
	admin kubernetes.Interface
	cfg   *rest.Config
	ns    string
	pod   *corev1.Pod
}

func newRBACFixture(t *testing.T) *rbacFixture {
	t.Helper()
	cfg := testenv.ControlPlane(t)
	f := &rbacFixture{admin: kubernetes.NewForConfigOrDie(cfg), cfg: cfg, ns: randomName("detour-")}
	ctx := context.Background()
	must := func(_ any, err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(f.admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: f.ns}}, metav1.CreateOptions{}))
	t.Cleanup(func() { f.admin.CoreV1().Namespaces().Delete(context.Background(), f.ns, metav1.DeleteOptions{}) })
	// No controller-manager runs: service accounts are created by hand, "default" for the pod.
	for _, sa := range []string{"default", "detour-cni"} {
		must(f.admin.CoreV1().ServiceAccounts(f.ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{}))
	}
	f.clusterRole(t, "detour-cni", "detour-cni", rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get"}})
	pod, err := f.admin.CoreV1().Pods(f.ns).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "web", Annotations: map[string]string{"example.com/a": "b"}},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "web", Image: "web"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	f.pod = pod
	return f
}

// clusterRole creates a ClusterRole with rules, bound to the service account sa.
func (f *rbacFixture) clusterRole(t *testing.T, sa, suffix string, rules ...rbacv1.PolicyRule) {
	t.Helper()
	ctx := context.Background()
	name := f.ns + "-" + suffix
	if _, err := f.admin.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: name}, Rules: rules}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := f.admin.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: name},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: sa, Namespace: f.ns}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		f.admin.RbacV1().ClusterRoleBindings().Delete(context.Background(), name, metav1.DeleteOptions{})
		f.admin.RbacV1().ClusterRoles().Delete(context.Background(), name, metav1.DeleteOptions{})
	})
}

// tokenRule is the one rule the agent needs for the plugin's token: create on
// serviceaccounts/token, for detour-cni only (a Role in the namespace).
func (f *rbacFixture) allowTokenFor(t *testing.T, agentSA string) {
	t.Helper()
	ctx := context.Background()
	name := agentSA + "-plugin-token"
	if _, err := f.admin.RbacV1().Roles(f.ns).Create(ctx, &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Rules: []rbacv1.PolicyRule{{
			APIGroups: []string{""}, Resources: []string{"serviceaccounts/token"}, ResourceNames: []string{"detour-cni"}, Verbs: []string{"create"},
		}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := f.admin.RbacV1().RoleBindings(f.ns).Create(ctx, &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: name},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: agentSA, Namespace: f.ns}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// agentIdentity creates the agent's service account and mounts its token the way the kubelet
// does into the env's service-account directory (token, ca.crt, namespace), and points the
// agent at the local API server and the plugin at detour-cni.
func (f *rbacFixture) agentIdentity(t *testing.T, e *env, sa string) {
	t.Helper()
	ctx := context.Background()
	if _, err := f.admin.CoreV1().ServiceAccounts(f.ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	tr, err := f.admin.CoreV1().ServiceAccounts(f.ns).CreateToken(ctx, sa, &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	e.rotateToken(t, tr.Status.Token, f.cfg.CAData)
	writeFile(t, filepath.Join(e.saDir, "namespace"), f.ns)
	e.flags.APIServer = f.cfg.Host
	e.flags.PluginServiceAccount = "detour-cni"
}

// agentConfig is the agent's own API client configuration: its service-account token file, as
// rest.InClusterConfig would use it.
func agentConfig(cfg *rest.Config, saDir string) *rest.Config {
	return &rest.Config{Host: cfg.Host, TLSClientConfig: rest.TLSClientConfig{CAData: cfg.CAData}, BearerTokenFile: filepath.Join(saDir, "token")}
}

// whoami asks the API server whose token this is.
func (f *rbacFixture) whoami(t *testing.T, token string) string {
	t.Helper()
	review, err := f.admin.AuthenticationV1().TokenReviews().Create(context.Background(),
		&authenticationv1.TokenReview{Spec: authenticationv1.TokenReviewSpec{Token: token}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !review.Status.Authenticated {
		return "unauthenticated: " + review.Status.Error
	}
	return review.Status.User.Username
}

// pluginGetPod reads the fixture's pod the way detour-cni does: its configuration from the
// entry in the runtime's conflist, its API client from the kubeconfig the entry names.
func (f *rbacFixture) pluginGetPod(t *testing.T, conflist string) error {
	t.Helper()
	list, err := libcni.ConfListFromFile(conflist)
	if err != nil {
		t.Fatal(err)
	}
	last := list.Plugins[len(list.Plugins)-1]
	stdin, err := libcni.InjectConf(last, map[string]any{"name": list.Name, "cniVersion": list.CNIVersion})
	if err != nil {
		t.Fatal(err)
	}
	conf, err := cniplugin.ParseConfig(stdin.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	getter, err := cniplugin.New().NewPodGetter(conf)
	if err != nil {
		t.Fatal(err)
	}
	meta, err := getter.GetPod(context.Background(), f.ns, f.pod.Name)
	if err == nil && (meta.UID != string(f.pod.UID) || meta.Annotations["example.com/a"] != "b") {
		t.Errorf("the plugin read %+v, want pod %s", meta, f.pod.UID)
	}
	return err
}

// The plugin runs as its own service account: the agent, allowed nothing but to request that
// account's tokens, writes one the plugin can get pods with and nothing else, and replaces it
// before it expires with another that works.
func TestIntegrationPluginServiceAccount(t *testing.T) {
	f := newRBACFixture(t)
	e := newEnv(t)
	f.agentIdentity(t, e, "detour-node")
	f.allowTokenFor(t, "detour-node")
	e.flags.PluginTokenTTL = nodeagent.MinPluginTokenTTL
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	agentClient := kubernetes.NewForConfigOrDie(agentConfig(f.cfg, e.saDir))
	// 0.2% of 10 minutes: the token is renewed after 1.2s.
	a := e.agent(t, nodeagent.WithNodeClient(agentClient), nodeagent.WithTokenRefreshFraction(0.002))
	run(t, a)
	eventually(t, "the agent is ready", func() bool { ok, _ := a.Ready(); return ok })
	tokenFile := filepath.Join(e.confDir, "detour-cni.token")
	first := readFile(t, tokenFile)
	if st, err := os.Stat(tokenFile); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("token file %v, %v", st, err)
	}
	want := "system:serviceaccount:" + f.ns + ":detour-cni"
	if who := f.whoami(t, first); who != want {
		t.Fatalf("the plugin's token is %s's, want %s", who, want)
	}
	if left := time.Until(a.Status().PluginTokenExpires); left <= 9*time.Minute || left > 10*time.Minute {
		t.Errorf("the plugin's token expires in %s, want the requested 10m", left)
	}
	// The agent's permission covers detour-cni only.
	if _, err := agentClient.CoreV1().ServiceAccounts(f.ns).CreateToken(context.Background(), "default", &authenticationv1.TokenRequest{}, metav1.CreateOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("the agent requested a token for another service account: %v", err)
	}

	// The plugin's own path reads the pod; anything else is refused.
	if err := f.pluginGetPod(t, primary); err != nil {
		t.Fatalf("the plugin cannot read its pod: %v", err)
	}
	pluginCfg, err := clientcmd.BuildConfigFromFlags("", filepath.Join(e.confDir, "detour-cni.kubeconfig"))
	if err != nil {
		t.Fatal(err)
	}
	plugin := kubernetes.NewForConfigOrDie(pluginCfg)
	if _, err := plugin.CoreV1().Pods(f.ns).List(context.Background(), metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("the plugin listed pods: %v", err)
	}
	node := registerNode(t, f.admin)
	_, err = plugin.CoreV1().Nodes().Patch(context.Background(), node.Name, types.MergePatchType, []byte(`{"metadata":{"labels":{"x":"y"}}}`), metav1.PatchOptions{})
	if !apierrors.IsForbidden(err) {
		t.Errorf("the plugin patched a node: %v", err)
	}

	// Renewed before it expires, with a token that works too.
	eventually(t, "the plugin's token is renewed", func() bool { b, _ := os.ReadFile(tokenFile); return len(b) > 0 && string(b) != first })
	second := readFile(t, tokenFile)
	if who := f.whoami(t, second); who != want {
		t.Errorf("the renewed token is %s's, want %s", who, want)
	}
	if err := f.pluginGetPod(t, primary); err != nil {
		t.Errorf("the plugin cannot read its pod with the renewed token: %v", err)
	}
	if ok, reason := a.Ready(); !ok {
		t.Errorf("not ready after the renewal: %s", reason)
	}
}

// getReadyz returns /readyz's status and body, or 0 while the agent does not answer.
func getReadyz(addr string) (int, string) {
	resp, err := http.Get("http://" + addr + "/readyz")
	if err != nil {
		return 0, ""
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// The real command with --plugin-service-account: with the token permission it becomes ready
// and marks the node; without it, it never does, and says why.
func TestIntegrationInstallCNIPluginServiceAccountCommand(t *testing.T) {
	f := newRBACFixture(t)
	nodeRule := rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"nodes"}, Verbs: []string{"get", "list", "watch", "patch"}}
	start := func(t *testing.T, agentSA string, allowToken bool) (e *env, node *corev1.Node, addr string, stop func() string) {
		e = newEnv(t)
		f.agentIdentity(t, e, agentSA)
		f.clusterRole(t, agentSA, agentSA+"-nodes", nodeRule)
		if allowToken {
			f.allowTokenFor(t, agentSA)
		}
		node = registerNode(t, f.admin)
		writeFile(t, filepath.Join(e.confDir, "10-calico.conflist"), calico)
		addr = freeAddr(t)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		cmd := testenv.ChildCommand(ctx, testenv.Identity{}, "detour", "install-cni",
			"--cni-conf-dir="+e.confDir, "--host-cni-conf-dir="+e.confDir, "--cni-bin-dir="+e.binDir,
			"--plugin-source="+e.source, "--service-account-dir="+e.saDir, "--api-server="+f.cfg.Host,
			"--node-name="+node.Name, "--kubeconfig="+testenv.Kubeconfig(t, &rest.Config{Host: f.cfg.Host, TLSClientConfig: rest.TLSClientConfig{CAData: f.cfg.CAData}, BearerTokenFile: filepath.Join(e.saDir, "token")}), "--health-probe-bind-address="+addr,
			"--plugin-service-account=detour-cni", "--plugin-token-ttl=10m")
		var stderr strings.Builder
		cmd.Stderr = &stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		stopped := false
		stop = func() string {
			if !stopped {
				stopped = true
				cmd.Process.Signal(syscall.SIGTERM)
				if err := cmd.Wait(); err != nil {
					t.Errorf("install-cni after SIGTERM: %v\n%s", err, stderr.String())
				}
				cancel()
			}
			return stderr.String()
		}
		t.Cleanup(func() { stop() })
		return e, node, addr, stop
	}

	t.Run("allowed", func(t *testing.T) {
		e, node, addr, stop := start(t, "detour-node", true)
		eventually(t, "/readyz answers 200", func() bool { code, _ := getReadyz(addr); return code == http.StatusOK })
		if _, body := getReadyz(addr); !strings.Contains(body, f.ns+"/detour-cni is valid until") {
			t.Errorf("/readyz says %q", body)
		}
		got, _ := f.admin.CoreV1().Nodes().Get(context.Background(), node.Name, metav1.GetOptions{})
		if hasStartupTaint(got) || got.Labels[annotations.CNIReadyLabel] != "true" {
			t.Errorf("ready but the node is %v %v", got.Spec.Taints, got.Labels)
		}
		if who := f.whoami(t, readFile(t, filepath.Join(e.confDir, "detour-cni.token"))); who != "system:serviceaccount:"+f.ns+":detour-cni" {
			t.Errorf("the plugin's token is %s's", who)
		}
		if log := stop(); !strings.Contains(log, "requested a token for the plugin") {
			t.Errorf("no log of the token request:\n%s", log)
		}
	})

	t.Run("forbidden", func(t *testing.T) {
		e, node, addr, stop := start(t, "detour-node-no-token", false)
		eventually(t, "/readyz says why it is not ready", func() bool {
			code, body := getReadyz(addr)
			return code == http.StatusServiceUnavailable && strings.Contains(body, "serviceaccounts/token")
		})
		// Not ready over several retries (1s, 2s, 4s backoff).
		for deadline := time.Now().Add(4 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
			if code, body := getReadyz(addr); code != http.StatusServiceUnavailable {
				t.Fatalf("/readyz = %d %q without the permission to request the plugin's token", code, body)
			}
		}
		_, body := getReadyz(addr)
		t.Logf("/readyz: %s", body)
		for _, want := range []string{"request a token for service account " + f.ns + "/detour-cni", "forbidden",
			"needs create on serviceaccounts/token in namespace " + f.ns + " with resourceNames [detour-cni]"} {
			if !strings.Contains(body, want) {
				t.Errorf("/readyz says %q, want %q in it", body, want)
			}
		}
		got, _ := f.admin.CoreV1().Nodes().Get(context.Background(), node.Name, metav1.GetOptions{})
		if !hasStartupTaint(got) || got.Labels[annotations.CNIReadyLabel] != "" {
			t.Errorf("the node was marked ready without the plugin's token: %v %v", got.Spec.Taints, got.Labels)
		}
		for _, name := range []string{"detour-cni.token", "detour-cni.kubeconfig"} {
			if _, err := os.Stat(filepath.Join(e.confDir, name)); !os.IsNotExist(err) {
				t.Errorf("%s written without the plugin's token: %v", name, err)
			}
		}
		if log := stop(); !strings.Contains(log, "reconcile failed") || !strings.Contains(log, "resourceNames [detour-cni]") {
			t.Errorf("the log does not say why:\n%s", log)
		}
	})
}

// --uninstall --hold: the real command removes everything, then stays up and ready until
// SIGTERM, and exits 0.
func TestIntegrationInstallCNIUninstallHold(t *testing.T) {
	cfg := testenv.ControlPlane(t)
	client := kubernetes.NewForConfigOrDie(cfg)
	node := registerNode(t, client)
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	e.flags.NodeName = node.Name
	if s, err := e.agent(t, nodeagent.WithNodeClient(client)).Reconcile(context.Background()); err != nil || !s.NodeReady {
		t.Fatalf("install: %+v, %v", s, err)
	}
	addr := freeAddr(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := testenv.ChildCommand(ctx, testenv.Identity{}, "detour", "install-cni", "--uninstall", "--hold",
		"--cni-conf-dir="+e.confDir, "--host-cni-conf-dir="+e.confDir, "--cni-bin-dir="+e.binDir,
		"--plugin-source="+e.source, "--service-account-dir="+e.saDir, "--api-server=https://10.96.0.1:443",
		"--node-name="+node.Name, "--kubeconfig="+testenv.Kubeconfig(t, cfg),
		"--health-addr="+addr) // the deprecated name of --health-probe-bind-address still works
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	eventually(t, "/readyz answers 200", func() bool { code, _ := getReadyz(addr); return code == http.StatusOK })
	if _, body := getReadyz(addr); !strings.Contains(body, "uninstalled") {
		t.Errorf("/readyz says %q", body)
	}
	if types := pluginTypes(t, readFile(t, primary)); strings.Contains(strings.Join(types, ","), "detour-cni") {
		t.Errorf("ready, but the primary still holds %v", types)
	}
	for _, name := range []string{filepath.Join(e.binDir, "detour-cni"), filepath.Join(e.confDir, "detour-cni.kubeconfig"), filepath.Join(e.confDir, "detour-cni.token")} {
		if _, err := os.Stat(name); !os.IsNotExist(err) {
			t.Errorf("ready, but %s is still there: %v", name, err)
		}
	}
	got, _ := client.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
	if _, ok := got.Labels[annotations.CNIReadyLabel]; ok {
		t.Errorf("ready, but the node keeps the label: %v", got.Labels)
	}
	// It holds: still running, still ready, still alive.
	select {
	case err := <-exited:
		t.Fatalf("install-cni --uninstall --hold exited before SIGTERM: %v\n%s", err, stderr.String())
	case <-time.After(time.Second):
	}
	if code, _ := getReadyz(addr); code != http.StatusOK {
		t.Errorf("/readyz = %d while holding", code)
	}
	if resp, err := http.Get("http://" + addr + "/healthz"); err != nil || resp.StatusCode != http.StatusOK {
		t.Errorf("/healthz = %v, %v", resp, err)
	} else {
		resp.Body.Close()
	}
	cmd.Process.Signal(syscall.SIGTERM)
	if err := <-exited; err != nil {
		t.Errorf("install-cni --uninstall --hold after SIGTERM: %v (want exit 0)\n%s", err, stderr.String())
	}
	if !strings.Contains(stderr.String(), "holding until SIGTERM") {
		t.Errorf("log:\n%s", stderr.String())
	}
}
