package cniplugin

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"sigs.k8s.io/yaml"
)

// kubeconfig is the part of a kubeconfig file the plugin uses: the current context's server,
// its CA and proxy, and a token, token file or client certificate. Exec and auth-provider
// credentials are refused: the node agent writes a token-file kubeconfig, and a plugin that runs
// for every pod should not start other programs to authenticate. So are a username and password
// (no API server accepts basic authentication since Kubernetes 1.19).
type kubeconfig struct {
	CurrentContext string `json:"current-context"`
	Contexts       []struct {
		Name    string `json:"name"`
		Context struct {
			Cluster  string `json:"cluster"`
			AuthInfo string `json:"user"`
		} `json:"context"`
	} `json:"contexts"`
	Clusters []struct {
		Name    string `json:"name"`
		Cluster struct {
			Server                   string `json:"server"`
			CertificateAuthority     string `json:"certificate-authority"`
			CertificateAuthorityData string `json:"certificate-authority-data"`
			InsecureSkipTLSVerify    bool   `json:"insecure-skip-tls-verify"`
			TLSServerName            string `json:"tls-server-name"`
			ProxyURL                 string `json:"proxy-url"`
		} `json:"cluster"`
	} `json:"clusters"`
	Users []struct {
		Name string `json:"name"`
		User struct {
			Token                 string `json:"token"`
			TokenFile             string `json:"tokenFile"`
			ClientCertificate     string `json:"client-certificate"`
			ClientCertificateData string `json:"client-certificate-data"`
			ClientKey             string `json:"client-key"`
			ClientKeyData         string `json:"client-key-data"`
			Username              string `json:"username"`
			Password              string `json:"password"`
			Exec                  any    `json:"exec"`
			AuthProvider          any    `json:"auth-provider"`
		} `json:"user"`
	} `json:"users"`
}

// apiAccess is what the plugin takes from a kubeconfig: the API server's URL and how to reach
// and authenticate to it. Its file paths are absolute.
type apiAccess struct {
	Server            string
	CAFile            string
	CAData            []byte
	Insecure          bool
	ServerName        string
	ProxyURL          string // empty: the environment's proxy settings
	Token, TokenFile  string
	CertFile, KeyFile string
	CertData, KeyData []byte
}

// loadKubeconfig reads the current context of the kubeconfig at path. Relative file paths in it
// are relative to its directory, as kubectl resolves them.
func loadKubeconfig(path string) (*apiAccess, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var kc kubeconfig
	if err := yaml.Unmarshal(data, &kc); err != nil {
		return nil, fmt.Errorf("parse: %w", err)
	}
	ctxName := kc.CurrentContext
	if ctxName == "" && len(kc.Contexts) == 1 {
		ctxName = kc.Contexts[0].Name
	}
	var clusterName, userName string
	found := false
	for _, c := range kc.Contexts {
		if c.Name == ctxName {
			clusterName, userName, found = c.Context.Cluster, c.Context.AuthInfo, true
		}
	}
	if !found {
		return nil, fmt.Errorf("no context %q", ctxName)
	}
	dir := filepath.Dir(path)
	abs := func(p string) string {
		if p == "" || filepath.IsAbs(p) {
			return p
		}
		return filepath.Join(dir, p)
	}
	a := &apiAccess{}
	found = false
	for _, c := range kc.Clusters {
		if c.Name != clusterName {
			continue
		}
		found = true
		a.Server = c.Cluster.Server
		a.CAFile = abs(c.Cluster.CertificateAuthority)
		a.Insecure = c.Cluster.InsecureSkipTLSVerify
		a.ServerName = c.Cluster.TLSServerName
		a.ProxyURL = c.Cluster.ProxyURL
		if a.CAData, err = decode(c.Cluster.CertificateAuthorityData); err != nil {
			return nil, fmt.Errorf("cluster %q: certificate-authority-data: %w", clusterName, err)
		}
	}
	if !found || a.Server == "" {
		return nil, fmt.Errorf("no cluster %q with a server", clusterName)
	}
	found = false
	for _, u := range kc.Users {
		if u.Name != userName {
			continue
		}
		found = true
		if u.User.Exec != nil || u.User.AuthProvider != nil {
			return nil, errors.New("exec and auth-provider credentials are not supported: use a token, a tokenFile or a client certificate")
		}
		if u.User.Username != "" || u.User.Password != "" {
			return nil, errors.New("username and password are not supported (API servers refuse basic authentication): use a token, a tokenFile or a client certificate")
		}
		a.Token, a.TokenFile = u.User.Token, abs(u.User.TokenFile)
		a.CertFile, a.KeyFile = abs(u.User.ClientCertificate), abs(u.User.ClientKey)
		if a.CertData, err = decode(u.User.ClientCertificateData); err != nil {
			return nil, fmt.Errorf("user %q: client-certificate-data: %w", userName, err)
		}
		if a.KeyData, err = decode(u.User.ClientKeyData); err != nil {
			return nil, fmt.Errorf("user %q: client-key-data: %w", userName, err)
		}
	}
	if !found && userName != "" {
		return nil, fmt.Errorf("no user %q", userName)
	}
	return a, nil
}

// credentials reads what a refers to, with kubectl's precedence (inline data over a file, a
// token file over an inline token): the TLS configuration and the bearer token. The plugin
// lives for one command, so it reads the token file once: the next command reads a rotated one.
func (a *apiAccess) credentials() (*tls.Config, string, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: a.ServerName, InsecureSkipVerify: a.Insecure}
	ca, err := dataOrFile(a.CAData, a.CAFile, "certificate-authority")
	if err != nil {
		return nil, "", err
	}
	if len(ca) > 0 {
		if a.Insecure {
			return nil, "", errors.New("insecure-skip-tls-verify and a certificate authority exclude each other: remove one")
		}
		cfg.RootCAs = x509.NewCertPool()
		if !cfg.RootCAs.AppendCertsFromPEM(ca) {
			return nil, "", errors.New("the certificate authority holds no PEM certificate")
		}
	}
	cert, err := dataOrFile(a.CertData, a.CertFile, "client-certificate")
	if err != nil {
		return nil, "", err
	}
	key, err := dataOrFile(a.KeyData, a.KeyFile, "client-key")
	if err != nil {
		return nil, "", err
	}
	if len(cert) > 0 || len(key) > 0 {
		pair, err := tls.X509KeyPair(cert, key)
		if err != nil {
			return nil, "", fmt.Errorf("client certificate: %w", err)
		}
		cfg.Certificates = []tls.Certificate{pair}
	}
	token := a.Token
	if a.TokenFile != "" {
		// As client-go: the file's token wins; an inline token stands in when the file cannot
		// be read or is empty.
		b, err := os.ReadFile(a.TokenFile)
		fileToken := strings.TrimSpace(string(b))
		switch {
		case err == nil && fileToken != "":
			token = fileToken
		case token != "":
		case err != nil:
			return nil, "", fmt.Errorf("token file: %w", err)
		default:
			return nil, "", fmt.Errorf("token file %s is empty", a.TokenFile)
		}
	}
	return cfg, token, nil
}

// dataOrFile returns data, else the content of file, else nothing.
func dataOrFile(data []byte, file, field string) ([]byte, error) {
	if len(data) > 0 || file == "" {
		return data, nil
	}
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", field, err)
	}
	return b, nil
}

func decode(s string) ([]byte, error) {
	if s == "" {
		return nil, nil
	}
	return base64.StdEncoding.DecodeString(s)
}
