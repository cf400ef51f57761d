package nodeagent_test

import (
	"context"
	"encoding/json"
	"encoding/pem"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/nodeagent"
)

func TestRunRestoresRewrittenPrimary(t *testing.T) {
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	stale := filepath.Join(e.binDir, ".detour-tmp-detour-cni-123") // left by a killed agent
	writeFile(t, stale, "half a binary")
	// The primary's rewrites come 3.5 s apart on the agent's clock: fewer than the ten within
	// 30 s that the agent takes for a primary fighting its entry (TestEntryWarRefused).
	var skew atomic.Int64
	a := e.agent(t, nodeagent.WithClock(func() time.Time { return time.Now().Add(time.Duration(skew.Load())) }))
	stop := run(t, a)

	// The primary appears after the agent started.
	eventually(t, "the agent waits for the primary", func() bool { _, r := a.Ready(); return strings.Contains(r, "waiting") })
	want := pluginTypes(t, calico)
	for i := range 50 {
		skew.Add(int64(3500 * time.Millisecond))
		writeAtomic(t, primary, calico)
		eventually(t, "the entry is restored", func() bool {
			b, err := os.ReadFile(primary)
			if err != nil {
				t.Fatal(err)
			}
			if !json.Valid(b) {
				t.Fatalf("rewrite %d: invalid JSON in the primary:\n%s", i, b)
			}
			types := pluginTypes(t, string(b))
			if n := strings.Count(strings.Join(types, ","), "detour-cni"); n > 1 {
				t.Fatalf("rewrite %d: detour-cni appears %d times: %v", i, n, types)
			}
			return slices.Equal(types, append(want, "detour-cni"))
		})
	}
	if _, err := os.Stat(stale); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("stale temporary file not removed: %v", err)
	}
	// No write loop: once restored, the agent leaves the file alone. Two more passes (the resync
	// brings them) mean at least one whole pass began after the snapshot; a loop would write.
	settled := inodes(t, e.confDir)
	passes := nodeagent.Passes(a)
	eventually(t, "the agent has looked again", func() bool { return nodeagent.Passes(a) >= passes+2 })
	if now := inodes(t, e.confDir); !equalMaps(settled, now) {
		t.Errorf("the agent kept writing after the entry was in place")
	}
	if err := stop(); err != nil {
		t.Errorf("Run = %v", err)
	}
	// Stopping (SIGTERM) leaves everything in place.
	if types := pluginTypes(t, readFile(t, primary)); !slices.Contains(types, "detour-cni") {
		t.Errorf("entry removed on stop: %v", types)
	}
	for _, f := range []string{filepath.Join(e.binDir, "detour-cni"), filepath.Join(e.confDir, "detour-cni.kubeconfig"), filepath.Join(e.confDir, "detour-cni.token")} {
		if _, err := os.Stat(f); err != nil {
			t.Errorf("removed on stop: %v", err)
		}
	}
}

// A new primary that sorts first (another CNI replacing the first one) gets the entry; the
// file the runtime no longer loads is left as it is.
func TestRunFollowsANewPrimary(t *testing.T) {
	e := newEnv(t)
	old := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, old, calico)
	a := e.agent(t)
	run(t, a)
	eventually(t, "the entry is in the first primary", func() bool { ok, _ := a.Ready(); return ok })
	before := readFile(t, old)

	cilium := filepath.Join(e.confDir, "05-cilium.conflist")
	writeAtomic(t, cilium, `{"cniVersion":"0.3.1","name":"cilium","plugins":[{"type":"cilium-cni","enable-debug":false}]}`)
	eventually(t, "the entry is in the new primary", func() bool {
		b, err := os.ReadFile(cilium)
		return err == nil && slices.Equal(pluginTypes(t, string(b)), []string{"cilium-cni", "detour-cni"})
	})
	eventually(t, "the status names the new primary", func() bool { return a.Status().Primary == cilium })
	if readFile(t, old) != before {
		t.Error("the old primary was edited")
	}
}

// A rotated service-account token is copied for the plugin, and a client built from the
// plugin's kubeconfig sends the new one.
func TestRunTokenRotation(t *testing.T) {
	var mu sync.Mutex
	var seen []string
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer "))
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, `{"major":"1","minor":"37","gitVersion":"v1.37.2"}`)
	}))
	defer srv.Close()
	ca := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})

	e := newEnv(t)
	e.rotateToken(t, "token-1", ca)
	e.flags.APIServer = srv.URL
	writeFile(t, filepath.Join(e.confDir, "10-calico.conflist"), calico)
	a := e.agent(t)
	run(t, a)
	eventually(t, "the config is in place", func() bool { ok, _ := a.Ready(); return ok })

	tokenUsed := func() string {
		cfg, err := clientcmd.BuildConfigFromFlags("", filepath.Join(e.confDir, "detour-cni.kubeconfig"))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := kubernetes.NewForConfigOrDie(cfg).Discovery().ServerVersion(); err != nil {
			t.Fatalf("call the API server with the plugin's kubeconfig: %v", err)
		}
		mu.Lock()
		defer mu.Unlock()
		return seen[len(seen)-1]
	}
	if got := tokenUsed(); got != "token-1" {
		t.Errorf("plugin client sent %q, want token-1", got)
	}
	e.rotateToken(t, "token-2", ca)
	eventually(t, "the rotated token is copied", func() bool {
		return readFile(t, filepath.Join(e.confDir, "detour-cni.token")) == "token-2"
	})
	if got := tokenUsed(); got != "token-2" {
		t.Errorf("after rotation the plugin client sent %q, want token-2", got)
	}
}

// The watch says the Node object is deleted once; when the read that confirms it fails (an API
// server that does not answer for a moment), the agent reads it again at its next resync and
// still takes detour off the node, rather than keeping it there until it restarts.
func TestRunRemovesDetourWhenTheDeletionIsConfirmedLate(t *testing.T) {
	e := newEnv(t)
	primary := filepath.Join(e.confDir, "10-calico.conflist")
	writeFile(t, primary, calico)
	client := fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}})
	var failing sync.Mutex
	failUntil := time.Time{}
	client.PrependReactor("get", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) {
		failing.Lock()
		defer failing.Unlock()
		if time.Now().Before(failUntil) {
			return true, nil, apierrors.NewServiceUnavailable("the API server is restarting")
		}
		return false, nil, nil
	})
	e.flags.NodeName = "node-1"
	a := e.agent(t, nodeagent.WithNodeClient(client))
	stop := run(t, a)
	defer stop()
	eventually(t, "the agent is ready", func() bool { ok, _ := a.Ready(); return ok })

	failing.Lock()
	failUntil = time.Now().Add(1500 * time.Millisecond) // beyond the watch's event, within two resyncs
	failing.Unlock()
	if err := client.Tracker().Delete(schema.GroupVersionResource{Version: "v1", Resource: "nodes"}, "", "node-1"); err != nil {
		t.Fatal(err)
	}
	eventually(t, "detour to leave the node once the deletion is confirmed", func() bool {
		ok, reason := a.Ready()
		_, err := os.Stat(filepath.Join(e.binDir, "detour-cni"))
		return ok && strings.Contains(reason, "Node object is deleted") && errors.Is(err, os.ErrNotExist) &&
			!slices.Contains(pluginTypes(t, readFile(t, primary)), "detour-cni")
	})
}

// Issue 34, defects 1 and 2: the agent follows its Node's updates, not only its readiness. A
// kubelet upgraded in place (no reboot) to one that mounts image volumes gets
// detour.dev/image-volumes=true; downgraded, the label comes off; a Node deleted and registered
// again that the watch sees as an update (a new object of the same name, without the marks)
// gets its labels back — all without the agent restarting.
func TestRunFollowsTheNodesUpdates(t *testing.T) {
	e := newEnv(t)
	writeFile(t, filepath.Join(e.confDir, "10-calico.conflist"), calico)
	node := func(uid, kubelet string, labels map[string]string) *corev1.Node {
		return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1", UID: types.UID(uid), Labels: labels},
			Status: corev1.NodeStatus{NodeInfo: corev1.NodeSystemInfo{KubeletVersion: kubelet, ContainerRuntimeVersion: "containerd://2.4.2"}}}
	}
	client := fake.NewClientset(node("uid-1", "v1.34.4", nil))
	nodes := client.CoreV1().Nodes()
	labels := func() map[string]string {
		n, err := nodes.Get(context.Background(), "node-1", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return n.Labels
	}
	update := func(change func(*corev1.Node)) {
		n, err := nodes.Get(context.Background(), "node-1", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		change(n)
		if _, err := nodes.Update(context.Background(), n, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	e.flags.NodeName = "node-1"
	a := e.agent(t, nodeagent.WithNodeClient(client))
	stop := run(t, a)
	defer stop()
	eventually(t, "the node marked ready, without image volumes (kubelet 1.34)", func() bool {
		l := labels()
		_, iv := l[annotations.ImageVolumesLabel]
		return l[annotations.CNIReadyLabel] == "true" && !iv
	})
	update(func(n *corev1.Node) { n.Status.NodeInfo.KubeletVersion = "v1.35.4" })
	eventually(t, "the kubelet upgraded in place: the image-volumes label", func() bool { return labels()[annotations.ImageVolumesLabel] == "true" })
	update(func(n *corev1.Node) { n.Status.NodeInfo.KubeletVersion = "v1.34.4" })
	eventually(t, "the kubelet downgraded: the label off", func() bool { _, iv := labels()[annotations.ImageVolumesLabel]; return !iv })
	update(func(n *corev1.Node) {
		n.Status.NodeInfo.KubeletVersion = "v1.37.2"
		n.UID, n.Labels, n.Annotations = "uid-2", nil, nil // registered again, seen as an update
	})
	eventually(t, "the node registered again: both labels back", func() bool {
		l := labels()
		return l[annotations.CNIReadyLabel] == "true" && l[annotations.ImageVolumesLabel] == "true"
	})

	// The runtime restarting: the kubelet reports its version "Unknown" (CI's soak met it, its
	// containerd restarted right after its kubelet). The node's software has not changed, so
	// the label stays: a kubelet restarted meanwhile would reject the running pods that select
	// it. The ready label taken off in the same update shows that the agent acted on it.
	update(func(n *corev1.Node) {
		n.Status.NodeInfo.ContainerRuntimeVersion = "containerd://Unknown"
		delete(n.Labels, annotations.CNIReadyLabel)
	})
	eventually(t, "the agent to mark the node again", func() bool { return labels()[annotations.CNIReadyLabel] == "true" })
	if labels()[annotations.ImageVolumesLabel] != "true" {
		t.Error("the image-volumes label went while the runtime's version was Unknown")
	}
}
