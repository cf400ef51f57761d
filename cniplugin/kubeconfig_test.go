package cniplugin

import (
	"encoding/base64"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func writeKubeconfig(t *testing.T, content string) string {
	t.Helper()
	dir := t.TempDir()
	path := filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestLoadKubeconfig(t *testing.T) {
	ca := base64.StdEncoding.EncodeToString([]byte("CA"))
	path := writeKubeconfig(t, `apiVersion: v1
kind: Config
current-context: cni
contexts:
- name: other
  context: {cluster: wrong, user: wrong}
- name: cni
  context: {cluster: k8s, user: detour-cni}
clusters:
- name: wrong
  cluster: {server: "https://wrong:1"}
- name: k8s
  cluster:
    server: https://10.96.0.1:443
    certificate-authority-data: `+ca+`
    tls-server-name: kubernetes.default.svc
users:
- name: wrong
  user: {token: nope}
- name: detour-cni
  user:
    tokenFile: detour-cni.token
`)
	server, cfg, err := loadKubeconfig(path)
	if err != nil {
		t.Fatal(err)
	}
	if server != "https://10.96.0.1:443" || string(cfg.TLS.CAData) != "CA" || cfg.TLS.ServerName != "kubernetes.default.svc" {
		t.Errorf("cluster = %s, %+v", server, cfg.TLS)
	}
	if cfg.BearerTokenFile != filepath.Join(filepath.Dir(path), "detour-cni.token") || cfg.BearerToken != "" {
		t.Errorf("a relative tokenFile is relative to the kubeconfig: %q", cfg.BearerTokenFile)
	}

	// One context and no current-context: that context.
	path = writeKubeconfig(t, `contexts: [{name: only, context: {cluster: c, user: u}}]
clusters: [{name: c, cluster: {server: "https://api:6443", certificate-authority: /etc/ca.crt}}]
users: [{name: u, user: {client-certificate: /etc/c.crt, client-key: /etc/c.key}}]`)
	if server, cfg, err := loadKubeconfig(path); err != nil || server != "https://api:6443" || cfg.TLS.CAFile != "/etc/ca.crt" || cfg.TLS.CertFile != "/etc/c.crt" || cfg.TLS.KeyFile != "/etc/c.key" {
		t.Errorf("loadKubeconfig = %s, %+v, %v", server, cfg, err)
	}
}

func TestLoadKubeconfigErrors(t *testing.T) {
	for _, tc := range []struct{ content, want string }{
		{"{", "parse"},
		{`current-context: x`, `no context "x"`},
		{`current-context: a
contexts: [{name: a, context: {cluster: c, user: u}}]`, `no cluster "c" with a server`},
		{`current-context: a
contexts: [{name: a, context: {cluster: c, user: u}}]
clusters: [{name: c, cluster: {server: "https://x"}}]
users: [{name: u, user: {exec: {command: aws}}}]`, "exec and auth-provider credentials are not supported"},
		{`current-context: a
contexts: [{name: a, context: {cluster: c, user: u}}]
clusters: [{name: c, cluster: {server: "https://x", certificate-authority-data: "!!"}}]`, "certificate-authority-data"},
	} {
		_, _, err := loadKubeconfig(writeKubeconfig(t, tc.content))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("loadKubeconfig(%q) = %v; want an error containing %q", tc.content, err, tc.want)
		}
	}
	if _, _, err := loadKubeconfig("/nonexistent/kubeconfig"); err == nil {
		t.Error("a missing file loaded")
	}
}

func FuzzLoadKubeconfig(f *testing.F) {
	f.Add([]byte("current-context: a\ncontexts: [{name: a, context: {cluster: c, user: u}}]\nclusters: [{name: c, cluster: {server: \"https://x\"}}]\nusers: [{name: u, user: {tokenFile: t}}]\n"))
	f.Add([]byte("{}"))
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, b []byte) {
		path := filepath.Join(dir, "kubeconfig")
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
		server, cfg, err := loadKubeconfig(path)
		if err == nil && (server == "" || cfg == nil) {
			t.Fatalf("accepted a kubeconfig without a server: %q", b)
		}
	})
}
