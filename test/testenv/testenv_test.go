package testenv_test

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/detourmesh/detour/test/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

func TestIntegrationControlPlane(t *testing.T) {
	cfg := testenv.ControlPlane(t)
	client := kubernetes.NewForConfigOrDie(cfg)
	ctx := context.Background()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: "testenv-"}}
	created, err := client.CoreV1().Namespaces().Create(ctx, ns, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create a namespace in the local apiserver: %v", err)
	}
	info, err := client.Discovery().ServerVersion()
	if err != nil || info.Major != "1" || info.GitVersion == "v0.0.0-master" {
		t.Fatalf("server version %+v, %v: the apiserver must report its real version", info, err)
	}
	t.Logf("apiserver %s, namespace %s", info.GitVersion, created.Name)
}

// Namespaces are connected, clients run as the requested identity, a server reports where a
// connection was headed, and cleanup leaves no namespace behind.
func TestIntegrationNamespacesAndClients(t *testing.T) {
	var paths []string
	t.Run("traffic", func(t *testing.T) {
		a, b := testenv.NewNetNS(t), testenv.NewNetNS(t)
		paths = append(paths, a.Path, b.Path)
		testenv.Link(t, a, "eth0", []netip.Prefix{netip.MustParsePrefix("10.88.0.1/24"), netip.MustParsePrefix("fd88::1/64")},
			b, "eth0", []netip.Prefix{netip.MustParsePrefix("10.88.0.2/24"), netip.MustParsePrefix("fd88::2/64")})
		testenv.Serve(t, b, "b4", "tcp4", "0.0.0.0:7000")
		testenv.Serve(t, b, "b6", "tcp6", "[::]:7000")
		for _, tc := range []struct {
			addr, want string
		}{
			{"10.88.0.2:7000", "b4 10.88.0.2:7000"},
			{"[fd88::2]:7000", "b6 [fd88::2]:7000"},
		} {
			got, err := testenv.Dial(t, a, testenv.Identity{UID: 4242, GID: 4242}, netip.MustParseAddrPort(tc.addr))
			if err != nil || got != tc.want {
				t.Errorf("dial %s = %q, %v; want %q", tc.addr, got, err, tc.want)
			}
		}
		if _, err := testenv.Dial(t, a, testenv.Identity{}, netip.MustParseAddrPort("10.88.0.2:7001")); err == nil {
			t.Error("dialing a closed port succeeded")
		}
		out, err := testenv.RunHelper(a, testenv.Identity{UID: 4242, GID: 4343}, "id")
		if err != nil || out != "4242 4343\n" {
			t.Errorf("helper identity = %q, %v; want uid 4242 gid 4343", out, err)
		}
	})
	for _, p := range paths {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("namespace %s is still there after its test ended", p)
		}
	}
}

// DialAs connects as the identity iptables owner matches see, from this process, and leaves
// the process's own identity alone.
func TestIntegrationDialAs(t *testing.T) {
	testenv.Privileged(t)
	a, b := testenv.NewNetNS(t), testenv.NewNetNS(t)
	testenv.Link(t, a, "eth0", []netip.Prefix{netip.MustParsePrefix("10.89.0.1/24")}, b, "eth0", []netip.Prefix{netip.MustParsePrefix("10.89.0.2/24")})
	testenv.Serve(t, a, "local", "tcp4", "0.0.0.0:7100")
	testenv.Serve(t, b, "remote", "tcp4", "0.0.0.0:7000")
	rules := "*nat\n" +
		"-A OUTPUT -p tcp -m owner --uid-owner 4242 -j REDIRECT --to-ports 7100\n" +
		"-A OUTPUT -p tcp -m owner --gid-owner 4343 -j REDIRECT --to-ports 7100\n" +
		"COMMIT\n"
	if err := a.Do(func() error {
		cmd := exec.Command("iptables-legacy-restore")
		cmd.Stdin = strings.NewReader(rules)
		out, err := cmd.CombinedOutput()
		if err != nil {
			return fmt.Errorf("%w: %s", err, out)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	remote := netip.MustParseAddrPort("10.89.0.2:7000")
	for _, tc := range []struct {
		id     testenv.Identity
		groups []uint32
		want   string
	}{
		{testenv.Identity{UID: 4242, GID: 1}, nil, "local 10.89.0.2:7000"},
		{testenv.Identity{UID: 1, GID: 4343}, nil, "local 10.89.0.2:7000"},
		{testenv.Identity{UID: 1, GID: 1}, []uint32{4343}, "remote 10.89.0.2:7000"}, // --gid-owner matches the primary group only
		{testenv.Identity{}, nil, "remote 10.89.0.2:7000"},
	} {
		got, err := testenv.DialAs(a, tc.id, tc.groups, remote, 2*time.Second)
		if err != nil || got != tc.want {
			t.Errorf("DialAs(%s, groups %v) = %q, %v; want %q", tc.id, tc.groups, got, err, tc.want)
		}
	}
	if os.Getuid() != 0 || os.Getgid() != 0 {
		t.Errorf("the test process's identity changed: uid %d gid %d", os.Getuid(), os.Getgid())
	}
}
