package cniplugin

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/pem"
	"fmt"
	"io"
	"log"
	"math/big"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
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
	a, err := loadKubeconfig(path)
	if err != nil {
		t.Fatal(err)
	}
	if a.Server != "https://10.96.0.1:443" || string(a.CAData) != "CA" || a.ServerName != "kubernetes.default.svc" {
		t.Errorf("cluster = %+v", a)
	}
	if a.TokenFile != filepath.Join(filepath.Dir(path), "detour-cni.token") || a.Token != "" {
		t.Errorf("a relative tokenFile is relative to the kubeconfig: %q", a.TokenFile)
	}

	// One context and no current-context: that context.
	path = writeKubeconfig(t, `contexts: [{name: only, context: {cluster: c, user: u}}]
clusters: [{name: c, cluster: {server: "https://api:6443", certificate-authority: /etc/ca.crt}}]
users: [{name: u, user: {client-certificate: /etc/c.crt, client-key: /etc/c.key}}]`)
	if a, err := loadKubeconfig(path); err != nil || a.Server != "https://api:6443" || a.CAFile != "/etc/ca.crt" || a.CertFile != "/etc/c.crt" || a.KeyFile != "/etc/c.key" {
		t.Errorf("loadKubeconfig = %+v, %v", a, err)
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
		{`current-context: a
contexts: [{name: a, context: {cluster: c, user: nobody}}]
clusters: [{name: c, cluster: {server: "https://x"}}]
users: [{name: u, user: {token: t}}]`, `no user "nobody"`},
	} {
		_, err := loadKubeconfig(writeKubeconfig(t, tc.content))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("loadKubeconfig(%q) = %v; want an error containing %q", tc.content, err, tc.want)
		}
	}
	if _, err := loadKubeconfig("/nonexistent/kubeconfig"); err == nil {
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
		a, err := loadKubeconfig(path)
		if err == nil && (a == nil || a.Server == "") {
			t.Fatalf("accepted a kubeconfig without a server: %q", b)
		}
	})
}

// The GET reaches a TLS server that the kubeconfig's CA file vouches for, with the token read
// from its tokenFile, and presents the client certificate when the server asks for one.
func TestAPIGetterCredentials(t *testing.T) {
	var gotAuth string
	var gotClientCert bool
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		gotAuth = r.Header.Get("Authorization")
		gotClientCert = len(r.TLS.PeerCertificates) > 0
		fmt.Fprint(w, `{"metadata":{"uid":"u-1","annotations":{"detour.dev/injected":"v1"}}}`)
	}))
	srv.TLS = &tls.Config{ClientAuth: tls.RequestClientCert}
	srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	srv.StartTLS()
	t.Cleanup(srv.Close)
	dir := t.TempDir()
	caPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
	write := func(name, content string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("ca.crt", string(caPEM))
	write("token", "file-token\n")
	certPEM, keyPEM := clientPair(t)
	write("client.crt", string(certPEM))
	write("client.key", string(keyPEM))

	write("empty-token", "\n")
	wrongCA, _ := clientPair(t)
	write("wrong-ca.crt", string(wrongCA))
	caData := base64.StdEncoding.EncodeToString(caPEM)
	const ca = "certificate-authority: ca.crt"
	for _, tc := range []struct {
		name, cluster, user, wantAuth string
		wantCert                      bool
	}{
		{"token file wins over an inline token", ca, "{token: inline, tokenFile: token}", "Bearer file-token", false},
		{"inline token", ca, "{token: inline}", "Bearer inline", false},
		{"an inline token stands in for an empty token file", ca, "{token: inline, tokenFile: empty-token}", "Bearer inline", false},
		{"an inline token stands in for a missing token file", ca, "{token: inline, tokenFile: missing}", "Bearer inline", false},
		{"client certificate files", ca, "{client-certificate: client.crt, client-key: client.key}", "", true},
		{"CA data wins over a CA file", "certificate-authority: wrong-ca.crt, certificate-authority-data: " + caData, "{token: t}", "Bearer t", false},
		{"tls-server-name names a name the certificate holds", ca + ", tls-server-name: example.com", "{token: t}", "Bearer t", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			write("kubeconfig", `current-context: a
contexts: [{name: a, context: {cluster: c, user: u}}]
clusters: [{name: c, cluster: {server: "`+srv.URL+`", `+tc.cluster+`}}]
users: [{name: u, user: `+tc.user+`}]`)
			g, err := newAPIGetter(filepath.Join(dir, "kubeconfig"), 5*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			meta, err := g.GetPod(context.Background(), "shop", "web")
			if err != nil {
				t.Fatal(err)
			}
			if meta.UID != "u-1" || meta.Annotations["detour.dev/injected"] != "v1" {
				t.Errorf("GetPod = %+v", meta)
			}
			if gotAuth != tc.wantAuth || gotClientCert != tc.wantCert {
				t.Errorf("the server saw Authorization %q and a client certificate %v; want %q and %v", gotAuth, gotClientCert, tc.wantAuth, tc.wantCert)
			}
		})
	}

	// A CA that did not sign the server's certificate, or a server name it does not hold: the
	// GET fails on TLS at once, never insecurely.
	for _, cluster := range []string{"certificate-authority: wrong-ca.crt", ca + ", tls-server-name: api.example.org"} {
		write("kubeconfig", `current-context: a
contexts: [{name: a, context: {cluster: c, user: u}}]
clusters: [{name: c, cluster: {server: "`+srv.URL+`", `+cluster+`}}]
users: [{name: u, user: {token: t}}]`)
		g, err := newAPIGetter(filepath.Join(dir, "kubeconfig"), time.Second)
		if err != nil {
			t.Fatal(err)
		}
		_, err = g.GetPod(context.Background(), "shop", "web")
		if err == nil || !strings.Contains(err.Error(), "certificate") || !strings.Contains(err.Error(), "in 1 attempt within") {
			t.Errorf("GetPod with %s = %v, want a certificate error after one attempt", cluster, err)
		}
	}

	// proxy-url: the GET goes through that proxy (which refuses it here).
	var connectTo string
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodConnect {
			connectTo = r.Host
		}
		w.WriteHeader(http.StatusForbidden)
	}))
	t.Cleanup(proxy.Close)
	write("kubeconfig", `current-context: a
contexts: [{name: a, context: {cluster: c, user: u}}]
clusters: [{name: c, cluster: {server: "`+srv.URL+`", `+ca+`, proxy-url: "`+proxy.URL+`"}}]
users: [{name: u, user: {token: t}}]`)
	g, err := newAPIGetter(filepath.Join(dir, "kubeconfig"), 300*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := g.GetPod(context.Background(), "shop", "web"); err == nil || connectTo != strings.TrimPrefix(srv.URL, "https://") {
		t.Errorf("GetPod through proxy-url: %v; the proxy saw CONNECT %q", err, connectTo)
	}
}

func TestAPIGetterCredentialErrors(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "junk.crt"), []byte("not PEM"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ cluster, user, want string }{
		{`{server: "https://x", certificate-authority: missing.crt}`, `{token: t}`, "certificate-authority: open " + filepath.Join(dir, "missing.crt")},
		{`{server: "https://x", certificate-authority: junk.crt}`, `{token: t}`, "holds no PEM certificate"},
		{`{server: "https://x", certificate-authority: junk.crt, insecure-skip-tls-verify: true}`, `{token: t}`, "exclude each other"},
		{`{server: "https://x"}`, `{tokenFile: missing}`, "token file: open " + filepath.Join(dir, "missing")},
		{`{server: "https://x"}`, `{tokenFile: junk.crt, username: u}`, "username and password are not supported"},
		{`{server: "https://x", proxy-url: "::"}`, `{token: t}`, `proxy-url "::" is not a URL`},
		{`{server: "https://x"}`, `{client-certificate: junk.crt, client-key: junk.crt}`, "client certificate"},
		{`{server: "not a url"}`, `{token: t}`, `server "not a url" is not a URL`},
	} {
		path := filepath.Join(dir, "kubeconfig")
		content := "current-context: a\ncontexts: [{name: a, context: {cluster: c, user: u}}]\nclusters: [{name: c, cluster: " + tc.cluster + "}]\nusers: [{name: u, user: " + tc.user + "}]"
		if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := newAPIGetter(path, time.Second); err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), path) {
			t.Errorf("newAPIGetter(%s, %s) = %v; want an error naming the kubeconfig and %q", tc.cluster, tc.user, err, tc.want)
		}
	}
}

// clientPair is a self-signed certificate and its key, PEM encoded.
func clientPair(t *testing.T) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "detour-cni"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})
}
