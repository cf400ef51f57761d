// Package version holds the detour version, set at build time by the Makefile and Dockerfile
// with -ldflags "-X github.com/detourmesh/detour/internal/version.Version=...".
package version

// Version is the detour version; the webhook writes it into the injected marker annotation.
var Version = "v0.2.0-dev"

// Commit is the commit the binary was built from, set at build time like Version (make build:
// the full hash, with "-dirty" for a working tree with changes); empty otherwise.
var Commit = ""
