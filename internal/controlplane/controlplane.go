// Package controlplane configures a local kube-apiserver + etcd (controller-runtime's envtest)
// over the binaries hack/test-binaries.sh builds, for the integration tests and the demo.
package controlplane

import (
	"os"
	"path/filepath"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
)

// BinDir is the directory of the binaries hack/test-binaries.sh built: $DETOUR_TEST_BIN, or the
// script's default cache ($DETOUR_CACHE or ~/.cache/detour, then bin).
func BinDir() string {
	if d := os.Getenv("DETOUR_TEST_BIN"); d != "" {
		return d
	}
	cache := os.Getenv("DETOUR_CACHE")
	if cache == "" {
		home, _ := os.UserHomeDir()
		cache = filepath.Join(home, ".cache", "detour")
	}
	return filepath.Join(cache, "bin")
}

// New returns an environment (not started) that runs kube-apiserver and etcd from binDir.
func New(binDir string) *envtest.Environment {
	env := &envtest.Environment{
		BinaryAssetsDirectory: binDir,
		ControlPlane: envtest.ControlPlane{
			APIServer: &envtest.APIServer{Path: filepath.Join(binDir, "kube-apiserver")},
			Etcd:      &envtest.Etcd{Path: filepath.Join(binDir, "etcd")},
		},
	}
	args := env.ControlPlane.APIServer.Configure()
	// Works in a namespace that has only loopback, too; there is no Service endpoint to keep.
	args.Set("advertise-address", "127.0.0.1")
	args.Set("endpoint-reconciler-type", "none")
	if os.Getenv("DETOUR_TEST_CONTROL_PLANE_OUTPUT") == "1" {
		env.AttachControlPlaneOutput = true
	}
	return env
}

// WriteKubeconfig writes cfg as a kubeconfig file at path, for the components that read one
// (the CNI plugin, the node agent): the server and its CA, and cfg's client certificate, token
// or token file.
func WriteKubeconfig(path string, cfg *rest.Config) error {
	kc := clientcmdapi.NewConfig()
	kc.Clusters["local"] = &clientcmdapi.Cluster{Server: cfg.Host, CertificateAuthorityData: cfg.CAData}
	kc.AuthInfos["local"] = &clientcmdapi.AuthInfo{
		ClientCertificateData: cfg.CertData, ClientKeyData: cfg.KeyData,
		Token: cfg.BearerToken, TokenFile: cfg.BearerTokenFile,
	}
	kc.Contexts["local"] = &clientcmdapi.Context{Cluster: "local", AuthInfo: "local"}
	kc.CurrentContext = "local"
	return clientcmd.WriteToFile(*kc, path)
}
