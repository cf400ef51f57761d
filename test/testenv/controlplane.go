package testenv

import (
	"path/filepath"
	"sync"
	"testing"

	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/detourmesh/detour/internal/controlplane"
)

var shared struct {
	sync.Mutex
	env *envtest.Environment
	cfg *rest.Config
	err error
}

// ControlPlane returns an admin config for a local kube-apiserver + etcd, started on first use
// and shared by the tests of the package (it is stopped by [Main]). The binaries come from
// hack/test-binaries.sh; the test skips (or fails, when required) without them.
func ControlPlane(t testing.TB) *rest.Config {
	t.Helper()
	Binary(t, "kube-apiserver")
	Binary(t, "etcd")
	shared.Lock()
	defer shared.Unlock()
	if shared.env == nil && shared.err == nil {
		shared.env = NewEnvironment()
		shared.cfg, shared.err = shared.env.Start()
	}
	if shared.err != nil {
		t.Fatalf("start the local control plane from %s: %v", BinDir(), shared.err)
	}
	return rest.CopyConfig(shared.cfg)
}

// NewEnvironment returns an envtest environment over the cached binaries, for tests that need
// a control plane of their own (to stop it, or to register webhooks before it starts).
func NewEnvironment() *envtest.Environment { return controlplane.New(BinDir()) }

func stopControlPlane() {
	shared.Lock()
	defer shared.Unlock()
	if shared.env != nil && shared.err == nil {
		_ = shared.env.Stop()
	}
}

// Kubeconfig writes cfg as a kubeconfig file in a temporary directory and returns its path,
// for components that read one (the CNI plugin, the node agent).
func Kubeconfig(t testing.TB, cfg *rest.Config) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := controlplane.WriteKubeconfig(path, cfg); err != nil {
		t.Fatalf("write kubeconfig: %v", err)
	}
	return path
}
