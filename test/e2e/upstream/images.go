package upstream

import (
	"fmt"
	"os"
	"path/filepath"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/detourmesh/detour/internal/image"
)

// The images the selected tests run, as test/utils/image/manifest.go of k8s.io/kubernetes
// v1.37.2 names them (e2e.test --list-images). Pulled IfNotPresent, they are found where the
// node imported them.
const (
	AgnhostRef  = "registry.k8s.io/e2e-test-images/agnhost:2.66.1"
	DNSTestRef  = "registry.k8s.io/e2e-test-images/glibc-dns-testing:2.1.1"
	NginxRef    = "registry.k8s.io/e2e-test-images/nginx:1.27.0-2"
	NginxNewRef = "registry.k8s.io/e2e-test-images/nginx:1.28.0-2"
	PauseRef    = "registry.k8s.io/pause:3.10.2"
	// FlannelRef is flannel's image (the flannel cluster's primary CNI, test/e2e/flannel.go),
	// at the version of hack/tools/flannel/go.mod.
	FlannelRef = "ghcr.io/flannel-io/flannel:v0.28.10"
)

// debianPath is the PATH of the images on the Debian userland.
const debianPath = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// Images builds the test images from binDir (hack/test-binaries.sh's: debian-rootfs.tar,
// agnhost, coredns, and flanneld and flannel when it built them); pause is the caller's pause
// image, tagged PauseRef too. The userland is one layer that every image shares.
//
// Where they differ from upstream's: upstream builds agnhost on Alpine (musl), so the DNS
// tests' "musl" prober resolves with glibc here; its /coredns is v1.15.0 (ours, with the
// plugins hack/tools/coredns names), not 1.6.2.
func Images(binDir string, pause v1.Image) (map[string]v1.Image, error) {
	rootfs, err := image.LayerFromTar(filepath.Join(binDir, "debian-rootfs.tar"))
	if err != nil {
		return nil, fmt.Errorf("the test images' userland (hack/test-binaries.sh builds it, as root): %w", err)
	}
	base := []v1.Layer{rootfs}
	coredns := image.File{Path: "/coredns", Source: filepath.Join(binDir, "coredns"), Mode: 0o755}
	specs := map[string]image.Spec{
		// As upstream's Dockerfile: /agnhost with pause as its default; the rootfs has the
		// rest (/agnhost-2, /uploads, porter's certificate, the image's user and group).
		AgnhostRef: {Base: base, Files: []image.File{
			{Path: "/agnhost", Source: filepath.Join(binDir, "agnhost"), Mode: 0o755}, coredns,
		}, Entrypoint: []string{"/agnhost"}, Cmd: []string{"pause"}, Env: []string{debianPath}},
		DNSTestRef: {Base: base, Files: []image.File{coredns}, Cmd: []string{"bash"}, Env: []string{debianPath}},
		NginxRef:   {Base: base, Cmd: []string{"nginx", "-g", "daemon off;"}, Env: []string{debianPath}},
	}
	if _, err := os.Stat(filepath.Join(binDir, "flanneld")); err == nil {
		// As upstream's: flanneld where kube-flannel.yml runs it, and the CNI plugin where its
		// install-cni-plugin init container copies it from; iptables (for --ip-masq) and cp
		// come with the userland.
		specs[FlannelRef] = image.Spec{Base: base, Files: []image.File{
			{Path: "/opt/bin/flanneld", Source: filepath.Join(binDir, "flanneld"), Mode: 0o755},
			{Path: "/flannel", Source: filepath.Join(binDir, "flannel"), Mode: 0o755},
		}, Entrypoint: []string{"/opt/bin/flanneld"}, Env: []string{debianPath}}
	}
	imgs := map[string]v1.Image{PauseRef: pause}
	for ref, spec := range specs {
		spec.Ref = ref
		img, err := image.Build(spec)
		if err != nil {
			return nil, fmt.Errorf("build %s: %w", ref, err)
		}
		imgs[ref] = img
	}
	imgs[NginxNewRef] = imgs[NginxRef] // the tests tell the two apart only by their tags
	return imgs, nil
}
