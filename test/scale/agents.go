package scale

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"

	"github.com/detourmesh/detour/internal/cli"
	"github.com/detourmesh/detour/internal/ctxtime"
)

// Agent is detour's node agent on one simulated node: its pod (as the DaemonSet controller
// would create it) and its two containers, `detour install-cni` and `detour repair`, run in
// this process with the chart's arguments, a token bound to the pod (as the kubelet projects
// it) and the node's files in a directory of their own.
type Agent struct {
	Node string
	Dir  string
	Pod  *corev1.Pod
	// Health is where install-cni serves /readyz.
	Health string

	// started is when its containers started; ready how long after that its /readyz first
	// answered 200, once [Agent.awaitReady] saw it (zero until then).
	started time.Time
	ready   atomic.Int64

	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// StartAgent creates the agent pod of node i from ds's template and starts its containers.
func (c *Cluster) StartAgent(ctx context.Context, ds *appsv1.DaemonSet, i int) (*Agent, error) {
	node := NodeName(i)
	a := &Agent{Node: node, Dir: filepath.Join(c.Dir, "nodes", node), Health: healthAddr(i)}
	for _, d := range []string{"etc/cni/net.d", "opt/cni/bin", "run/detour-cni", "sa"} {
		if err := os.MkdirAll(filepath.Join(a.Dir, d), 0o755); err != nil {
			return nil, err
		}
	}
	// The primary CNI's conflist, which the agent chains detour into.
	if err := os.WriteFile(filepath.Join(a.Dir, "etc/cni/net.d/10-kwok.conflist"), []byte(primaryConflist), 0o644); err != nil {
		return nil, err
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			GenerateName: ds.Name + "-", Namespace: ds.Namespace, Labels: ds.Spec.Template.Labels,
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "DaemonSet", Name: ds.Name, UID: ds.UID, Controller: ptr.To(true)}},
		},
		Spec: *ds.Spec.Template.Spec.DeepCopy(),
	}
	pod.Spec.NodeName = node
	pod.Spec.Affinity = nil
	var err error
	if a.Pod, err = c.Client.CoreV1().Pods(ds.Namespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		return nil, fmt.Errorf("create the agent pod of %s: %w", node, err)
	}
	api, err := c.agentAPI(ctx, a)
	if err != nil {
		return nil, err
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	a.cancel = cancel
	stub := c.pluginStub()
	a.started = time.Now()
	for _, ctr := range ds.Spec.Template.Spec.Containers {
		args, err := a.args(ctr, stub, c.Config.Host)
		if err != nil {
			cancel()
			return nil, err
		}
		log, err := os.Create(filepath.Join(a.Dir, ctr.Name+".log"))
		if err != nil {
			cancel()
			return nil, err
		}
		a.wg.Add(1)
		go func() {
			defer a.wg.Done()
			defer log.Close()
			root := cli.NewRoot()
			root.SetArgs(args)
			root.SetOut(log)
			root.SetErr(log)
			if err := root.ExecuteContext(cli.WithEmbedded(runCtx, cli.Embedded{API: api})); err != nil && runCtx.Err() == nil {
				c.agentFailed(fmt.Errorf("%s on %s: %w", ctr.Name, node, err))
			}
		}()
	}
	return a, nil
}

// Ready reports whether install-cni's /readyz answers 200.
func (a *Agent) Ready(ctx context.Context) bool {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+a.Health+"/readyz", nil)
	if err != nil {
		return false
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// awaitReady polls install-cni's /readyz every 100 ms from now until it answers 200 or ctx
// ends, and records how long after its containers' start that was.
func (a *Agent) awaitReady(ctx context.Context) {
	for ctx.Err() == nil {
		if a.Ready(ctx) {
			a.ready.Store(int64(time.Since(a.started)))
			return
		}
		ctxtime.Sleep(ctx, 100*time.Millisecond)
	}
}

// readyAfter is how long after its start the agent was seen ready (zero: not yet).
func (a *Agent) readyAfter() time.Duration { return time.Duration(a.ready.Load()) }

// healthAddr is where node i's install-cni serves its probes: a loopback address of the node's
// own (all of 127.0.0.0/8 is the loopback's on Linux) and a fixed port. A port picked free on
// 127.0.0.1 and handed over could be taken meanwhile as the local port of one of the thousands
// of API connections the harness's agents open; the agent then failed to listen, never became
// ready, and the herd waited for it.
func healthAddr(i int) string {
	return net.JoinHostPort(fmt.Sprintf("127.%d.%d.%d", 100+i>>16, i>>8&0xff, i&0xff), "9641")
}

// agentFailed records the error an agent's container returned before it was stopped.
func (c *Cluster) agentFailed(err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.agentErrs = append(c.agentErrs, err)
}

// agentsFailed is an error that says how many agents' containers failed, and the first
// failure, or nil.
func (c *Cluster) agentsFailed() error {
	if errs := c.AgentErrors(); len(errs) > 0 {
		return fmt.Errorf("%d agents' containers failed, the first: %w", len(errs), errs[0])
	}
	return nil
}

// AgentErrors are what the agents' containers returned before they were stopped.
func (c *Cluster) AgentErrors() []error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.agentErrs)
}

// Stop stops the agent's containers, as SIGTERM does, and waits for them.
func (a *Agent) Stop() {
	if a.cancel != nil {
		a.cancel()
	}
	a.wg.Wait()
}

// agentAPI is the API configuration of a's containers: a token of the agent's service account
// bound to its pod, in the file the kubelet would project it to (client-go reads it again as
// it would in the pod), and a connection of its own, as each container has.
func (c *Cluster) agentAPI(ctx context.Context, a *Agent) (*rest.Config, error) {
	tr, err := c.Client.CoreV1().ServiceAccounts(a.Pod.Namespace).CreateToken(ctx, a.Pod.Spec.ServiceAccountName, &authv1.TokenRequest{
		Spec: authv1.TokenRequestSpec{
			ExpirationSeconds: ptr.To[int64](3607),
			BoundObjectRef:    &authv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: a.Pod.Name, UID: a.Pod.UID},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("request the token of %s's agent pod: %w", a.Node, err)
	}
	sa := filepath.Join(a.Dir, "sa")
	for name, data := range map[string][]byte{"token": []byte(tr.Status.Token), "ca.crt": c.Config.CAData, "namespace": []byte(a.Pod.Namespace)} {
		if err := os.WriteFile(filepath.Join(sa, name), data, 0o600); err != nil {
			return nil, err
		}
	}
	return &rest.Config{
		Host:            c.Config.Host,
		TLSClientConfig: rest.TLSClientConfig{CAData: c.Config.CAData},
		BearerTokenFile: filepath.Join(sa, "token"),
		// Set, client-go gives the configuration a transport of its own instead of sharing one
		// (and one HTTP/2 connection) with every other of the same CA.
		Proxy: func(*http.Request) (*url.URL, error) { return nil, nil },
	}, nil
}

// args are ctr's arguments in the chart, for a's node in this process: the node's directories
// for the host's, install-cni's probes on a port of its own and no other HTTP endpoint (the
// chart's ports would collide), and what the downward API and
// the image give a pod as flags.
func (a *Agent) args(ctr corev1.Container, stub, apiServer string) ([]string, error) {
	var out []string
	for _, arg := range ctr.Args {
		if !strings.HasPrefix(arg, "--") {
			out = append(out, arg) // the subcommand
			continue
		}
		name, value, _ := strings.Cut(arg, "=")
		switch name {
		case "--cni-conf-dir", "--host-cni-conf-dir":
			value = filepath.Join(a.Dir, "etc/cni/net.d")
		case "--cni-bin-dir":
			value = filepath.Join(a.Dir, "opt/cni/bin")
		case "--health-probe-bind-address":
			value = ""
			if ctr.Name == "install-cni" {
				value = a.Health // its readiness, which the herds wait for
			}
		case "--metrics-bind-address":
			value = ""
		case "--merge-metrics-from":
			continue
		}
		out = append(out, name+"="+value)
	}
	switch ctr.Name {
	case "install-cni":
		out = append(out, "--node-name="+a.Node, "--pod-name="+a.Pod.Name, "--pod-namespace="+a.Pod.Namespace,
			"--plugin-source="+stub, "--plugin-stats-file="+filepath.Join(a.Dir, "run/detour-cni/detour-cni-stats"),
			"--service-account-dir="+filepath.Join(a.Dir, "sa"), "--api-server="+apiServer)
	case "repair":
		out = append(out, "--node-name="+a.Node, "--namespace="+a.Pod.Namespace)
	default:
		return nil, fmt.Errorf("the chart's DaemonSet has a container %q the harness does not know", ctr.Name)
	}
	return out, nil
}

// pluginStub is the file every agent installs as detour-cni: no CNI ADD runs on a simulated
// node, and the agent only copies and hashes the binary.
func (c *Cluster) pluginStub() string { return filepath.Join(c.Dir, "detour-cni-stub") }

// primaryConflist stands in for the primary CNI's configuration on a simulated node.
const primaryConflist = `{"cniVersion": "1.0.0", "name": "kwok", "plugins": [{"type": "bridge"}]}
`
