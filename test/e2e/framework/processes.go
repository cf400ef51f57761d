package framework

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/rest"
)

// machineSysctls are the machine-wide kernel settings the kubelet rewrites (setupKernelTunables),
// and cilium-agent on the Cilium cluster; the node gets stand-in files that start with the
// host's values.
func machineSysctls() map[string]string {
	m := map[string]string{}
	for _, f := range []string{
		"vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
		"kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes",
		// unprivileged_bpf_disabled cannot be set back once 1.
		"kernel/unprivileged_bpf_disabled", "kernel/timer_migration",
	} {
		p := "/proc/sys/" + f
		if v, err := os.ReadFile(p); err == nil {
			m[p] = strings.TrimSpace(string(v))
		}
	}
	return m
}

// StartComponent starts one of the node's processes and waits until it is ready.
func (n *Node) StartComponent(ctx context.Context, name string) error {
	argv, env := n.command(name)
	pid, err := n.holder.start(argv, env, n.logPath(name), "")
	if err != nil {
		return fmt.Errorf("start %s: %w", name, err)
	}
	n.mu.Lock()
	n.pids[name] = pid
	n.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, 90*time.Second)
	defer cancel()
	err = wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		if exited, code, _ := n.holder.wait(pid, 0); exited {
			return false, fmt.Errorf("exited with code %d", code)
		}
		return n.ready(ctx, name), nil
	})
	if err != nil {
		return fmt.Errorf("%s is not ready: %w; its log %s ends with:\n%s", name, err, n.logPath(name), Tail(n.Log(name), 30))
	}
	return nil
}

// containerdBooted is what containerd logs once its CRI service is initialized: it serves its
// socket (and answers `ctr version`) seconds before, while CRI calls still fail with "server is
// not initialized yet" — a kubelet started then exits.
const containerdBooted, containerdStarting = "containerd successfully booted", `msg="starting containerd"`

// StopComponent stops one of the node's processes (SIGTERM, then SIGKILL after 10 s).
func (n *Node) StopComponent(name string) error {
	n.mu.Lock()
	pid, ok := n.pids[name]
	delete(n.pids, name)
	n.mu.Unlock()
	if !ok {
		return fmt.Errorf("%s is not running", name)
	}
	return n.holder.stop(pid, 10*time.Second)
}

// RestartComponent stops and starts one of the node's processes; it is started even when it
// could not be stopped (it was not running).
func (n *Node) RestartComponent(ctx context.Context, name string) error {
	return errors.Join(n.StopComponent(name), n.StartComponent(ctx, name))
}

// PID returns the process of a running component.
func (n *Node) PID(name string) int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.pids[name]
}

// Exited returns the exit code of a component that was started and has exited since without
// being stopped.
func (n *Node) Exited(name string) (code int, ok bool) {
	pid := n.PID(name)
	if pid == 0 {
		return 0, false
	}
	exited, code, err := n.holder.wait(pid, 0)
	// Still its process (not stopped on purpose meanwhile)?
	return code, err == nil && exited && n.PID(name) == pid
}

// EnsureRunning starts, in order, each of the components that is not running — stopped, or
// exited — trying up to three times each: what a fault stopped comes back whichever of its
// steps failed.
func (n *Node) EnsureRunning(ctx context.Context, names ...string) error {
	var errs []error
	for _, name := range names {
		if _, dead := n.Exited(name); !dead && n.PID(name) != 0 {
			continue
		}
		n.StopComponent(name) // forget an exited process
		var err error
		for attempt := range 3 {
			if err = n.StartComponent(ctx, name); err == nil || ctx.Err() != nil {
				break
			}
			n.StopComponent(name)
			SleepCtx(ctx, time.Duration(attempt+1)*2*time.Second)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("start %s again: %w", name, err))
		}
	}
	return errors.Join(errs...)
}

// Watch returns a context that ends, with the reason as its cause, when a component of the
// node, or of a node that joined it, exits without being stopped: every wait on that context
// then ends at once and says why, instead of waiting out its timeout on a dead node.
func (n *Node) Watch(parent context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancelCause(parent)
	go func() {
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			for _, node := range n.Nodes() {
				name, code, ok := node.deadComponent()
				// A node that leaves is out of the cluster before its components are killed.
				if !ok || (node != n && !slices.Contains(n.Nodes(), node)) {
					continue
				}
				cancel(fmt.Errorf("node %s: component %s exited with code %d; its log %s ends with:\n%s",
					node.Name, name, code, node.logPath(name), Tail(node.Log(name), 20)))
				return
			}
		}
	}()
	return ctx, func() { cancel(context.Canceled) }
}

// ExpectExit tells Watch that component name may exit from now on: kube-proxy exits when its
// node's Node object is deleted ("Node is being deleted"), as a node that leaves the cluster
// expects.
func (n *Node) ExpectExit(name string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.mayExit == nil {
		n.mayExit = map[string]bool{}
	}
	n.mayExit[name] = true
}

// deadComponent returns the first component (by name) that exited without being stopped or
// expected to.
func (n *Node) deadComponent() (name string, code int, ok bool) {
	n.mu.Lock()
	var names []string
	for name := range n.pids {
		if !n.mayExit[name] {
			names = append(names, name)
		}
	}
	n.mu.Unlock()
	slices.Sort(names)
	for _, name := range names {
		if code, ok := n.Exited(name); ok {
			return name, code, true
		}
	}
	return "", 0, false
}

// ready reports whether component name answers.
func (n *Node) ready(ctx context.Context, name string) bool {
	switch name {
	case "etcd":
		return n.httpOK(ctx, "http://127.0.0.1:2379/health", false)
	case "kube-apiserver":
		return n.httpOK(ctx, n.apiURL()+"/readyz", true)
	case "kube-controller-manager":
		return n.httpOK(ctx, "https://127.0.0.1:10257/healthz", false)
	case "kube-scheduler":
		return n.httpOK(ctx, "https://127.0.0.1:10259/healthz", false)
	case "kube-proxy":
		// Healthy once it has written its rules from the API's Services.
		return n.httpOK(ctx, "http://127.0.0.1:10256/healthz", false)
	case "prometheus":
		return n.httpOK(ctx, "http://"+PrometheusAddr+"/-/ready", false)
	case "cilium-agent":
		return n.httpOK(ctx, fmt.Sprintf("http://127.0.0.1:%d/healthz", ciliumHealthPort), false)
	case "containerd":
		// Its log is appended to across restarts: this start's part follows the last start line.
		log := n.Log(name)
		if !strings.Contains(log[max(strings.LastIndex(log, containerdStarting), 0):], containerdBooted) {
			return false
		}
		_, err := n.Run(ctx, n.Ctr("version")...)
		return err == nil
	case "kubelet":
		// Its own health endpoint first: the Node's Ready condition outlives a kubelet that
		// died (a kubelet that exited at start, its runtime restarting, still read as ready).
		if !n.httpOK(ctx, "http://127.0.0.1:10248/healthz", false) {
			return false
		}
		node, err := n.Client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
		if err != nil {
			return false
		}
		for _, c := range node.Status.Conditions {
			if c.Type == corev1.NodeReady {
				return c.Status == corev1.ConditionTrue
			}
		}
	}
	return false
}

// httpOK GETs url inside the node (as admin when admin is set) and reports a 200.
func (n *Node) httpOK(ctx context.Context, url string, admin bool) bool {
	client := &http.Client{Timeout: 2 * time.Second}
	if admin {
		rt, err := rest.TransportFor(n.Config)
		if err != nil {
			return false
		}
		client.Transport = rt
	} else {
		client.Transport = &http.Transport{
			DialContext:     netnsDialer{n.holder.netns()}.DialContext,
			TLSClientConfig: insecureTLS(),
		}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return false
	}
	resp, err := client.Do(req)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}
