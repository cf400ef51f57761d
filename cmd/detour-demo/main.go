// Command detour-demo is `make demo`: detour end to end on this machine (see internal/demo).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/detourmesh/detour/internal/controlplane"
	"github.com/detourmesh/detour/internal/demo"
)

func main() {
	if demo.ChildMain() {
		return
	}
	o := demo.Options{Out: os.Stdout}
	flag.StringVar(&o.Detour, "detour", "bin/detour", "the detour binary (make build)")
	flag.StringVar(&o.DetourCNI, "detour-cni", "bin/detour-cni", "the detour-cni binary (make build)")
	flag.StringVar(&o.TestBinDir, "test-bin", controlplane.BinDir(), "kube-apiserver, etcd and the reference CNI plugins (hack/test-binaries.sh)")
	flag.StringVar(&o.Workload, "workload", "testdata/workloads/demo.yaml", "the Deployment whose pod the demo admits")
	flag.Parse()
	for _, p := range []*string{&o.Detour, &o.DetourCNI, &o.TestBinDir, &o.Workload} {
		abs, err := filepath.Abs(*p)
		if err != nil {
			fmt.Fprintln(os.Stderr, "detour-demo:", err)
			os.Exit(1)
		}
		*p = abs
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := demo.Run(ctx, o)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "detour-demo:", err)
		os.Exit(1)
	}
}
