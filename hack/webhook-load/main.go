// Command webhook-load measures the detour webhook under load (see its package load): by default it
// starts a local kube-apiserver and etcd (hack/test-binaries.sh), runs `detour webhook` against
// them as a separate process, and sends AdmissionReview requests over TLS, first as fast as the
// webhook answers at a fixed concurrency, then at a fixed rate, and prints throughput, p50/p99
// latency and the webhook's peak RSS. With --url it measures a webhook that is already running.
//
//	go run ./hack/webhook-load --detour=bin/detour                 # what make bench-webhook runs
//	go run ./hack/webhook-load --url=https://127.0.0.1:9443/mutate-v1-pod --ca=ca.crt --pid=1234
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strconv"
	"syscall"
	"text/tabwriter"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/detourmesh/detour/hack/webhook-load/load"
	"github.com/detourmesh/detour/test/testenv"
	"github.com/detourmesh/detour/webhook"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "webhook-load:", err)
		os.Exit(1)
	}
}

type flags struct {
	url, ca, detour, namespace, pprof string
	pid, concurrency, rate            int
	duration, warmup                  time.Duration
}

func run(ctx context.Context) error {
	var f flags
	flag.StringVar(&f.url, "url", "", "mutate URL of a running webhook; empty starts a local API server and `detour webhook`")
	flag.StringVar(&f.ca, "ca", "", "PEM CA bundle of the running webhook's certificate (with --url)")
	flag.IntVar(&f.pid, "pid", 0, "process ID of the running webhook, for its peak RSS (with --url)")
	flag.StringVar(&f.detour, "detour", "bin/detour", "the detour binary to start (without --url)")
	flag.StringVar(&f.namespace, "namespace", "bench", "namespace of the pods (opted in; created when the tool starts the API server)")
	flag.StringVar(&f.pprof, "pprof", "", "serve the started webhook's /debug/pprof here, e.g. 127.0.0.1:6060 (without --url)")
	flag.IntVar(&f.concurrency, "concurrency", 16, "requests in flight")
	flag.IntVar(&f.rate, "rate", 500, "requests per second of the fixed-rate phase")
	flag.DurationVar(&f.duration, "duration", 20*time.Second, "length of each phase")
	flag.DurationVar(&f.warmup, "warmup", 3*time.Second, "unmeasured warm-up before the phases")
	flag.Parse()

	url, ca, pid := f.url, []byte(nil), f.pid
	if url == "" {
		var cleanup func()
		var err error
		url, ca, pid, cleanup, err = startLocal(ctx, f)
		if cleanup != nil {
			defer cleanup()
		}
		if err != nil {
			return err
		}
	} else {
		var err error
		if ca, err = os.ReadFile(f.ca); err != nil {
			return fmt.Errorf("--ca: %w", err)
		}
	}
	body, err := load.Review(load.Pod(), f.namespace)
	if err != nil {
		return err
	}
	base := load.Options{URL: url, CA: ca, Body: body, Concurrency: f.concurrency}

	if err := load.Check(ctx, base); err != nil {
		return fmt.Errorf("the first request: %w", err)
	}
	warm := base
	warm.Duration = f.warmup
	if r, err := load.Run(ctx, warm); err != nil {
		return err
	} else if r.Errors > 0 {
		return fmt.Errorf("warm-up: %d of %d requests failed, the first: %s", r.Errors, r.Errors+r.Requests, r.FirstError)
	}

	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "detour webhook under load: %d-byte AdmissionReview (3 init containers, 2 containers), TLS, HTTP/1.1 keep-alive, GOMAXPROCS of the client %d\n", len(body), runtimeProcs())
	fmt.Fprintln(tw, "phase\tconcurrency\trate\trequests\terrors\tthroughput/s\tp50\tp99\tmax\twebhook CPU/admission\tclient CPU/request")
	for _, phase := range []struct {
		name string
		rate int
	}{{"closed loop", 0}, {"fixed rate", f.rate}} {
		o := base
		o.Rate, o.Duration = phase.rate, f.duration
		cpu0, _ := cpuTime(pid)
		self0, _ := load.CPUTime(os.Getpid())
		r, err := load.Run(ctx, o)
		if err != nil {
			return err
		}
		cpu := "-"
		if cpu1, err := cpuTime(pid); err == nil && cpu1 > 0 && r.Requests > 0 {
			cpu = fmt.Sprintf("%.0fµs", float64(cpu1-cpu0)/float64(r.Requests)/float64(time.Microsecond))
		}
		self := "-"
		if self1, err := load.CPUTime(os.Getpid()); err == nil && r.Requests > 0 {
			self = fmt.Sprintf("%.0fµs", float64(self1-self0)/float64(r.Requests)/float64(time.Microsecond))
		}
		rate := "max"
		if phase.rate > 0 {
			rate = strconv.Itoa(phase.rate) + "/s"
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%d\t%d\t%.0f\t%s\t%s\t%s\t%s\t%s\n", phase.name, f.concurrency, rate, r.Requests, r.Errors,
			r.Throughput(), ms(r.Percentile(50)), ms(r.Percentile(99)), ms(r.Percentile(100)), cpu, self)
		if r.Errors > 0 {
			fmt.Fprintf(tw, "  first error: %s\n", r.FirstError)
		}
	}
	if pid > 0 {
		rss, err := load.PeakRSS(pid)
		if err != nil {
			return err
		}
		fmt.Fprintf(tw, "webhook peak RSS (VmHWM of pid %d): %.1f MiB\n", pid, float64(rss)/(1<<20))
	}
	return tw.Flush()
}

// cpuTime is the CPU time of pid, 0 when there is no pid to measure.
func cpuTime(pid int) (time.Duration, error) {
	if pid <= 0 {
		return 0, errors.New("no pid")
	}
	return load.CPUTime(pid)
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2fms", float64(d)/float64(time.Millisecond)) }

func runtimeProcs() int { return runtime.GOMAXPROCS(0) }

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// startLocal starts an API server, an opted-in namespace and `detour webhook`, and returns the
// webhook's URL, CA and process ID.
func startLocal(ctx context.Context, f flags) (string, []byte, int, func(), error) {
	var cleanups []func()
	cleanup := func() {
		for i := len(cleanups) - 1; i >= 0; i-- {
			cleanups[i]()
		}
	}
	fail := func(err error) (string, []byte, int, func(), error) { return "", nil, 0, cleanup, err }
	if _, err := os.Stat(f.detour); err != nil {
		return fail(fmt.Errorf("the detour binary: %w (run make build, or pass --detour)", err))
	}
	env := testenv.NewEnvironment()
	cfg, err := env.Start()
	if err != nil {
		return fail(fmt.Errorf("start the local API server from %s (run hack/test-binaries.sh): %w", testenv.BinDir(), err))
	}
	cleanups = append(cleanups, func() { _ = env.Stop() })
	client := kubernetes.NewForConfigOrDie(cfg)
	if _, err := client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{
		Name: f.namespace, Annotations: map[string]string{"detour.dev/inject": "enabled"},
	}}, metav1.CreateOptions{}); err != nil {
		return fail(err)
	}
	user, err := env.AddUser(envtest.User{Name: "detour-webhook", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		return fail(err)
	}
	kubeconfig, err := user.KubeConfig()
	if err != nil {
		return fail(err)
	}
	certs := envtest.WebhookInstallOptions{LocalServingHost: "127.0.0.1"}
	if err := certs.PrepWithoutInstalling(); err != nil {
		return fail(err)
	}
	cleanups = append(cleanups, func() { _ = certs.Cleanup() })
	dir, err := os.MkdirTemp("", "webhook-load-")
	if err != nil {
		return fail(err)
	}
	cleanups = append(cleanups, func() { os.RemoveAll(dir) })
	kcPath, cfgPath := filepath.Join(dir, "kubeconfig"), filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(kcPath, kubeconfig, 0o600); err != nil {
		return fail(err)
	}
	config := "proxy:\n  image: proxy.example/proxy:bench\n  startupProbe: {tcpSocket: {port: 4191}}\nvalidator:\n  image: detour:bench\n"
	if err := os.WriteFile(cfgPath, []byte(config), 0o600); err != nil {
		return fail(err)
	}
	health, err := freePort()
	if err != nil {
		return fail(err)
	}
	metrics, err := freePort()
	if err != nil {
		return fail(err)
	}
	cmd := exec.Command(f.detour, "webhook", "--kubeconfig", kcPath, "--config", cfgPath,
		"--cert-dir", certs.LocalServingCertDir, "--host", "127.0.0.1", "--port", strconv.Itoa(certs.LocalServingPort),
		"--metrics-bind-address", "127.0.0.1:"+strconv.Itoa(metrics), "--health-probe-bind-address", "127.0.0.1:"+strconv.Itoa(health),
		"--log-level", "warn", "--pprof-bind-address", f.pprof)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		return fail(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	cleanups = append(cleanups, func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
	})
	deadline := time.Now().Add(60 * time.Second)
	for {
		resp, err := http.Get("http://127.0.0.1:" + strconv.Itoa(health) + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		select {
		case err := <-exited:
			exited <- err
			return fail(fmt.Errorf("detour webhook exited before it was ready: %v", err))
		case <-ctx.Done():
			return fail(ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fail(errors.New("detour webhook is not ready after 60s"))
		}
	}
	url := "https://127.0.0.1:" + strconv.Itoa(certs.LocalServingPort) + webhook.MutatePath
	return url, certs.LocalServingCAData, cmd.Process.Pid, cleanup, nil
}
