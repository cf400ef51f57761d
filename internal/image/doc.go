// Package image builds container images without a container engine: one deterministic layer
// of the files a [Spec] names plus an image config, written as a docker-save tarball that
// `docker load` and `ctr images import` accept, or pushed to a registry. [DetourSpec] is
// detour's own image (the Dockerfile describes the same one for people who build with Docker);
// test/images builds the end-to-end tests' images the same way.
package image
