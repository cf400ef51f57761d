package image

import (
	_ "embed"
	"path/filepath"
)

// The users of detour's image: root and nonroot (65532, distroless's non-root user). The
// Dockerfile copies these same files, so the two builds cannot drift apart.
var (
	//go:embed rootfs/etc/passwd
	etcPasswd []byte
	//go:embed rootfs/etc/group
	etcGroup []byte
)

const (
	// Repository is where detour's image is published.
	Repository = "ghcr.io/detourmesh/detour"
	// BinDir is the image's directory of detour's binaries (on PATH).
	BinDir = "/opt/detour/bin"
	// NonRoot is the image's user and group ID (distroless's nonroot); the node agent's
	// install container overrides it with root to write the host's CNI directories.
	NonRoot = "65532:65532"
)

// DetourSpec is detour's own image at version: the static binaries binDir/detour and
// binDir/detour-cni (as `make build` leaves them) in /opt/detour/bin, /etc/passwd and
// /etc/group with root and nonroot, running /opt/detour/bin/detour as 65532:65532.
func DetourSpec(binDir, version string) Spec {
	return Spec{
		Ref: Repository + ":" + version,
		Files: []File{
			{Path: BinDir + "/detour", Source: filepath.Join(binDir, "detour"), Mode: 0o755},
			{Path: BinDir + "/detour-cni", Source: filepath.Join(binDir, "detour-cni"), Mode: 0o755},
			{Path: "/etc/passwd", Data: etcPasswd, Mode: 0o644},
			{Path: "/etc/group", Data: etcGroup, Mode: 0o644},
		},
		User:       NonRoot,
		Entrypoint: []string{BinDir + "/detour"},
		// The injected validator runs `detour validate`: keep detour on PATH.
		Env: []string{"PATH=" + BinDir + ":/usr/local/bin:/usr/bin:/bin"},
		Labels: map[string]string{
			"org.opencontainers.image.title":       "detour",
			"org.opencontainers.image.description": "detour: mesh traffic capture by a chained CNI plugin and an injection webhook",
			"org.opencontainers.image.source":      "https://github.com/detourmesh/detour",
			"org.opencontainers.image.version":     version,
			"org.opencontainers.image.licenses":    "Apache-2.0",
		},
	}
}
