// Package version holds the detour version, set at build time by the Makefile and Dockerfile
// with -ldflags "-X github.com/detourmesh/detour/internal/version.Version=...".
package version

// Version is the detour version; the webhook writes it into the injected marker annotation.
var Version = "v0.2.0-dev"
