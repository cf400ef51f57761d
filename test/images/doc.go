// Package images builds the end-to-end tests' container images the way detour's own image is
// built (internal/image, no Docker engine): a pause image, the test proxy and the workload in
// three variants of image USER, all in one tarball for `ctr -n k8s.io images import`, plus the
// programs' static binaries for tests that run them outside containers.
package images
