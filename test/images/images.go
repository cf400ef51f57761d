package images

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/detourmesh/detour/internal/image"
)

// module is the module the test programs belong to.
const module = "github.com/detourmesh/detour"

// The test programs, built from test/images/<name>.
const (
	pauseProg    = "pause"
	proxyProg    = "testproxy"
	workloadProg = "workload"
)

// Refs are the test images' references, as the node's containerd knows them after import.
type Refs struct {
	// Pause is the sandbox image (pin it as containerd's sandbox image).
	Pause string
	// Proxy runs testproxy on detour's default ports; its user comes from the pod (the
	// webhook sets the proxy UID).
	Proxy string
	// Workload, WorkloadNumeric and WorkloadNamed run the workload program; their image USER
	// is unset (root), "1500", and "app" (1600:1600 in the image's own /etc/passwd).
	Workload, WorkloadNumeric, WorkloadNamed string
	// HAProxy runs HAProxy, a production proxy, on detour's default ports (HAProxyConfig).
	HAProxy string
}

// DefaultRefs are the references Build tags the images with.
var DefaultRefs = Refs{
	Pause:           "detour.test/pause:1",
	Proxy:           "detour.test/proxy:1",
	Workload:        "detour.test/workload:1",
	WorkloadNumeric: "detour.test/workload-numeric:1",
	WorkloadNamed:   "detour.test/workload-named:1",
	HAProxy:         "detour.test/haproxy:2.6",
}

// Built is the result of Build: one tarball with every test image, and the programs' static
// binaries (for tests that run them outside a container).
type Built struct {
	// Tarball is the docker-save tarball holding every image (ctr -n k8s.io images import).
	Tarball string
	Refs    Refs
	// Images are the images in Tarball, by reference (to push them to a registry).
	Images map[string]v1.Image
	dir    string
}

// Bin returns the path of the static binary of the program name ("pause", "testproxy",
// "workload") in the output directory's bin/.
func (b *Built) Bin(name string) string { return filepath.Join(b.dir, "bin", name) }

// Build compiles the test programs (static: CGO_ENABLED=0, -trimpath) into outDir/bin and
// writes outDir/images.tar with the images of DefaultRefs. outDir and bin/ are made 0755, so
// that tests may run the binaries as other users.
func Build(ctx context.Context, outDir string) (*Built, error) {
	outDir, err := filepath.Abs(outDir)
	if err != nil {
		return nil, err
	}
	b := &Built{Tarball: filepath.Join(outDir, "images.tar"), Refs: DefaultRefs, dir: outDir}
	if err := os.MkdirAll(filepath.Join(outDir, "bin"), 0o755); err != nil {
		return nil, fmt.Errorf("build test images: %w", err)
	}
	for _, d := range []string{outDir, filepath.Join(outDir, "bin")} {
		if err := os.Chmod(d, 0o755); err != nil {
			return nil, fmt.Errorf("build test images: %w", err)
		}
	}
	if err := buildPrograms(ctx, filepath.Join(outDir, "bin")); err != nil {
		return nil, err
	}
	all := specs(b)
	haproxy, err := haproxySpec(b.Refs.HAProxy)
	if err != nil {
		return nil, fmt.Errorf("build test image %s: %w", b.Refs.HAProxy, err)
	}
	all[b.Refs.HAProxy] = haproxy
	imgs := map[string]v1.Image{}
	for ref, spec := range all {
		img, err := image.Build(spec)
		if err != nil {
			return nil, fmt.Errorf("build test image %s: %w", ref, err)
		}
		imgs[ref] = img
	}
	if err := image.WriteTarball(b.Tarball, imgs); err != nil {
		return nil, err
	}
	b.Images = imgs
	return b, nil
}

// specs are the test images, keyed by reference.
func specs(b *Built) map[string]image.Spec {
	const passwd, group = "root:x:0:0:root:/root:/sbin/nologin\n", "root:x:0:\n"
	workload := func(ref, user, passwd, group string) image.Spec {
		return image.Spec{
			Ref: ref,
			Files: []image.File{
				{Path: "/usr/local/bin/workload", Source: b.Bin(workloadProg), Mode: 0o755},
				{Path: "/etc/passwd", Data: []byte(passwd), Mode: 0o644},
				{Path: "/etc/group", Data: []byte(group), Mode: 0o644},
			},
			User:       user,
			Entrypoint: []string{"/usr/local/bin/workload"},
			Env:        []string{"PATH=/usr/local/bin:/usr/bin:/bin"},
		}
	}
	return map[string]image.Spec{
		b.Refs.Pause: {
			Ref:        b.Refs.Pause,
			Files:      []image.File{{Path: "/pause", Source: b.Bin(pauseProg), Mode: 0o755}},
			User:       "65535:65535", // as registry.k8s.io/pause
			Entrypoint: []string{"/pause"},
		},
		b.Refs.Proxy: {
			Ref:        b.Refs.Proxy,
			Files:      []image.File{{Path: "/usr/local/bin/testproxy", Source: b.Bin(proxyProg), Mode: 0o755}},
			Entrypoint: []string{"/usr/local/bin/testproxy"},
			Env:        []string{"PATH=/usr/local/bin:/usr/bin:/bin"},
		},
		b.Refs.Workload:        workload(b.Refs.Workload, "", passwd, group),
		b.Refs.WorkloadNumeric: workload(b.Refs.WorkloadNumeric, "1500", passwd, group),
		// The name resolves only through the image's own /etc/passwd.
		b.Refs.WorkloadNamed: workload(b.Refs.WorkloadNamed, "app",
			passwd+"app:x:1600:1600:app:/:/sbin/nologin\n", group+"app:x:1600:\n"),
	}
}

// buildPrograms runs one go build of the three programs into binDir, from the module's root.
func buildPrograms(ctx context.Context, binDir string) error {
	root, err := moduleRoot(ctx)
	if err != nil {
		return err
	}
	args := []string{"build", "-trimpath", "-ldflags", "-s -w", "-o", binDir + string(filepath.Separator)}
	for _, p := range []string{pauseProg, proxyProg, workloadProg} {
		args = append(args, "./test/images/"+p)
	}
	cmd := exec.CommandContext(ctx, "go", args...)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("build test programs (go %s in %s): %w\n%s", strings.Join(args, " "), root, err, out)
	}
	return nil
}

// moduleRoot finds detour's module directory: from this file's directory when the source is
// there (tests, go run), else from the working directory.
func moduleRoot(ctx context.Context) (string, error) {
	dir := ""
	if _, file, _, ok := runtime.Caller(0); ok {
		if st, err := os.Stat(filepath.Dir(file)); err == nil && st.IsDir() {
			dir = filepath.Dir(file)
		}
	}
	cmd := exec.CommandContext(ctx, "go", "list", "-m", "-f", "{{.Path}} {{.Dir}}")
	cmd.Dir = dir
	out, err := cmd.Output()
	if err != nil {
		var stderr string
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = strings.TrimSpace(string(ee.Stderr))
		}
		return "", fmt.Errorf("find detour's module (go list -m): %w: %s (run from inside the repository)", err, stderr)
	}
	path, root, _ := strings.Cut(strings.TrimSpace(string(out)), " ")
	if path != module || root == "" {
		return "", fmt.Errorf("find detour's module: go list -m says %q, not %s (run from inside the repository)", strings.TrimSpace(string(out)), module)
	}
	return root, nil
}
