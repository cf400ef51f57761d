package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/detourmesh/detour/test/e2e/framework"
)

// seed002NoNsenter: the runtime runs every plugin with a PATH that holds no nsenter and
// nothing else of util-linux, and the stories before it (TestE2E) ran on it.
func seed002NoNsenter(t *testing.T, ctx context.Context, e *framework.Env) {
	pid := e.Node.PID("containerd")
	environ, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
	if err != nil {
		t.Fatal(err)
	}
	var path string
	for kv := range strings.SplitSeq(string(environ), "\x00") {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			path = v
		}
	}
	if path == "" {
		t.Fatalf("containerd (pid %d) has no PATH", pid)
	}
	for dir := range strings.SplitSeq(path, ":") {
		entries, err := os.ReadDir(dir)
		if err != nil {
			continue
		}
		for _, ent := range entries {
			switch name := ent.Name(); {
			case name == "nsenter", name == "unshare", name == "mount", name == "setpriv":
				t.Errorf("containerd's PATH %s holds %s/%s", path, dir, name)
			}
		}
	}
	if added := e.PluginLog(t, "ADD", "redirected"); len(added) == 0 {
		t.Errorf("detour-cni installed no redirect on this node; log:\n%s", framework.Tail(framework.ReadFile(e.PluginLogPath()), 20))
	}
}

// runtimeAnnotations: containerd hands the pod's annotations to detour-cni (the plugin's log
// names that source) and the API server sees no GET of a pod from the plugin.
func runtimeAnnotations(t *testing.T, ctx context.Context, e *framework.Env) {
	added := e.PluginLog(t, "ADD", "redirected")
	if len(added) == 0 {
		t.Fatal("no ADD installed a redirect yet")
	}
	for _, l := range added {
		if l.Annotations != "runtimeConfig" {
			t.Errorf("the ADD of %s read the annotations from %q, not from the runtime", l.Pod, l.Annotations)
		}
	}
	audit := framework.ReadFile(e.Node.AuditLogPath())
	var gets int
	for line := range strings.SplitSeq(audit, "\n") {
		var ev struct {
			Verb string `json:"verb"`
			User struct {
				Username string `json:"username"`
			} `json:"user"`
		}
		if json.Unmarshal([]byte(line), &ev) != nil {
			continue
		}
		if ev.Verb == "get" && ev.User.Username == "system:serviceaccount:"+framework.DetourNamespace+":detour-cni" {
			gets++
		}
	}
	if gets != 0 {
		t.Errorf("the API server saw %d GETs of pods by detour-cni; want 0 (annotations come from the runtime)", gets)
	}
	if strings.Count(audit, "\n") == 0 {
		t.Error("the audit log is empty: the check above proves nothing")
	}
	// containerd polls STATUS; the node's network stays ready.
	if status := e.PluginLog(t, "STATUS", "ready"); len(status) == 0 {
		t.Errorf("containerd never called STATUS (or detour-cni logged none)")
	}
	// containerd 2.4 never calls CHECK or GC (docs/cni-plugin.md says so).
	for _, cmd := range []string{"CHECK", "GC"} {
		if n := len(e.PluginLog(t, cmd, "")); n != 0 {
			t.Errorf("containerd called %s %d times; docs/cni-plugin.md says it never does", cmd, n)
		}
	}
}
