package framework

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/detourmesh/detour/internal/image"
	"github.com/detourmesh/detour/test/e2e/upstream"
	"github.com/detourmesh/detour/test/images"
)

// Artifacts are what the e2e installs: detour's image, built the way `make image` builds it,
// the test images (pause, the test proxy, the workload in its three USER variants), the
// cluster DNS's, and the images of Kubernetes' own network tests (package upstream).
type Artifacts struct {
	dir string
	// Tarballs are the docker-save tarballs every node imports: detour's image, the test
	// images, the cluster's own.
	Tarballs []string
	// Refs are the test images' references, as the nodes know them after the import.
	Refs images.Refs
	// testImages are the test images in tarballs, by reference.
	testImages map[string]v1.Image
	// Repo and Tag are detour's image's.
	Repo, Tag string
	// workloadBin is the workload program, for the test server outside the pods.
	workloadBin string
}

// e2eVersion is the version the e2e's detour reports: the release in VERSION, as a
// pre-release ("v0.2.0-e2e"), so that it orders against the previous release as the working
// tree's own builds do.
func e2eVersion(root string) string {
	return "v" + strings.TrimSpace(ReadFile(filepath.Join(root, "VERSION"))) + "-e2e"
}

func buildArtifacts(ctx context.Context, root, bin string) (*Artifacts, error) {
	dir, err := os.MkdirTemp("", "detour-e2e-artifacts-")
	if err != nil {
		return nil, err
	}
	a := &Artifacts{dir: dir, Repo: "detour.test/detour", Tag: "e2e"}
	for _, cmd := range []string{"detour", "detour-cni"} {
		build := exec.CommandContext(ctx, "go", "build", "-trimpath",
			"-ldflags", "-s -w -X github.com/detourmesh/detour/internal/version.Version="+e2eVersion(root),
			"-o", filepath.Join(dir, cmd), "./cmd/"+cmd)
		build.Dir = root
		build.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := build.CombinedOutput(); err != nil {
			return nil, fmt.Errorf("go build %s: %w\n%s", cmd, err, out)
		}
	}
	spec := image.DetourSpec(dir, e2eVersion(root))
	spec.Ref = a.Repo + ":" + a.Tag
	img, err := image.Build(spec)
	if err != nil {
		return nil, err
	}
	detourTar := filepath.Join(dir, "detour.tar")
	if err := image.WriteTarball(detourTar, map[string]v1.Image{spec.Ref: img}); err != nil {
		return nil, err
	}
	built, err := images.Build(ctx, filepath.Join(dir, "test-images"))
	if err != nil {
		return nil, err
	}
	// The cluster's own images in one tarball: Kubernetes' test images and CoreDNS.
	clusterImgs, err := upstream.Images(bin, built.Images[built.Refs.Pause])
	if err != nil {
		return nil, err
	}
	if clusterImgs[DNSImageRef], err = DNSImage(bin); err != nil {
		return nil, err
	}
	clusterTar := filepath.Join(dir, "cluster.tar")
	if err := image.WriteTarball(clusterTar, clusterImgs); err != nil {
		return nil, err
	}
	a.Tarballs = []string{detourTar, built.Tarball, clusterTar}
	a.Refs, a.testImages = built.Refs, built.Images
	a.workloadBin = built.Bin("workload")
	return a, nil
}
