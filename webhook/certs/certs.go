// Package certs keeps the webhook's own certificate authority and serving certificate in a
// Secret shared by the replicas, writes the serving pair for the server's certificate watcher
// and keeps the MutatingWebhookConfiguration's caBundle current ([Certificates]).
package certs

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"log/slog"
	"math/big"
	"path/filepath"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"

	"github.com/detourmesh/detour/inject"
	"github.com/detourmesh/detour/internal/fsutil"
)

// Keys of the certificate Secret.
const (
	SecretCACert = "ca.crt"
	SecretCAKey  = "ca.key"
	SecretCert   = corev1.TLSCertKey       // tls.crt
	SecretKey    = corev1.TLSPrivateKeyKey // tls.key
)

// Lifetimes of the self-managed certificates, and when they are renewed.
const (
	caLifetime        = 10 * 365 * 24 * time.Hour
	servingLifetime   = 365 * 24 * time.Hour
	caRenewBefore     = 365 * 24 * time.Hour
	servingRenewAfter = 2 * servingLifetime / 3
	certResync        = 10 * time.Minute
	// caPublishDelay is how long a new CA is in the caBundle before it signs a serving
	// certificate that replaces a valid one, so that the API server trusts the new certificate
	// before any replica serves it.
	caPublishDelay = 2 * certResync
	// backdate is how far NotBefore lies in the past, for clock skew between the replicas and
	// the API server.
	backdate = time.Hour
)

// Certificates keeps the webhook's own CA and serving certificate (the Helm chart's
// certificates.mode "detour", which needs no cert-manager): they live in one Secret shared by
// every replica; each replica writes the serving pair into its certificate directory, where the
// server's watcher picks it up, and keeps the MutatingWebhookConfiguration's caBundle current.
// The serving certificate is renewed after two thirds of its year, the CA a year before it
// expires. A new CA joins the caBundle next to the old one (until the old one expires), and
// the caBundle is published before the serving files are written; a serving certificate that is
// still valid is replaced by one the new CA signs only after caPublishDelay, so the API server
// never meets a certificate it does not trust yet.
type Certificates struct {
	Client kubernetes.Interface
	// Namespace and SecretName name the Secret.
	Namespace, SecretName string
	// ServiceName is the webhook's Service; the certificate is valid for its DNS names.
	ServiceName string
	// WebhookConfiguration is the MutatingWebhookConfiguration whose caBundle is kept current.
	WebhookConfiguration string
	// CertDir, CertName and KeyName are where the serving pair is written.
	CertDir, CertName, KeyName string
	Log                        *slog.Logger

	now func() time.Time
}

func (c *Certificates) clock() time.Time {
	if c.now != nil {
		return c.now()
	}
	return time.Now()
}

// DNSNames are the names the serving certificate is valid for.
func (c *Certificates) DNSNames() []string {
	s, ns := c.ServiceName, c.Namespace
	return []string{s, s + "." + ns, s + "." + ns + ".svc", s + "." + ns + ".svc.cluster.local"}
}

// Ensure makes the Secret hold a valid CA and serving certificate (creating or renewing them),
// writes the serving pair to the certificate directory when it changed, and sets the
// caBundle of every webhook of the configuration.
func (c *Certificates) Ensure(ctx context.Context) error {
	var secret *corev1.Secret
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		s, err := c.Client.CoreV1().Secrets(c.Namespace).Get(ctx, c.SecretName, metav1.GetOptions{})
		exists := err == nil
		switch {
		case apierrors.IsNotFound(err):
			s = &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: c.SecretName, Namespace: c.Namespace,
				Labels: map[string]string{inject.PartOfLabel: inject.PartOfValue}}, Type: corev1.SecretTypeOpaque}
		case err != nil:
			return fmt.Errorf("read secret %s/%s: %w", c.Namespace, c.SecretName, err)
		}
		changed, err := c.renew(s)
		if err != nil {
			return err
		}
		switch {
		case !changed:
			secret = s
			return nil
		case !exists:
			if secret, err = c.Client.CoreV1().Secrets(c.Namespace).Create(ctx, s, metav1.CreateOptions{}); apierrors.IsAlreadyExists(err) {
				// Another replica created it first: read theirs.
				return apierrors.NewConflict(corev1.Resource("secrets"), c.SecretName, err)
			}
		default:
			secret, err = c.Client.CoreV1().Secrets(c.Namespace).Update(ctx, s, metav1.UpdateOptions{})
		}
		if err == nil {
			c.Log.Info("renewed the webhook certificate", "secret", c.Namespace+"/"+c.SecretName)
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("keep the webhook certificate in secret %s/%s: %w", c.Namespace, c.SecretName, err)
	}
	if err := c.setCABundle(ctx, secret.Data[SecretCACert]); err != nil {
		return err
	}
	return c.writeFiles(secret)
}

// renew fills in or renews the certificates in s; it reports whether it changed anything.
func (c *Certificates) renew(s *corev1.Secret) (bool, error) {
	now := c.clock()
	if s.Data == nil {
		s.Data = map[string][]byte{}
	}
	bundle := parseCerts(s.Data[SecretCACert])
	caKey := parseKey(s.Data[SecretCAKey])
	changed := false
	if len(bundle) == 0 || caKey == nil || now.Add(caRenewBefore).After(bundle[0].NotAfter) || !sameKey(bundle[0], caKey) {
		ca, key, err := newCA(now)
		if err != nil {
			return false, err
		}
		trusted := pemCert(ca)
		// The old CA stays in the bundle next to the new one until it expires: the API server
		// trusts one caBundle for every replica, and until each replica has picked up a
		// serving certificate the new CA signs (renewal waits caPublishDelay for that), some
		// still serve one the old CA signed; dropping it now would fail their admissions.
		if len(bundle) > 0 && now.Before(bundle[0].NotAfter) {
			trusted = append(trusted, pemCert(bundle[0])...)
		}
		s.Data[SecretCACert], s.Data[SecretCAKey] = trusted, pemKey(key)
		bundle, caKey = parseCerts(trusted), key
		changed = true
	}
	ca := bundle[0]
	if leaf := c.usableServing(s, bundle, now); leaf != nil &&
		(now.Before(leaf.NotBefore.Add(servingRenewAfter)) || now.Before(ca.NotBefore.Add(backdate+caPublishDelay))) {
		return changed, nil
	}
	cert, key, err := newServing(now, ca, caKey, c.DNSNames())
	if err != nil {
		return false, err
	}
	s.Data[SecretCert], s.Data[SecretKey] = pemCert(cert), pemKey(key)
	return true, nil
}

// usableServing returns the serving certificate in s when it can go on being served: it
// parses with its key, is valid now for the service's names, and a CA of the bundle signed it.
func (c *Certificates) usableServing(s *corev1.Secret, bundle []*x509.Certificate, now time.Time) *x509.Certificate {
	serving := parseCerts(s.Data[SecretCert])
	key := parseKey(s.Data[SecretKey])
	if len(serving) == 0 || key == nil || !sameKey(serving[0], key) ||
		now.After(serving[0].NotAfter) || !slices.Equal(serving[0].DNSNames, c.DNSNames()) {
		return nil
	}
	leaf := serving[0]
	if !slices.ContainsFunc(bundle, func(ca *x509.Certificate) bool {
		return now.Before(ca.NotAfter) && leaf.CheckSignatureFrom(ca) == nil
	}) {
		return nil
	}
	return leaf
}

// writeFiles writes the serving pair into the certificate directory, atomically and only when
// it changed.
func (c *Certificates) writeFiles(s *corev1.Secret) error {
	for _, f := range []struct {
		name string
		data []byte
	}{{c.KeyName, s.Data[SecretKey]}, {c.CertName, s.Data[SecretCert]}} {
		if _, err := fsutil.WriteFileAtomic(filepath.Join(c.CertDir, f.name), f.data, 0o600); err != nil {
			return fmt.Errorf("write the webhook certificate: %w", err)
		}
	}
	return nil
}

// setCABundle sets caBundle on every webhook of the configuration that lacks it.
func (c *Certificates) setCABundle(ctx context.Context, bundle []byte) error {
	if c.WebhookConfiguration == "" {
		return nil
	}
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		mwc, err := c.Client.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, c.WebhookConfiguration, metav1.GetOptions{})
		if err != nil {
			return err
		}
		changed := false
		for i := range mwc.Webhooks {
			if !bytes.Equal(mwc.Webhooks[i].ClientConfig.CABundle, bundle) {
				mwc.Webhooks[i].ClientConfig.CABundle = bundle
				changed = true
			}
		}
		if !changed {
			return nil
		}
		_, err = c.Client.AdmissionregistrationV1().MutatingWebhookConfigurations().Update(ctx, mwc, metav1.UpdateOptions{})
		if err == nil {
			c.Log.Info("set the caBundle of the webhook configuration", "configuration", c.WebhookConfiguration)
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("set the caBundle of MutatingWebhookConfiguration %s: %w", c.WebhookConfiguration, err)
	}
	return nil
}

// Run ensures the certificates every resync period until ctx ends; failures are logged and
// retried at the next period (the certificate in use stays valid for months).
func (c *Certificates) Run(ctx context.Context) error {
	t := time.NewTicker(certResync)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			if err := c.Ensure(ctx); err != nil && ctx.Err() == nil {
				c.Log.Error("keep the webhook certificate", "error", err)
			}
		}
	}
}

func newCA(now time.Time) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	cert, key, err := issue(&x509.Certificate{
		Subject:               pkix.Name{CommonName: "detour webhook CA"},
		NotBefore:             now.Add(-backdate),
		NotAfter:              now.Add(caLifetime),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}, nil, nil)
	if err != nil {
		return nil, nil, fmt.Errorf("create the webhook CA: %w", err)
	}
	return cert, key, nil
}

func newServing(now time.Time, ca *x509.Certificate, caKey *ecdsa.PrivateKey, names []string) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	cert, key, err := issue(&x509.Certificate{
		Subject:     pkix.Name{CommonName: names[0]},
		DNSNames:    names,
		NotBefore:   now.Add(-backdate),
		NotAfter:    now.Add(servingLifetime),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}, ca, caKey)
	if err != nil {
		return nil, nil, fmt.Errorf("create the webhook serving certificate: %w", err)
	}
	return cert, key, nil
}

// issue makes a fresh P-256 key and the certificate of tmpl for it, with a random serial number,
// signed by parent's key — or by the new key itself when parent is nil.
func issue(tmpl, parent *x509.Certificate, parentKey *ecdsa.PrivateKey) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	if tmpl.SerialNumber, err = rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120)); err != nil {
		return nil, nil, err
	}
	if parent == nil {
		parent, parentKey = tmpl, key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, key.Public(), parentKey)
	if err != nil {
		return nil, nil, err
	}
	cert, err := x509.ParseCertificate(der)
	return cert, key, err
}

func pemCert(c *x509.Certificate) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})
}

func pemKey(k *ecdsa.PrivateKey) []byte {
	der, err := x509.MarshalECPrivateKey(k)
	if err != nil {
		panic(err) // a P-256 key always marshals
	}
	return pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})
}

func parseCerts(b []byte) []*x509.Certificate {
	var out []*x509.Certificate
	for {
		var block *pem.Block
		block, b = pem.Decode(b)
		if block == nil {
			return out
		}
		if c, err := x509.ParseCertificate(block.Bytes); err == nil {
			out = append(out, c)
		}
	}
}

func parseKey(b []byte) *ecdsa.PrivateKey {
	block, _ := pem.Decode(b)
	if block == nil {
		return nil
	}
	k, err := x509.ParseECPrivateKey(block.Bytes)
	if err != nil {
		return nil
	}
	return k
}

func sameKey(c *x509.Certificate, k *ecdsa.PrivateKey) bool {
	pub, ok := c.PublicKey.(*ecdsa.PublicKey)
	return ok && pub.Equal(&k.PublicKey)
}
