package scale

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"

	"github.com/detourmesh/detour/hack/webhook-load/load"
	"github.com/detourmesh/detour/internal/controlplane"
)

// Webhook is detour's webhook as the chart runs it: replicas of `detour webhook` (processes of
// the binary the run built), with the chart's configuration and a token of the webhook's
// service account, behind the address the API server calls, which spreads connections over
// them as the Service would.
type Webhook struct {
	// metrics are the replicas' /metrics URLs.
	metrics []string
	procs   []*exec.Cmd
	done    []chan error
	lb      net.Listener
}

// StartWebhook starts replicas of the webhook and the balancer in front of them.
func (c *Cluster) StartWebhook(ctx context.Context, detour string, chart *Chart, replicas int) (w *Webhook, err error) {
	dir := filepath.Join(c.Dir, "webhook")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	config := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(config, chart.WebhookConfig, 0o644); err != nil {
		return nil, err
	}
	tr, err := c.Client.CoreV1().ServiceAccounts(Namespace).CreateToken(ctx, "detour-webhook", &authv1.TokenRequest{
		Spec: authv1.TokenRequestSpec{ExpirationSeconds: ptr.To[int64](3607)},
	}, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("request the webhook's token: %w", err)
	}
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := controlplane.WriteKubeconfig(kubeconfig, &rest.Config{Host: c.Config.Host, BearerToken: tr.Status.Token,
		TLSClientConfig: rest.TLSClientConfig{CAData: c.Config.CAData}}); err != nil {
		return nil, err
	}
	w = &Webhook{}
	defer func() {
		if err != nil {
			w.Stop()
		}
	}()
	var backends []string
	for i := range replicas {
		ports, err := freePorts(3)
		if err != nil {
			return w, err
		}
		serve, health := net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[0])), net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[1]))
		metrics := net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[2]))
		log, err := os.Create(filepath.Join(dir, fmt.Sprintf("webhook-%d.log", i)))
		if err != nil {
			return w, err
		}
		cmd := exec.Command(detour, "webhook", "--config", config, "--cert-dir", c.WebhookCertDir,
			"--host", "127.0.0.1", "--port", strconv.Itoa(ports[0]), "--kubeconfig", kubeconfig, "--namespace", Namespace,
			"--metrics-bind-address", metrics, "--health-probe-bind-address", health, "--shutdown-delay", "0")
		cmd.Stdout, cmd.Stderr = log, log
		if err := cmd.Start(); err != nil {
			log.Close()
			return w, fmt.Errorf("start the webhook: %w", err)
		}
		done := make(chan error, 1)
		go func() { done <- cmd.Wait(); log.Close() }()
		w.procs, w.done = append(w.procs, cmd), append(w.done, done)
		err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
			select {
			case err := <-done:
				done <- err
				return false, fmt.Errorf("it exited: %v", err)
			default:
			}
			resp, err := http.Get("http://" + health + "/readyz")
			if err != nil {
				return false, nil
			}
			resp.Body.Close()
			return resp.StatusCode == http.StatusOK, nil
		})
		if err != nil {
			return w, fmt.Errorf("webhook replica %d never ready (log: %s): %w", i, log.Name(), err)
		}
		backends = append(backends, serve)
		w.metrics = append(w.metrics, "http://"+metrics+"/metrics")
	}
	if w.lb, err = net.Listen("tcp", c.WebhookAddr); err != nil {
		return w, fmt.Errorf("listen where the API server calls the webhook: %w", err)
	}
	var next atomic.Uint64
	go func() {
		for {
			conn, err := w.lb.Accept()
			if err != nil {
				return
			}
			backend := backends[next.Add(1)%uint64(len(backends))]
			go relay(conn, backend)
		}
	}()
	return w, nil
}

// relay copies conn to and from a connection to backend until either side closes.
func relay(conn net.Conn, backend string) {
	defer conn.Close()
	b, err := net.Dial("tcp", backend)
	if err != nil {
		return
	}
	defer b.Close()
	done := make(chan struct{}, 2)
	go func() { io.Copy(b, conn); done <- struct{}{} }()
	go func() { io.Copy(conn, b); done <- struct{}{} }()
	<-done
}

// Stop stops the balancer and the replicas.
func (w *Webhook) Stop() error {
	if w.lb != nil {
		w.lb.Close()
	}
	var errs []error
	for i, p := range w.procs {
		p.Process.Signal(os.Interrupt)
		select {
		case <-w.done[i]:
		case <-time.After(10 * time.Second):
			p.Process.Kill()
			errs = append(errs, fmt.Errorf("webhook replica %d did not stop at SIGINT", i))
			<-w.done[i]
		}
	}
	return errors.Join(errs...)
}

// MaxRSS is the largest peak resident set (VmHWM) of the replicas.
func (w *Webhook) MaxRSS() (int64, error) {
	var peak int64
	for _, p := range w.procs {
		hwm, err := load.PeakRSS(p.Process.Pid)
		if err != nil {
			return 0, fmt.Errorf("the webhook's memory: %w", err)
		}
		peak = max(peak, hwm)
	}
	return peak, nil
}

// freePorts returns n ports free on 127.0.0.1 now.
func freePorts(n int) ([]int, error) {
	var ports []int
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}
