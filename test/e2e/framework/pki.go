package framework

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"

	"k8s.io/client-go/rest"

	"github.com/detourmesh/detour/internal/controlplane"
)

// pki is the node's certificate authority and the files signed by it: one CA for the API
// server's clients and servers alike, as kubeadm's defaults have it, and the service-account
// key pair.
type pki struct {
	dir  string
	cert *x509.Certificate
	key  crypto.Signer
}

// identity is a client or server certificate to issue.
type identity struct {
	name   string // file name stem
	cn     string
	orgs   []string
	ips    []net.IP
	dns    []string
	server bool
}

func newPKI(dir string) (*pki, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "detour-e2e-ca"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	p := &pki{dir: dir, cert: cert, key: key}
	if err := p.write("ca.crt", "CERTIFICATE", der); err != nil {
		return nil, err
	}
	return p, p.writeKey("ca.key", key)
}

func (p *pki) path(name string) string { return filepath.Join(p.dir, name) }

func (p *pki) caPEM() []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: p.cert.Raw})
}

// issue writes <name>.crt and <name>.key.
func (p *pki) issue(id identity) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return err
	}
	usage := x509.ExtKeyUsageClientAuth
	if id.server {
		usage = x509.ExtKeyUsageServerAuth
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: id.cn, Organization: id.orgs},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{usage},
		IPAddresses:  id.ips,
		DNSNames:     id.dns,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.cert, key.Public(), p.key)
	if err != nil {
		return err
	}
	if err := p.write(id.name+".crt", "CERTIFICATE", der); err != nil {
		return err
	}
	return p.writeKey(id.name+".key", key)
}

// serviceAccountKeys writes sa.key and sa.pub, the pair the API server signs and verifies
// service-account tokens with.
func (p *pki) serviceAccountKeys() error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	pub, err := x509.MarshalPKIXPublicKey(key.Public())
	if err != nil {
		return err
	}
	if err := p.write("sa.pub", "PUBLIC KEY", pub); err != nil {
		return err
	}
	return p.writeKey("sa.key", key)
}

// restConfig is the client configuration of identity name against server.
func (p *pki) restConfig(server, name string) (*rest.Config, error) {
	certPEM, err := os.ReadFile(p.path(name + ".crt"))
	if err != nil {
		return nil, err
	}
	keyPEM, err := os.ReadFile(p.path(name + ".key"))
	if err != nil {
		return nil, err
	}
	return &rest.Config{
		Host:            server,
		TLSClientConfig: rest.TLSClientConfig{CAData: p.caPEM(), CertData: certPEM, KeyData: keyPEM},
	}, nil
}

// kubeconfig writes <name>.kubeconfig for identity name against server.
func (p *pki) kubeconfig(server, name string) (string, error) {
	cfg, err := p.restConfig(server, name)
	if err != nil {
		return "", err
	}
	path := p.path(name + ".kubeconfig")
	return path, controlplane.WriteKubeconfig(path, cfg)
}

func (p *pki) write(name, typ string, der []byte) error {
	return os.WriteFile(p.path(name), pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600)
}

func (p *pki) writeKey(name string, key *ecdsa.PrivateKey) error {
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	return p.write(name, "EC PRIVATE KEY", der)
}
