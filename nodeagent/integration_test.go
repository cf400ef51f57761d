package nodeagent_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/internal/cli"
	"github.com/detourmesh/detour/nodeagent"
	"github.com/detourmesh/detour/test/testenv"
)

func TestMain(m *testing.M) {
	testenv.MainWithChildren(m, map[string]func([]string) int{"detour": cli.Main})
}

func randomName(prefix string) string {
	var b [4]byte
	rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// registerNode creates a Node as a kubelet started with
// --register-with-taints=detour.dev/cni-not-ready=true:NoSchedule would, plus an unrelated taint.
func registerNode(t *testing.T, client kubernetes.Interface) *corev1.Node {
	t.Helper()
	node := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: randomName("node-"), Labels: map[string]string{"topology.kubernetes.io/zone": "a"}},
		Spec: corev1.NodeSpec{Taints: []corev1.Taint{
			{Key: annotations.CNINotReadyTaint, Value: "true", Effect: corev1.TaintEffectNoSchedule},
			{Key: "example.com/gpu", Value: "true", Effect: corev1.TaintEffectNoSchedule},
		}},
	}
	node, err := client.CoreV1().Nodes().Create(context.Background(), node, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("register node: %v", err)
	}
	t.Cleanup(func() { client.CoreV1().Nodes().Delete(context.Background(), node.Name, metav1.DeleteOptions{}) })
	return node
}

func hasStartupTaint(n *corev1.Node) bool {
	return slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == annotations.CNINotReadyTaint })
}

// The node loses its startup taint, and gains the ready label, only once the config is in place.
func TestIntegrationNodeReadiness(t *testing.T) {
	cfg := testenv.ControlPlane(t)
	client := kubernetes.NewForConfigOrDie(cfg)
	node := registerNode(t, client)
	e := newEnv(t)
	e.flags.NodeName = node.Name
	a := e.agent(t, nodeagent.WithNodeClient(client))
	ctx := context.Background()

	// No primary config: nothing happens to the node.
	if s, err := a.Reconcile(ctx); err != nil || s.NodeReady {
		t.Fatalf("Reconcile without a primary = %+v, %v", s, err)
	}
	got, err := client.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !hasStartupTaint(got) || got.Labels[annotations.CNIReadyLabel] != "" || got.ResourceVersion != node.ResourceVersion {
		t.Fatalf("node changed before the config was in place: %+v", got)
	}

	run(t, a)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeAtomic(t, primary, calico)
	eventually(t, "the node gets the ready label", func() bool {
		got, err = client.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
		return err == nil && got.Labels[annotations.CNIReadyLabel] == "true"
	})
	if hasStartupTaint(got) {
		t.Errorf("ready label set but the startup taint is still there: %v", got.Spec.Taints)
	}
	// Other taints stay (the API server adds node.kubernetes.io/not-ready to a new node, too).
	gpu := slices.ContainsFunc(got.Spec.Taints, func(t corev1.Taint) bool { return t.Key == "example.com/gpu" })
	if !gpu || got.Labels["topology.kubernetes.io/zone"] != "a" {
		t.Errorf("other taints or labels lost: %v %v", got.Spec.Taints, got.Labels)
	}
	// When the node shows ready, the config is in place.
	if types := pluginTypes(t, readFile(t, primary)); !slices.Equal(types, []string{"calico", "portmap", "detour-cni"}) {
		t.Errorf("node ready but the primary holds %v", types)
	}
	eventually(t, "the agent reports ready", func() bool { ok, _ := a.Ready(); return ok })

	// Issue 15.4: the config goes away after the first readiness (here the primary's file is
	// removed, as by a reboot that cleared it): the label follows, and comes back with it.
	if err := os.Remove(primary); err != nil {
		t.Fatal(err)
	}
	// The reconcile that removes the label records its status just after the patch: wait for
	// both (checking Ready the moment the label is gone raced with that).
	eventually(t, "the ready label and the agent's readiness to go with the config", func() bool {
		got, err = client.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
		ready, _ := a.Ready()
		return err == nil && got.Labels[annotations.CNIReadyLabel] == "" && !ready
	})
	writeAtomic(t, primary, calico)
	eventually(t, "the ready label comes back with the config", func() bool {
		got, err = client.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
		return err == nil && got.Labels[annotations.CNIReadyLabel] == "true"
	})
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// The real command: ready through its probe, SIGTERM leaves the config, --uninstall removes it.
func TestIntegrationInstallCNICommand(t *testing.T) {
	cfg := testenv.ControlPlane(t)
	client := kubernetes.NewForConfigOrDie(cfg)
	node := registerNode(t, client)
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	addr := freeAddr(t)
	args := []string{"install-cni",
		"--cni-conf-dir=" + e.confDir, "--host-cni-conf-dir=" + e.confDir, "--cni-bin-dir=" + e.binDir,
		"--plugin-source=" + e.source, "--service-account-dir=" + e.saDir, "--api-server=https://10.96.0.1:443",
		"--node-name=" + node.Name, "--kubeconfig=" + testenv.Kubeconfig(t, cfg), "--health-probe-bind-address=" + addr,
		"--exclude-namespaces=kube-system,istio-system", "--plugin-log-level=debug", "--resync-interval=2s",
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var stderr strings.Builder
	agent := testenv.ChildCommand(ctx, testenv.Identity{}, "detour", args...)
	agent.Stderr = &stderr
	if err := agent.Start(); err != nil {
		t.Fatal(err)
	}
	eventually(t, "/readyz answers 200", func() bool {
		resp, err := http.Get("http://" + addr + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	got, _ := client.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
	if hasStartupTaint(got) || got.Labels[annotations.CNIReadyLabel] != "true" {
		t.Errorf("ready probe passes but the node is %v %v", got.Spec.Taints, got.Labels)
	}
	if !strings.Contains(readFile(t, primary), `"istio-system"`) || !strings.Contains(readFile(t, primary), `"logLevel":"debug"`) {
		t.Errorf("flags not in the entry:\n%s", readFile(t, primary))
	}

	// SIGTERM: a clean exit that leaves everything in place.
	agent.Process.Signal(syscall.SIGTERM)
	if err := agent.Wait(); err != nil {
		t.Fatalf("install-cni after SIGTERM: %v\n%s", err, stderr.String())
	}
	if types := pluginTypes(t, readFile(t, primary)); !slices.Contains(types, "detour-cni") {
		t.Errorf("SIGTERM removed the entry: %v", types)
	}
	for _, f := range []string{filepath.Join(e.binDir, "detour-cni"), filepath.Join(e.confDir, "detour-cni.kubeconfig")} {
		if _, err := os.Stat(f); err != nil {
			t.Errorf("SIGTERM removed %s: %v", f, err)
		}
	}

	// --uninstall removes the entry, the binary, the kubeconfig, the token and the label.
	out, err := testenv.ChildCommand(ctx, testenv.Identity{}, "detour", append(args, "--uninstall")...).CombinedOutput()
	if err != nil {
		t.Fatalf("install-cni --uninstall: %v\n%s", err, out)
	}
	if types := pluginTypes(t, readFile(t, primary)); !slices.Equal(types, []string{"calico", "portmap"}) {
		t.Errorf("after --uninstall the primary holds %v", types)
	}
	for _, f := range []string{filepath.Join(e.binDir, "detour-cni"), filepath.Join(e.confDir, "detour-cni.kubeconfig"), filepath.Join(e.confDir, "detour-cni.token")} {
		if _, err := os.Stat(f); !os.IsNotExist(err) {
			t.Errorf("--uninstall left %s: %v", f, err)
		}
	}
	got, _ = client.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
	if _, ok := got.Labels[annotations.CNIReadyLabel]; ok {
		t.Errorf("--uninstall left the ready label: %v", got.Labels)
	}
}
