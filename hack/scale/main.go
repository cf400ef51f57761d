// Command scale runs the scale harness (test/scale) at each size of --nodes and prints the
// table of docs/scale.md: make scale.
package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/detourmesh/detour/internal/controlplane"
	"github.com/detourmesh/detour/test/scale"
)

func main() {
	sizes := flag.String("nodes", "10,100,300,1000", "the sizes to run, comma-separated, each a cluster of its own")
	steady := flag.Duration("steady", 2*time.Minute, "how long the steady state is watched at each size")
	report := flag.String("report", "bin/scale/report.md", "where the table is written (and printed)")
	dir := flag.String("dir", "", "where each run writes its audit log and nodes (default: a temporary directory, removed after a run that succeeded)")
	flag.Parse()
	// envtest, which starts each size's control plane, logs through controller-runtime; its
	// lines are not the table's.
	ctrllog.SetLogger(logr.Discard())
	if err := run(*sizes, *steady, *report, *dir); err != nil {
		fmt.Fprintln(os.Stderr, "scale:", err)
		os.Exit(1)
	}
}

func run(sizes string, steady time.Duration, report, dir string) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	root, err := scale.ModuleRoot()
	if err != nil {
		return err
	}
	bin, err := os.MkdirTemp("", "detour-scale-bin-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(bin)
	detour, err := scale.BuildDetour(ctx, root, bin)
	if err != nil {
		return err
	}
	var results []*scale.Result
	for _, s := range strings.Split(sizes, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 {
			return fmt.Errorf("--nodes %q: %q is not a number of nodes", sizes, s)
		}
		runDir := filepath.Join(dir, fmt.Sprintf("nodes-%d", n))
		if dir == "" {
			if runDir, err = os.MkdirTemp("", fmt.Sprintf("detour-scale-%d-", n)); err != nil {
				return err
			}
		}
		res, err := scale.Run(ctx, scale.Options{Nodes: n, PodsPerNode: 30, PodsPerSecond: 50, Detour: detour, Steady: steady, Chart: scale.ChartDir(root), BinDir: controlplane.BinDir(), Dir: runDir, Log: os.Stderr})
		if err != nil {
			return fmt.Errorf("%d nodes (files in %s): %w", n, runDir, err)
		}
		if len(res.Errors) > 0 {
			return fmt.Errorf("%d nodes (files in %s): %d agents' containers failed, the first: %v", n, runDir, len(res.Errors), res.Errors[0])
		}
		if dir == "" {
			os.RemoveAll(runDir)
		}
		results = append(results, res)
	}
	var buf bytes.Buffer
	fmt.Fprintf(&buf, "# detour at scale, %s\n\n", time.Now().UTC().Format("2006-01-02"))
	scale.WriteReport(&buf, results, steady)
	if err := os.MkdirAll(filepath.Dir(report), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(report, buf.Bytes(), 0o644); err != nil {
		return err
	}
	_, err = os.Stdout.Write(buf.Bytes())
	return err
}
