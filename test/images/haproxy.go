package images

import (
	"bufio"
	"bytes"
	_ "embed"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/detourmesh/detour/internal/image"
)

// HAProxyBinary is where Debian's haproxy package (installed by hack/host-deps.sh) puts the
// binary the HAProxy image carries.
const HAProxyBinary = "/usr/sbin/haproxy"

// HAProxyConfigPath is the HAProxy configuration's path in the image; HAProxyUnmountedPath is
// its HAProxyUnmountedConfig.
const (
	HAProxyConfigPath    = "/usr/local/etc/haproxy/haproxy.cfg"
	HAProxyUnmountedPath = "/usr/local/etc/haproxy/unmounted.cfg"
)

// HAProxyCommand is how the image runs HAProxy: in the foreground (-db) and in master-worker
// mode (-W). As its container's PID 1 HAProxy must handle SIGTERM itself — the kernel ignores a
// signal whose action is the default for a namespace's init — and only the master does: a
// single process in the foreground keeps SIGTERM's default action and would run on until the
// kubelet's SIGKILL.
var HAProxyCommand = []string{HAProxyBinary, "-W", "-db", "-f", HAProxyConfigPath}

// HAProxyConfig is the image's configuration: HAProxy as a meshed pod's proxy on detour's
// default ports (docs/proxy-contract.md).
//
//go:embed haproxy.cfg
var HAProxyConfig []byte

// HAProxyUnmountedConfig is HAProxyConfig without the lines that need a volume (those ending in
// "# mounted": the admin socket's directory, the identity token): HAProxy as the proxy of a
// release whose webhook cannot mount volumes (v0.1.0), as the upgrade story installs it.
var HAProxyUnmountedConfig = withoutMounted(HAProxyConfig)

// HAProxyUnmountedCommand runs HAProxy as HAProxyCommand does, with HAProxyUnmountedConfig.
var HAProxyUnmountedCommand = []string{HAProxyBinary, "-W", "-db", "-f", HAProxyUnmountedPath}

func withoutMounted(cfg []byte) []byte {
	var out bytes.Buffer
	for line := range bytes.Lines(cfg) {
		if !bytes.HasSuffix(bytes.TrimRight(line, " \n"), []byte("# mounted")) {
			out.Write(line)
		}
	}
	return out.Bytes()
}

// haproxySpec is the HAProxy image: the host's haproxy binary, the shared libraries it links
// (as the dynamic loader resolves them here) and its configuration. Its user comes from the
// pod (the webhook sets the proxy UID).
func haproxySpec(ref string) (image.Spec, error) {
	libs, err := sharedLibraries(HAProxyBinary)
	if err != nil {
		return image.Spec{}, fmt.Errorf("the HAProxy image needs Debian's haproxy package (bash hack/host-deps.sh installs it): %w", err)
	}
	files := []image.File{
		{Path: HAProxyBinary, Source: HAProxyBinary, Mode: 0o755},
		{Path: HAProxyConfigPath, Data: HAProxyConfig, Mode: 0o644},
		{Path: HAProxyUnmountedPath, Data: HAProxyUnmountedConfig, Mode: 0o644},
		{Path: "/etc/passwd", Data: []byte("root:x:0:0:root:/root:/sbin/nologin\n"), Mode: 0o644},
		{Path: "/etc/group", Data: []byte("root:x:0:\n"), Mode: 0o644},
		{Path: "/run/haproxy", Dir: true, Mode: 0o1777},
	}
	for _, lib := range libs {
		files = append(files, image.File{Path: lib, Source: lib, Mode: 0o755})
	}
	return image.Spec{
		Ref:        ref,
		Files:      files,
		Entrypoint: HAProxyCommand,
		Env:        []string{"PATH=/usr/sbin:/usr/bin:/bin"},
	}, nil
}

// sharedLibraries lists the shared libraries bin loads and its dynamic loader, as ldd prints
// them: each an absolute path on this host.
func sharedLibraries(bin string) ([]string, error) {
	if _, err := os.Stat(bin); err != nil {
		return nil, err
	}
	out, err := exec.Command("ldd", bin).Output()
	if err != nil {
		return nil, fmt.Errorf("ldd %s: %w", bin, err)
	}
	return parseLdd(out)
}

// parseLdd reads ldd's output: "name => /path (0x…)" for a library, "/path (0x…)" for the
// loader, and no path for the vDSO; a library ldd cannot find is an error.
func parseLdd(out []byte) ([]string, error) {
	var libs []string
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if name, after, ok := strings.Cut(line, "=>"); ok {
			line = strings.TrimSpace(after)
			if strings.HasPrefix(line, "not found") {
				return nil, fmt.Errorf("ldd: %s not found", strings.TrimSpace(name))
			}
		}
		path, _, _ := strings.Cut(line, " ")
		if filepath.IsAbs(path) {
			libs = append(libs, path)
		}
	}
	if len(libs) == 0 {
		return nil, fmt.Errorf("ldd printed no library: %q", out)
	}
	return libs, nil
}
