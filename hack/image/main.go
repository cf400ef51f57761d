// Command image builds detour's container image from the binaries `make build` left in --bin,
// without a Docker engine (internal/image, DetourSpec), and writes it as a docker-save tarball
// that `docker load` and `ctr -n k8s.io images import` accept, or pushes it with --push (with
// the credentials of `docker login`).
//
//	go run ./hack/image --bin bin --version v0.2.0 --out bin/detour-image.tar   # make image
//	go run ./hack/image --bin bin --version v0.2.0 --ref registry.example.com/detour:v0.2.0 --push
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"syscall"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/detourmesh/detour/internal/image"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(1)
	}
}

func run() error {
	bin := flag.String("bin", "bin", "directory of the detour and detour-cni binaries (make build)")
	version := flag.String("version", "", "detour version, the image's version label and default tag (required)")
	ref := flag.String("ref", "", "image reference (default "+image.Repository+":<version>)")
	out := flag.String("out", "bin/detour-image.tar", "tarball to write (docker load, ctr images import)")
	push := flag.Bool("push", false, "push the image to --ref instead of writing --out")
	arch := flag.String("arch", "", "image architecture (default: this machine's); the binaries must match it")
	flag.Parse()
	if flag.NArg() != 0 {
		return fmt.Errorf("unexpected arguments %q (see -help)", flag.Args())
	}
	if *version == "" {
		return errors.New("--version is required (make image passes VERSION)")
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if *arch == "" || *arch == runtime.GOARCH {
		if err := image.CheckDetourVersion(ctx, *bin, *version); err != nil {
			return err
		}
	}
	spec := image.DetourSpec(*bin, *version)
	spec.Arch = *arch
	if *ref != "" {
		spec.Ref = *ref
	}
	img, err := image.Build(spec)
	if err != nil {
		return err
	}
	digest, err := img.Digest()
	if err != nil {
		return err
	}
	if *push {
		if err := image.Push(ctx, spec.Ref, img); err != nil {
			return err
		}
		fmt.Printf("pushed %s@%s\n", spec.Ref, digest)
		return nil
	}
	if err := image.WriteTarball(*out, map[string]v1.Image{spec.Ref: img}); err != nil {
		return err
	}
	fmt.Printf("wrote %s (%s, %s): docker load -i %s, or ctr -n k8s.io images import %s\n", *out, spec.Ref, digest, *out, *out)
	return nil
}
