package nodeagent

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/detourmesh/detour/internal/fsutil"
)

// ensureKubeconfig writes the plugin's token and kubeconfig (mode 0600) when they differ from
// what they should be now. The token is the one requested for the plugin's own service account
// (Config.PluginServiceAccount) or, without one, a copy of the agent's. The kubeconfig names
// the token file instead of holding the token, so a new token is in use as soon as the file is
// rewritten; the token is written before the kubeconfig, so the kubeconfig never points at a
// missing file. It returns whether it wrote and the requested token's expiry (zero for a
// copy); an expired token that could not be renewed is a *tokenExpiredError, after the files
// are otherwise ensured.
func (a *Agent) ensureKubeconfig(ctx context.Context) (bool, time.Time, error) {
	caPath := filepath.Join(a.cfg.ServiceAccountDir, "ca.crt")
	ca, err := os.ReadFile(caPath)
	if err != nil {
		return false, time.Time{}, fmt.Errorf("read the cluster CA %s: %w (see --service-account-dir)", caPath, err)
	}
	kubeconfig, err := a.kubeconfig(ca)
	if err != nil {
		return false, time.Time{}, err
	}
	token, expires, tokenErr := a.pluginToken(ctx)
	if token == nil {
		return false, time.Time{}, tokenErr
	}
	wroteToken, err := fsutil.WriteFileAtomic(a.cfg.TokenPath, token, 0o600)
	if err != nil {
		return false, expires, fmt.Errorf("write the plugin's token: %w", err)
	}
	wroteConfig, err := fsutil.WriteFileAtomic(a.cfg.KubeconfigPath, kubeconfig, 0o600)
	if err != nil {
		return false, expires, fmt.Errorf("write the plugin's kubeconfig: %w", err)
	}
	return wroteToken || wroteConfig, expires, tokenErr
}

// pluginToken returns the token to write for the plugin and, for a requested one, its expiry.
// A nil token comes with an error; a token with an error is one that expired.
func (a *Agent) pluginToken(ctx context.Context) ([]byte, time.Time, error) {
	if a.tokens != nil {
		if a.client == nil {
			return nil, time.Time{}, fmt.Errorf("no API client to request the plugin's token for service account %s", a.tokens.account())
		}
		return a.tokens.get(ctx)
	}
	tokenPath := filepath.Join(a.cfg.ServiceAccountDir, "token")
	token, err := os.ReadFile(tokenPath)
	if err == nil && len(bytes.TrimSpace(token)) == 0 {
		err = fmt.Errorf("it is empty")
	}
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("read the service account token %s: %w (the agent needs its service account token mounted; see --service-account-dir)", tokenPath, err)
	}
	return token, time.Time{}, nil
}

// kubeconfig is the plugin's kubeconfig: the API server, the cluster CA inline, and the token
// file as the host sees it.
func (a *Agent) kubeconfig(ca []byte) ([]byte, error) {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["cluster"] = &clientcmdapi.Cluster{Server: a.cfg.APIServer, CertificateAuthorityData: ca}
	cfg.AuthInfos[PluginType] = &clientcmdapi.AuthInfo{TokenFile: a.cfg.HostTokenPath}
	cfg.Contexts[PluginType] = &clientcmdapi.Context{Cluster: "cluster", AuthInfo: PluginType}
	cfg.CurrentContext = PluginType
	b, err := clientcmd.Write(*cfg)
	if err != nil {
		return nil, fmt.Errorf("encode the plugin's kubeconfig: %w", err)
	}
	return b, nil
}
