package nodeagent_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/nodeagent"
)

const ciliumConf = `{"cniVersion":"0.3.1","name":"cilium","type":"cilium-cni","enable-debug":false}`

// Cilium with cni.exclusive renames every configuration but its own to *.cilium_bak: the agent
// notices its configuration renamed away, refuses (the node loses its ready label, an Event
// names the setting), and goes on once the setting is changed and the file deleted.
func TestExclusivePrimaryNoticed(t *testing.T) {
	e := newEnv(t)
	conf := filepath.Join(e.confDir, "05-cilium.conf")
	writeFile(t, conf, ciliumConf)
	// Another CNI's file Cilium renamed away is none of detour's business.
	writeFile(t, filepath.Join(e.confDir, "10-calico.conflist.cilium_bak"), calico)
	client := runtimeNode(e, "containerd://2.4.2")
	a := e.agent(t, nodeagent.WithNodeClient(client))
	ctx := context.Background()
	s, err := a.Reconcile(ctx)
	if err != nil || !s.NodeReady || s.Mode != nodeagent.ModeChainedEntry {
		t.Fatalf("Reconcile = %+v, %v", s, err)
	}
	// Cilium renames the converted conflist away and writes its .conf again.
	converted := filepath.Join(e.confDir, "05-cilium.conflist")
	if err := os.Rename(converted, converted+".cilium_bak"); err != nil {
		t.Fatal(err)
	}
	writeFile(t, conf, ciliumConf)
	s, err = a.Reconcile(ctx)
	if err == nil || !strings.Contains(err.Error(), "cni.exclusive=false") || !strings.Contains(err.Error(), "05-cilium.conflist.cilium_bak") {
		t.Fatalf("Reconcile after the rename = %v", err)
	}
	if s.EntryInPlace || s.NodeReady {
		t.Errorf("status %+v", s)
	}
	node, _ := client.CoreV1().Nodes().Get(ctx, "node-1", metav1.GetOptions{})
	if _, ok := node.Labels["detour.dev/cni-ready"]; ok {
		t.Errorf("the node kept its ready label: %v", node.Labels)
	}
	events, _ := client.CoreV1().Events("default").List(ctx, metav1.ListOptions{})
	if len(events.Items) != 1 || !strings.Contains(events.Items[0].Message, "cni.exclusive") {
		t.Errorf("events %+v", events.Items)
	}
	if files, _, err := nodeagent.RenamedAway(e.confDir); err != nil || len(files) != 1 {
		t.Errorf("RenamedAway = %v, %v", files, err)
	}

	// The user sets cni.exclusive=false and deletes the renamed file: the agent goes on.
	if err := os.Remove(converted + ".cilium_bak"); err != nil {
		t.Fatal(err)
	}
	if s, err := a.Reconcile(ctx); err != nil || !s.NodeReady {
		t.Errorf("Reconcile after the fix = %+v, %v", s, err)
	}
}
