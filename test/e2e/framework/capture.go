package framework

import (
	"context"
	"encoding/json"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// AssertCaptured checks both directions of pod's redirect: a connection from the node to
// the app's port reaches the app through the proxy's inbound listener, and the app's own
// dial to the test server went through the proxy to the right original destination.
func (e *Env) AssertCaptured(t testing.TB, ctx context.Context, p corev1.Pod, app string) {
	t.Helper()
	// Ready does not mean the app serves yet: the readiness probe's connection is captured by
	// the proxy's inbound listener like any other, so wait for the app's reply.
	var reply string
	err := Poll(ctx, 30*time.Second, func() (bool, error) {
		conn, err := e.Node.Dial(ctx, "tcp", net.JoinHostPort(p.Status.PodIP, "8080"))
		if err != nil {
			return false, err
		}
		defer conn.Close()
		buf := make([]byte, 512)
		conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		n, err := conn.Read(buf)
		reply = string(buf[:n])
		return reply != "", Seen("no reply: %v", err)
	})
	if err != nil {
		t.Fatalf("the app of %s never replied on %s:8080: %v", p.Name, p.Status.PodIP, err)
	}
	if !e.Proxy.Proxied(reply) {
		t.Errorf("the app of %s saw a connection that did not come through the %s proxy: %q", p.Name, e.Proxy.Name, reply)
	}
	// HAProxy logs a connection when it ends.
	var proxyLog string
	Poll(ctx, 15*time.Second, func() (bool, error) { // the checks below say what was missing
		proxyLog = e.Logs(ctx, p.Namespace, p.Name, "detour-proxy")
		return e.Proxy.InboundLogged(proxyLog) && e.Proxy.OutboundLogged(proxyLog, e.Server), nil
	})
	if !e.Proxy.InboundLogged(proxyLog) {
		t.Errorf("the proxy of %s logged no inbound connection:\n%s", p.Name, proxyLog)
	}
	if !e.Proxy.OutboundLogged(proxyLog, e.Server) {
		t.Errorf("the proxy of %s did not carry the app's connection to %s:\n%s", p.Name, e.Server, proxyLog)
	}
}

// PluginEntry is one line of detour-cni's log (JSON, one per command), with the fields the
// stories read: when, which CNI command for which pod (namespace/name), the plugin's decision
// (e.g. "redirected"), where it read the pod's annotations from ("runtimeConfig"), how long
// it took, and its error.
type PluginEntry struct {
	Time        time.Time `json:"time"`
	Command     string    `json:"command"`
	Pod         string    `json:"pod"`
	Decision    string    `json:"decision"`
	Annotations string    `json:"annotations"`
	Duration    string    `json:"duration"`
	Error       string    `json:"error"`
}

// PluginLog returns the entries of detour-cni's log on the control-plane node for command;
// decision, when set, must match.
func (e *Env) PluginLog(t testing.TB, command, decision string) []PluginEntry {
	t.Helper()
	return PluginLogAt(e.PluginLogPath(), command, decision)
}

// PluginLogAt is [Env.PluginLog] of the detour-cni log at path (another node's:
// [NodePluginLog]).
func PluginLogAt(path, command, decision string) []PluginEntry {
	var out []PluginEntry
	for line := range strings.SplitSeq(ReadFile(path), "\n") {
		var l PluginEntry
		if json.Unmarshal([]byte(line), &l) != nil {
			continue
		}
		if l.Command == command && (decision == "" || l.Decision == decision) {
			out = append(out, l)
		}
	}
	return out
}

// PluginLogPath is detour-cni's log on the control-plane node.
func (e *Env) PluginLogPath() string { return NodePluginLog(e.Node) }

// NodePluginLog is detour-cni's log on node n (the chart's plugin.logFile, each node's own).
func NodePluginLog(n *Node) string { return filepath.Join(n.Dir, "logs", "detour-cni.log") }
