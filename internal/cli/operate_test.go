package cli

import (
	"os"
	"path/filepath"
	"testing"

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
		rc, err := restConfig(kubeconfig, command)
		if err != nil {
			t.Fatal(err)
		}
		if rc.UserAgent != want {
			t.Errorf("restConfig(%q).UserAgent = %q, want %q", command, rc.UserAgent, want)
		}
	}
}
