package nodeagent

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// ensureKubeconfig writes the plugin's token copy and kubeconfig (mode 0600) when they differ
// from what the service account provides now. The kubeconfig names the token file instead of
// holding the token, so a rotated token is in use as soon as the copy is refreshed; the copy is
// written before the kubeconfig, so the kubeconfig never points at a missing file.
func (a *Agent) ensureKubeconfig() (bool, error) {
	tokenPath := filepath.Join(a.cfg.ServiceAccountDir, "token")
	token, err := os.ReadFile(tokenPath)
	if err == nil && len(bytes.TrimSpace(token)) == 0 {
		err = fmt.Errorf("it is empty")
	}
	if err != nil {
		return false, fmt.Errorf("read the service account token %s: %w (the agent needs its service account token mounted; see --service-account-dir)", tokenPath, err)
	}
	caPath := filepath.Join(a.cfg.ServiceAccountDir, "ca.crt")
	ca, err := os.ReadFile(caPath)
	if err != nil {
		return false, fmt.Errorf("read the cluster CA %s: %w (see --service-account-dir)", caPath, err)
	}
	kubeconfig, err := a.kubeconfig(ca)
	if err != nil {
		return false, err
	}
	wroteToken, err := writeFileAtomic(a.cfg.TokenPath, token, 0o600)
	if err != nil {
		return false, fmt.Errorf("write the plugin's token: %w", err)
	}
	wroteConfig, err := writeFileAtomic(a.cfg.KubeconfigPath, kubeconfig, 0o600)
	if err != nil {
		return false, fmt.Errorf("write the plugin's kubeconfig: %w", err)
	}
	return wroteToken || wroteConfig, nil
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
