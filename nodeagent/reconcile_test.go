package nodeagent_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/detourmesh/detour/nodeagent"
)

func TestReconcileNoPrimaryWritesNothing(t *testing.T) {
	e := newEnv(t)
	writeFile(t, filepath.Join(e.confDir, "README"), "not a network")
	before := snapshot(t, e.confDir, e.binDir)
	a := e.agent(t)
	s, err := a.Reconcile(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if s.ConfigInPlace || !strings.Contains(s.Reason, "waiting for the primary CNI") {
		t.Errorf("status %+v", s)
	}
	if after := snapshot(t, e.confDir, e.binDir); !equalMaps(before, after) {
		t.Errorf("wrote files with no primary config: %v", after)
	}
	if ok, _ := a.Ready(); ok {
		t.Error("ready without a primary config")
	}
}

func TestReconcileConflistAppended(t *testing.T) {
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	a := e.agent(t)
	s, err := a.Reconcile(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !s.ConfigInPlace || s.Primary != primary {
		t.Errorf("status %+v", s)
	}
	if ok, reason := a.Ready(); !ok {
		t.Errorf("not ready: %s", reason)
	}
	got := readFile(t, primary)
	if types := pluginTypes(t, got); !slices.Equal(types, []string{"calico", "portmap", "detour-cni"}) {
		t.Errorf("plugins %v", types)
	}
	// The entry is the contract the plugin parses.
	var list struct {
		Plugins []map[string]any `json:"plugins"`
	}
	json.Unmarshal([]byte(got), &list)
	entry := list.Plugins[2]
	want := map[string]any{
		"type": "detour-cni", "name": "detour-cni", "kubeconfig": filepath.Join(e.confDir, "detour-cni.kubeconfig"),
		"apiTimeout": "5s", "iptablesBackend": "auto", "logLevel": "info", "excludeNamespaces": []any{"kube-system"},
		"capabilities": map[string]any{"io.kubernetes.cri.pod-annotations": true},
	}
	if b1, b2 := mustJSON(entry), mustJSON(want); b1 != b2 {
		t.Errorf("entry\n%s\nwant\n%s", b1, b2)
	}

	// The binary, executable and identical to its source.
	bin := filepath.Join(e.binDir, "detour-cni")
	if readFile(t, bin) != readFile(t, e.source) {
		t.Error("installed binary differs from its source")
	}
	if st, _ := os.Stat(bin); st.Mode().Perm() != 0o755 {
		t.Errorf("binary mode %v", st.Mode())
	}
	// The kubeconfig and token copy, 0600, the token by file.
	for _, f := range []string{"detour-cni.kubeconfig", "detour-cni.token"} {
		if st, err := os.Stat(filepath.Join(e.confDir, f)); err != nil || st.Mode().Perm() != 0o600 {
			t.Errorf("%s: %v, mode %v; want mode 0600", f, err, st.Mode())
		}
	}
	kc, err := clientcmd.LoadFromFile(filepath.Join(e.confDir, "detour-cni.kubeconfig"))
	if err != nil {
		t.Fatal(err)
	}
	ctx := kc.Contexts[kc.CurrentContext]
	user, cluster := kc.AuthInfos[ctx.AuthInfo], kc.Clusters[ctx.Cluster]
	if user.TokenFile != filepath.Join(e.confDir, "detour-cni.token") || user.Token != "" || cluster.Server != "https://10.96.0.1:443" || !bytes.Contains(cluster.CertificateAuthorityData, []byte("MIIB")) {
		t.Errorf("kubeconfig user %+v cluster %+v", user, cluster)
	}
	if readFile(t, filepath.Join(e.confDir, "detour-cni.token")) != "token-1" {
		t.Error("token copy differs from the service account token")
	}

	// Nothing changes on the next reconcile: nothing is written.
	before := inodes(t, e.confDir, e.binDir)
	if _, err := a.Reconcile(context.Background()); err != nil {
		t.Fatal(err)
	}
	if after := inodes(t, e.confDir, e.binDir); !equalMaps(before, after) {
		t.Errorf("a reconcile with nothing to do rewrote files:\n%v\n%v", before, after)
	}
}

func TestReconcileConfConverted(t *testing.T) {
	e := newEnv(t)
	const kindnet = `{"cniVersion":"0.4.0","name":"kindnet","type":"ptp","ipMasq":false,"ipam":{"type":"host-local","ranges":[[{"subnet":"10.244.1.0/24"}]]},"mtu":1500}`
	conf := filepath.Join(e.confDir, "10-kindnet.conf")
	writeFile(t, conf, kindnet)
	writeFile(t, filepath.Join(e.confDir, "99-loopback.conf"), `{"cniVersion":"0.4.0","name":"lo","type":"loopback"}`)
	a := e.agent(t)
	for round := range 2 { // the primary writes its .conf again after the conversion
		s, err := a.Reconcile(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		conflist := filepath.Join(e.confDir, "10-kindnet.conflist")
		if s.Primary != conflist || !s.ConfigInPlace {
			t.Errorf("round %d: status %+v", round, s)
		}
		if _, err := os.Stat(conf); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("round %d: the .conf is still there (%v): the runtime would load it first", round, err)
		}
		if p, _ := nodeagent.Primary(e.confDir); p != conflist {
			t.Errorf("round %d: the runtime loads %s", round, p)
		}
		got := readFile(t, conflist)
		if types := pluginTypes(t, got); !slices.Equal(types, []string{"ptp", "detour-cni"}) {
			t.Errorf("round %d: plugins %v", round, types)
		}
		list, _ := libcni.ConfListFromBytes([]byte(got))
		if list.Name != "kindnet" || list.CNIVersion != "0.4.0" || !strings.Contains(string(list.Plugins[0].Bytes), `"mtu":1500`) {
			t.Errorf("round %d: converted list lost fields: %s", round, got)
		}
		writeFile(t, conf, kindnet)
	}
}

// BenchmarkReconcileSteady is the cost of one resync on a node where everything is in place:
// the agent reads the directory, the primary, the binary's identity and the token, and writes
// nothing.
func BenchmarkReconcileSteady(b *testing.B) {
	e := newEnv(b)
	writeFile(b, filepath.Join(e.confDir, "10-calico.conflist"), calico)
	a := nodeagent.New(e.config(b), nodeagent.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
	if _, err := a.Reconcile(context.Background()); err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if s, err := a.Reconcile(context.Background()); err != nil || !s.ConfigInPlace {
			b.Fatal(s, err)
		}
	}
}
