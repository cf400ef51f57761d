package cli

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"k8s.io/client-go/rest"

	"github.com/detourmesh/detour/internal/version"
)

// Each long-running command names itself in its requests' user agent, so that the API server's
// audit log tells install-cni and repair apart although they share the node agent's service
// account.
func TestRestConfigUserAgentNamesTheCommand(t *testing.T) {
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	err := os.WriteFile(kubeconfig, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:6443"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
`), 0o600)
	if err != nil {
		t.Fatal(err)
	}
	for command, want := range map[string]string{
		"install-cni": "detour-install-cni/" + version.Version,
		"repair":      "detour-repair/" + version.Version,
		"webhook":     "detour-webhook/" + version.Version,
	} {
		rc, err := restConfig(context.Background(), kubeconfig, command)
		if err != nil {
			t.Fatal(err)
		}
		if rc.UserAgent != want {
			t.Errorf("restConfig(%q).UserAgent = %q, want %q", command, rc.UserAgent, want)
		}
	}
}

// An embedded command takes its host's API configuration, as a copy with its own user agent.
func TestRestConfigEmbedded(t *testing.T) {
	host := &rest.Config{Host: "https://10.0.0.1:6443", BearerTokenFile: "/nodes/n1/token"}
	ctx := WithEmbedded(context.Background(), Embedded{API: host})
	rc, err := restConfig(ctx, "/ignored/kubeconfig", "repair")
	if err != nil {
		t.Fatal(err)
	}
	if rc == host || rc.Host != host.Host || rc.BearerTokenFile != host.BearerTokenFile {
		t.Errorf("restConfig embedded = %+v, want a copy of %+v", rc, host)
	}
	if want := "detour-repair/" + version.Version; rc.UserAgent != want || host.UserAgent != "" {
		t.Errorf("user agents: the command's %q (want %q), the host's %q (want it untouched)", rc.UserAgent, want, host.UserAgent)
	}
}
