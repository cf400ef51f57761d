package webhook

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// The expiry of the certificate on disk, read at each scrape: a rotation shows at once, and a
// missing or broken file exposes nothing rather than a wrong date.
func TestCertificateExpiry(t *testing.T) {
	path := filepath.Join(t.TempDir(), "tls.crt")
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(CertificateExpiry(path))
	if n, err := testutil.GatherAndCount(reg); err != nil || n != 0 {
		t.Fatalf("without a certificate: %d series, %v; want none", n, err)
	}
	for _, notAfter := range []time.Time{time.Unix(1_900_000_000, 0), time.Unix(1_950_000_000, 0)} {
		writeCert(t, path, notAfter)
		families, err := reg.Gather()
		if err != nil || len(families) != 1 {
			t.Fatalf("gather: %v, %v", families, err)
		}
		if got := families[0].GetMetric()[0].GetGauge().GetValue(); got != float64(notAfter.Unix()) {
			t.Errorf("detour_webhook_certificate_expiry_timestamp_seconds = %v, want %d", got, notAfter.Unix())
		}
	}
	if err := os.WriteFile(path, []byte("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if n, err := testutil.GatherAndCount(reg); err != nil || n != 0 {
		t.Fatalf("with a broken certificate: %d series, %v; want none", n, err)
	}
}

func writeCert(t *testing.T, path string, notAfter time.Time) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "detour-webhook"},
		NotBefore: notAfter.Add(-time.Hour), NotAfter: notAfter}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}
