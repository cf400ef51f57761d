package cniplugin

import (
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"k8s.io/client-go/transport"
	"sigs.k8s.io/yaml"
)

// kubeconfig is the part of a kubeconfig file the plugin uses: the current context's server,
// its CA, and a token, token file or client certificate. Exec and auth-provider credentials are
// not supported: the node agent writes a token-file kubeconfig, and a plugin that runs for
// every pod should not start other programs to authenticate.
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
			Exec                  any    `json:"exec"`
			AuthProvider          any    `json:"auth-provider"`
		} `json:"user"`
	} `json:"users"`
}

// loadKubeconfig reads the kubeconfig at path into the API server's URL and a client-go
// transport configuration. Relative file paths in it are relative to its directory, as
// kubectl resolves them.
func loadKubeconfig(path string) (string, *transport.Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return "", nil, err
	}
	var kc kubeconfig
	if err := yaml.Unmarshal(data, &kc); err != nil {
		return "", nil, fmt.Errorf("parse: %w", err)
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
		return "", nil, fmt.Errorf("no context %q", ctxName)
	}
	dir := filepath.Dir(path)
	abs := func(p string) string {
		if p == "" || filepath.IsAbs(p) {
			return p
		}
		return filepath.Join(dir, p)
	}
	cfg := &transport.Config{}
	var server string
	found = false
	for _, c := range kc.Clusters {
		if c.Name != clusterName {
			continue
		}
		found = true
		server = c.Cluster.Server
		cfg.TLS.CAFile = abs(c.Cluster.CertificateAuthority)
		cfg.TLS.Insecure = c.Cluster.InsecureSkipTLSVerify
		cfg.TLS.ServerName = c.Cluster.TLSServerName
		if cfg.TLS.CAData, err = decode(c.Cluster.CertificateAuthorityData); err != nil {
			return "", nil, fmt.Errorf("cluster %q: certificate-authority-data: %w", clusterName, err)
		}
	}
	if !found || server == "" {
		return "", nil, fmt.Errorf("no cluster %q with a server", clusterName)
	}
	for _, u := range kc.Users {
		if u.Name != userName {
			continue
		}
		if u.User.Exec != nil || u.User.AuthProvider != nil {
			return "", nil, errors.New("exec and auth-provider credentials are not supported: use a token, a tokenFile or a client certificate")
		}
		cfg.BearerToken, cfg.BearerTokenFile = u.User.Token, abs(u.User.TokenFile)
		cfg.TLS.CertFile, cfg.TLS.KeyFile = abs(u.User.ClientCertificate), abs(u.User.ClientKey)
		if cfg.TLS.CertData, err = decode(u.User.ClientCertificateData); err != nil {
			return "", nil, fmt.Errorf("user %q: client-certificate-data: %w", userName, err)
		}
		if cfg.TLS.KeyData, err = decode(u.User.ClientKeyData); err != nil {
			return "", nil, fmt.Errorf("user %q: client-key-data: %w", userName, err)
		}
	}
	return server, cfg, nil
}

func decode(s string) ([]byte, error) {
	if s == "" {
		return nil, nil
	}
	return base64.StdEncoding.DecodeString(s)
}
