package certs

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

func testCertificates(t *testing.T, client *fake.Clientset, dir string) *Certificates {
	return &Certificates{
		Client: client, Namespace: "detour-system", SecretName: "detour-webhook-tls", ServiceName: "detour-webhook",
		WebhookConfiguration: "detour", CertDir: dir, CertName: "tls.crt", KeyName: "tls.key",
		Log: slog.New(slog.DiscardHandler),
	}
}

// verify checks that the files in dir are a key pair whose certificate the bundle trusts for
// the service's name.
func verify(t *testing.T, dir string, bundle []byte, at time.Time) *x509.Certificate {
	t.Helper()
	pair, err := tls.LoadX509KeyPair(filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"))
	if err != nil {
		t.Fatalf("load the written pair: %v", err)
	}
	leaf, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(bundle) {
		t.Fatal("the caBundle holds no certificate")
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots, DNSName: "detour-webhook.detour-system.svc", CurrentTime: at}); err != nil {
		t.Fatalf("the serving certificate does not verify against the caBundle: %v", err)
	}
	return leaf
}

func TestCertificates(t *testing.T) {
	ctx := context.Background()
	mwc := &admissionregistrationv1.MutatingWebhookConfiguration{
		ObjectMeta: metav1.ObjectMeta{Name: "detour"},
		Webhooks:   []admissionregistrationv1.MutatingWebhook{{Name: "inject.detour.dev"}, {Name: "other.detour.dev"}},
	}
	client := fake.NewClientset(mwc)
	dir := t.TempDir()
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	c := testCertificates(t, client, dir)
	c.now = func() time.Time { return now }

	if err := c.Ensure(ctx); err != nil {
		t.Fatal(err)
	}
	secret, err := client.CoreV1().Secrets("detour-system").Get(ctx, "detour-webhook-tls", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("the secret was not created: %v", err)
	}
	got, _ := client.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, "detour", metav1.GetOptions{})
	for _, w := range got.Webhooks {
		if !bytes.Equal(w.ClientConfig.CABundle, secret.Data[SecretCACert]) {
			t.Errorf("webhook %s caBundle not set", w.Name)
		}
	}
	first := verify(t, dir, secret.Data[SecretCACert], now)

	// A second replica, with its own empty directory, uses the same certificate.
	dir2 := t.TempDir()
	c2 := testCertificates(t, client, dir2)
	c2.now = c.now
	if err := c2.Ensure(ctx); err != nil {
		t.Fatal(err)
	}
	if second := verify(t, dir2, secret.Data[SecretCACert], now); !second.Equal(first) {
		t.Error("a second replica made a certificate of its own")
	}

	// Nothing changes until the renewal time; then the serving certificate is renewed under
	// the same CA.
	now = now.Add(200 * 24 * time.Hour)
	if err := c.Ensure(ctx); err != nil {
		t.Fatal(err)
	}
	if again := verify(t, dir, secret.Data[SecretCACert], now); !again.Equal(first) {
		t.Error("the certificate was renewed early")
	}
	now = now.Add(50 * 24 * time.Hour)
	if err := c.Ensure(ctx); err != nil {
		t.Fatal(err)
	}
	renewed, _ := client.CoreV1().Secrets("detour-system").Get(ctx, "detour-webhook-tls", metav1.GetOptions{})
	if !bytes.Equal(renewed.Data[SecretCACert], secret.Data[SecretCACert]) {
		t.Error("the CA changed with the serving certificate")
	}
	if leaf := verify(t, dir, renewed.Data[SecretCACert], now); leaf.Equal(first) {
		t.Error("the serving certificate was not renewed after two thirds of its life")
	}

	// A year before the CA expires, a new CA joins the caBundle; the serving certificate the
	// old CA signed goes on being served, although it is due, until the API server has had
	// time to learn the new CA.
	ca0 := parseCerts(secret.Data[SecretCACert])[0]
	rotation := ca0.NotAfter.Add(-caRenewBefore).Add(time.Minute)
	now = rotation.Add(-9 * 30 * 24 * time.Hour) // the last renewal under the old CA
	if err := c.Ensure(ctx); err != nil {
		t.Fatal(err)
	}
	lastOld := verify(t, dir, mwcBundle(t, client), now)
	now = rotation
	if err := c.Ensure(ctx); err != nil {
		t.Fatal(err)
	}
	rotated, _ := client.CoreV1().Secrets("detour-system").Get(ctx, "detour-webhook-tls", metav1.GetOptions{})
	if n := len(parseCerts(rotated.Data[SecretCACert])); n != 2 {
		t.Errorf("the caBundle holds %d CAs during the CA rotation, want 2", n)
	}
	if !bytes.Equal(mwcBundle(t, client), rotated.Data[SecretCACert]) {
		t.Error("the caBundle was not updated with the new CA")
	}
	if leaf := verify(t, dir, mwcBundle(t, client), now); !leaf.Equal(lastOld) {
		t.Error("the serving certificate was replaced in the same step that created the new CA")
	}
	now = rotation.Add(certResync)
	if err := c.Ensure(ctx); err != nil {
		t.Fatal(err)
	}
	if leaf := verify(t, dir, mwcBundle(t, client), now); !leaf.Equal(lastOld) {
		t.Error("the serving certificate was replaced before the new CA had been published for caPublishDelay")
	}
	now = rotation.Add(caPublishDelay + time.Minute)
	if err := c.Ensure(ctx); err != nil {
		t.Fatal(err)
	}
	ca1 := parseCerts(rotated.Data[SecretCACert])[0]
	if leaf := verify(t, dir, mwcBundle(t, client), now); leaf.CheckSignatureFrom(ca1) != nil {
		t.Error("the due serving certificate was not renewed under the new CA once it was published")
	}

	// The files are rewritten only when they change.
	info, _ := os.Stat(filepath.Join(dir, "tls.crt"))
	time.Sleep(10 * time.Millisecond)
	if err := c.Ensure(ctx); err != nil {
		t.Fatal(err)
	}
	if info2, _ := os.Stat(filepath.Join(dir, "tls.crt")); !info2.ModTime().Equal(info.ModTime()) {
		t.Error("an unchanged certificate was rewritten")
	}
}

// mwcBundle is the caBundle the API server uses: the webhook configuration's.
func mwcBundle(t *testing.T, client *fake.Clientset) []byte {
	t.Helper()
	mwc, err := client.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(context.Background(), "detour", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return mwc.Webhooks[0].ClientConfig.CABundle
}

func TestCertificatesMissingConfiguration(t *testing.T) {
	c := testCertificates(t, fake.NewClientset(), t.TempDir())
	if err := c.Ensure(context.Background()); err == nil || !bytes.Contains([]byte(err.Error()), []byte("MutatingWebhookConfiguration detour")) {
		t.Errorf("Ensure without the webhook configuration: %v", err)
	}
}
