package testenv

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"math/big"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/types"
	types100 "github.com/containernetworking/cni/pkg/types/100"
	"github.com/vishvananda/netlink"
)

var built struct {
	sync.Mutex
	dir   string
	paths map[string]string
}

// Build builds one of this module's commands (e.g. "cmd/detour-cni") once per test process and
// returns the binary's path.
func Build(t testing.TB, cmd string) string {
	t.Helper()
	built.Lock()
	defer built.Unlock()
	if p, ok := built.paths[cmd]; ok {
		return p
	}
	if built.dir == "" {
		dir, err := os.MkdirTemp("", "detour-test-bin-")
		if err != nil {
			t.Fatal(err)
		}
		// Readable by the UIDs tests run children as.
		os.Chmod(dir, 0o755)
		built.dir, built.paths = dir, map[string]string{}
	}
	p := filepath.Join(built.dir, filepath.Base(cmd))
	c := exec.Command("go", "build", "-trimpath", "-o", p, "github.com/detourmesh/detour/"+cmd)
	c.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := c.CombinedOutput(); err != nil {
		t.Fatalf("go build ./%s: %v\n%s", cmd, err, out)
	}
	built.paths[cmd] = p
	return p
}

// DetourCNI builds cmd/detour-cni once per test process and returns the binary's path.
func DetourCNI(t testing.TB) string { return Build(t, "cmd/detour-cni") }

// CNI runs network configuration lists through libcni, exactly as containerd does, with the
// reference plugins from [BinDir] and detour-cni built from this tree.
type CNI struct {
	Config *libcni.CNIConfig
	// Paths is the CNI_PATH the plugins are found in.
	Paths []string
}

// NewCNI returns a CNI runner whose plugin cache lives in a temporary directory.
func NewCNI(t testing.TB) *CNI {
	t.Helper()
	Privileged(t)
	Binary(t, "bridge")
	Binary(t, "host-local")
	paths := []string{filepath.Dir(DetourCNI(t)), BinDir()}
	exec := &invoke.DefaultExec{RawExec: &invoke.RawExec{Stderr: logWriter{t}}}
	return &CNI{Config: libcni.NewCNIConfigWithCacheDir(paths, t.TempDir(), exec), Paths: paths}
}

// logWriter sends the plugins' standard error (detour-cni's log lines) to the test log.
type logWriter struct{ t testing.TB }

func (w logWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(b), "\n"))
	return len(b), nil
}

// Attachment is one sandbox's network: what the runtime passes to every command.
type Attachment struct {
	NetNS   *NetNS
	Runtime *libcni.RuntimeConf
}

// PodAttachment describes the sandbox of pod namespace/name (uid may be empty) in ns, with
// the pod's annotations passed as runtimeConfig when annotations is not nil (containerd does
// so for plugins that declare the io.kubernetes.cri.pod-annotations capability).
func PodAttachment(ns *NetNS, namespace, name, uid string, annotations map[string]string) *Attachment {
	args := [][2]string{
		{"IgnoreUnknown", "true"},
		{"K8S_POD_NAMESPACE", namespace},
		{"K8S_POD_NAME", name},
		{"K8S_POD_INFRA_CONTAINER_ID", ns.Name},
	}
	if uid != "" {
		args = append(args, [2]string{"K8S_POD_UID", uid})
	}
	rt := &libcni.RuntimeConf{ContainerID: ns.Name, NetNS: ns.Path, IfName: "eth0", Args: args}
	if annotations != nil {
		rt.CapabilityArgs = map[string]any{"io.kubernetes.cri.pod-annotations": annotations}
	}
	return &Attachment{NetNS: ns, Runtime: rt}
}

// Add runs ADD of the list for a and returns the result converted to the current version.
func (c *CNI) Add(ctx context.Context, list *libcni.NetworkConfigList, a *Attachment) (*types100.Result, error) {
	res, err := c.Config.AddNetworkList(ctx, list, a.Runtime)
	if err != nil {
		return nil, err
	}
	return types100.NewResultFromResult(res)
}

// AddPlugin runs ADD of only the list's plugin at index i for a, with prev as prevResult —
// as a runtime that re-runs one plugin of a chain would.
func (c *CNI) AddPlugin(ctx context.Context, list *libcni.NetworkConfigList, i int, a *Attachment, prev types.Result) (types.Result, error) {
	var conf map[string]any
	if err := json.Unmarshal(list.Plugins[i].Bytes, &conf); err != nil {
		return nil, err
	}
	conf["cniVersion"], conf["name"], conf["prevResult"] = list.CNIVersion, list.Name, prev
	b, err := json.Marshal(conf)
	if err != nil {
		return nil, err
	}
	plugin, err := libcni.NetworkPluginConfFromBytes(b)
	if err != nil {
		return nil, err
	}
	return c.Config.AddNetwork(ctx, plugin, a.Runtime)
}

// Bridge is a reference bridge network (bridge + host-local) on the host, with a random
// private IPv4 /24 and IPv6 /64; the test removes its host bridge and IPAM state when it ends.
type Bridge struct {
	Name    string // network and bridge device name
	Subnet4 netip.Prefix
	Subnet6 netip.Prefix // invalid when the network is IPv4 only
	dataDir string
}

// NewBridge returns a bridge network; dualStack adds the IPv6 range.
func NewBridge(t testing.TB, dualStack bool) *Bridge {
	t.Helper()
	Privileged(t)
	ShareHost(t) // the bridge and its veths are in the host's network namespace
	var id [3]byte
	_, _ = rand.Read(id[:])
	n, _ := rand.Int(rand.Reader, big.NewInt(120))
	b := &Bridge{
		Name:    "dt" + hex.EncodeToString(id[:]),
		Subnet4: netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(128 + n.Int64()), id[0], 0}), 24),
		dataDir: t.TempDir(),
	}
	if dualStack {
		b.Subnet6 = netip.PrefixFrom(netip.AddrFrom16([16]byte{0xfd, 0xde, id[0], id[1], id[2]}), 64)
	}
	t.Cleanup(func() {
		if link, err := netlink.LinkByName(b.Name); err == nil {
			if err := netlink.LinkDel(link); err != nil {
				t.Errorf("delete bridge %s: %v", b.Name, err)
			}
		}
	})
	return b
}

// Plugins returns the bridge and host-local plugin configuration, the primary CNI of a
// conflist.
func (b *Bridge) Plugins() []map[string]any {
	ranges := []any{[]any{map[string]any{"subnet": b.Subnet4.String()}}}
	routes := []any{map[string]any{"dst": "0.0.0.0/0"}}
	if b.Subnet6.IsValid() {
		ranges = append(ranges, []any{map[string]any{"subnet": b.Subnet6.String()}})
		routes = append(routes, map[string]any{"dst": "::/0"})
	}
	return []map[string]any{{
		"type":      "bridge",
		"bridge":    b.Name,
		"isGateway": true,
		"ipMasq":    false,
		"ipam": map[string]any{
			"type":    "host-local",
			"ranges":  ranges,
			"routes":  routes,
			"dataDir": b.dataDir,
		},
	}}
}

// ConfList is a conflist (CNI version 1.1.0) of the given plugins, as the node's CNI config
// file would hold it.
func ConfList(name string, plugins ...map[string]any) []byte {
	list := map[string]any{"cniVersion": "1.1.0", "name": name, "plugins": plugins}
	b, err := json.Marshal(list)
	if err != nil {
		panic(err)
	}
	return b
}

// ParseConfList parses conflist bytes through libcni, failing the test on error.
func ParseConfList(t testing.TB, b []byte) *libcni.NetworkConfigList {
	t.Helper()
	list, err := libcni.ConfListFromBytes(b)
	if err != nil {
		t.Fatalf("parse conflist: %v\n%s", err, b)
	}
	return list
}
