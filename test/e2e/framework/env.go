package framework

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/detourmesh/detour/test/e2e/preflight"
	"github.com/detourmesh/detour/test/images"
	"github.com/detourmesh/detour/test/testenv"
)

// Env is what a story runs against: a cluster (its control-plane node, and the nodes that
// join it), detour's artifacts, and the test server outside the pods. [SetUp] returns the
// shared one; [OwnEnv] starts one for a single test.
type Env struct {
	// Node is the cluster's control-plane node, where detour is installed and the pods run
	// unless a story puts them elsewhere.
	Node *Node
	// Artifacts are detour's image and the test images, as built for this run.
	Artifacts *Artifacts
	// Root is the module's root (the chart, install.yaml and testdata are read from there).
	Root string
	// Server is the address of the test server outside the pods ("the internet"), of the
	// cluster's primary family.
	Server string
	// Servers are the test server's addresses, one per family of the cluster, the primary
	// (Server) first.
	Servers []string
	// Proxy is the proxy of every meshed pod: the test proxy unless DETOUR_E2E_PROXY says
	// otherwise ([Proxy]).
	Proxy *Proxy
	// img is where detour's chart and the pods' images come from now.
	img imageSet
	// Registry is the cluster's registry, once a story moved to it ([Env.UseRegistry]).
	Registry *Registry
	// registryImages is the image set of the registry, once it holds the images.
	registryImages imageSet
}

// imageSet is where the e2e installs detour's chart from and where its pods' images come
// from: imported into the node's containerd (pull policy Never) and the chart's directory, or
// the cluster's registry ([Env.UseRegistry]).
type imageSet struct {
	repo, tag string // detour's image
	refs      images.Refs
	pull      corev1.PullPolicy
	// chart is helm's chart argument and the flags that go with it.
	chart []string
	// proxy is the proxy the chart's webhook injects, if not the run's (Env.Proxy).
	proxy *Proxy
}

// Run is the TestMain of a test binary that uses the framework: it serves as a node's
// namespace holder when the binary was started as one (see [ServeHolder]), runs the tests, then
// stops the shared node (see [SetUp]) with its registry and removes the artifacts. It returns
// the binary's exit code.
func Run(m *testing.M) int {
	ServeHolder()
	code := m.Run()
	if shared.env != nil {
		if r := shared.env.Registry; r != nil {
			if err := r.Close(); err != nil {
				fmt.Fprintln(os.Stderr, "e2e: stop the registry:", err)
			}
		}
		if err := shared.env.Node.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "e2e: stop the node:", err)
			code = 1
		}
	}
	if shared.art != nil {
		os.RemoveAll(shared.art.dir)
	}
	return code
}

// shared is the binary's shared node and the artifacts, built once for every cluster of the run.
var shared struct {
	once sync.Once
	env  *Env
	err  error
	// The artifacts, built once for every cluster of the run.
	artOnce sync.Once
	art     *Artifacts
	artErr  error
}

// SetUp returns the shared node of the test binary, starting it on first use: the artifacts
// are built, the node registers with detour's startup taint, and the test server runs outside
// the pods. The node lives until the binary ends ([Run] stops it), so the tests that use it
// run in the order of their files and declarations, each on what the earlier ones left.
func SetUp(t testing.TB) *Env {
	t.Helper()
	return SetUpWith(t, Options{Taints: []string{StartupTaint + ":NoSchedule"}})
}

// SetUpWith is [SetUp] for a binary whose first test registers the shared node with opts of its
// own (TestConformance: no startup taint); once the node runs, opts change nothing.
func SetUpWith(t testing.TB, opts Options) *Env {
	t.Helper()
	bin := RequireNode(t)
	shared.once.Do(func() { shared.env, shared.err = newEnv(bin, opts) })
	if shared.err != nil {
		t.Fatalf("set up the node: %v", shared.err)
	}
	return shared.env
}

// OwnEnv starts a cluster of the test's own with opts and stops it, with its registry, when
// the test ends. It must not run beside the shared node ([SetUp]): they take the same
// addresses, so a test that calls it comes before the first one that calls SetUp (go test
// runs a package's tests in the order of their files and declarations).
func OwnEnv(t *testing.T, opts Options) *Env {
	t.Helper()
	if shared.env != nil {
		t.Fatal("OwnEnv: the shared node (SetUp) runs already and takes the same addresses; declare this test before the first test that calls SetUp")
	}
	e, err := newEnv(RequireNode(t), opts)
	if err != nil {
		t.Fatalf("start the test's cluster: %v", err)
	}
	t.Cleanup(func() {
		if e.Registry != nil {
			if err := e.Registry.Close(); err != nil {
				t.Errorf("stop the registry: %v", err)
			}
		}
		if err := e.Node.Stop(); err != nil {
			t.Errorf("stop the test's cluster: %v", err)
		}
	})
	return e
}

// newEnv builds the artifacts (once per run) and starts a control-plane node with opts (its
// taints, flannel), the artifacts' images and CoreDNS.
func newEnv(bin string, opts Options) (*Env, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	root, err := moduleRoot()
	if err != nil {
		return nil, err
	}
	shared.artOnce.Do(func() { shared.art, shared.artErr = buildArtifacts(ctx, root, bin) })
	if shared.artErr != nil {
		return nil, fmt.Errorf("build detour's image and the test images: %w", shared.artErr)
	}
	art := shared.art
	proxy, err := proxyFromEnv()
	if err != nil {
		return nil, err
	}
	opts.Images, opts.PauseImage, opts.DNSImage = art.Tarballs, art.Refs.Pause, DNSImageRef
	n, err := Start(ctx, bin, opts)
	if err != nil {
		return nil, err
	}
	e := &Env{Node: n, Artifacts: art, Root: root, Proxy: proxy}
	for _, ip := range n.IPs() {
		e.Servers = append(e.Servers, netip.AddrPortFrom(ip, ServerPort).String())
	}
	e.Server = e.Servers[0]
	e.img = e.importedImages()
	for i := range e.Servers {
		if err := e.startServer(i); err != nil {
			n.Stop()
			return nil, err
		}
	}
	return e, nil
}

// startServer starts the test server on e.Servers[i].
func (e *Env) startServer(i int) error {
	log := "test-server"
	if i > 0 {
		log += fmt.Sprint(i)
	}
	argv := []string{e.Artifacts.workloadBin, "serve", "-listen", e.Servers[i]}
	if _, err := e.Node.holder.start(argv, e.Node.env(), e.Node.logPath(log), ""); err != nil {
		return fmt.Errorf("start the test server on %s: %w", e.Servers[i], err)
	}
	return nil
}

// AddIPv6 makes e's running IPv4-only cluster dual-stack ([Node.AddIPv6]) and starts the test
// server on the node's IPv6 address too (e.Servers' second).
func (e *Env) AddIPv6(ctx context.Context) error {
	if err := e.Node.AddIPv6(ctx); err != nil {
		return err
	}
	e.Servers = append(e.Servers, netip.AddrPortFrom(e.Node.IPs()[1], ServerPort).String())
	return e.startServer(len(e.Servers) - 1)
}

// moduleRoot is detour's module directory, as the go command finds it from here.
func moduleRoot() (string, error) {
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}").Output()
	if err != nil {
		return "", fmt.Errorf("find the module's root: %w", err)
	}
	return strings.TrimSpace(string(out)), nil
}

const (
	// DetourNamespace is the namespace the stories install detour into.
	DetourNamespace = "detour-system"
	// ServerPort is where the test server outside every pod listens, on the node's IP.
	ServerPort = 8080
)

// nodeBinaries are the binaries a node needs from hack/test-binaries.sh.
var nodeBinaries = []string{
	"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl",
	"containerd", "ctr", "containerd-shim-runc-v2", "runc", "bridge", "host-local", "loopback", "portmap", "helm",
	"prometheus", "kube-proxy", "coredns", "e2e.test", "agnhost", "debian-rootfs.tar",
}

// RequireNode skips (or, in CI, fails) the test when a node cannot run here, saying every
// reason at once (see package preflight), and returns the binaries' directory.
func RequireNode(t testing.TB) string {
	t.Helper()
	testenv.Privileged(t)
	preflightOnce.Do(func() {
		preflightErr = preflight.Err(preflight.Check(preflight.Options{
			RunDir: os.Getenv("DETOUR_E2E_DIR"), BinDir: testenv.BinDir(), Binaries: nodeBinaries,
		}))
	})
	if preflightErr != nil {
		testenv.Unavailable(t, preflightErr.Error())
	}
	return testenv.BinDir()
}

var (
	preflightOnce sync.Once
	preflightErr  error
)
