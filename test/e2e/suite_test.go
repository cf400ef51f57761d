package e2e

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"sigs.k8s.io/yaml"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/test/images"
	"github.com/detourmesh/detour/validator"
)

// The e2e suite shares one node between its stories, in the order a cluster lives them: a new
// node joins tainted, detour is installed, workloads run, the node breaks and is repaired,
// detour is uninstalled and installed again from install.yaml. TestMain stops the node.

const (
	detourNamespace = "detour-system"
	// serverPort is where the test server outside every pod listens, on the node's IP.
	serverPort = 8080
)

// env is the shared node with detour's artifacts.
type env struct {
	node *Node
	art  *artifacts
	root string // the module's root
	// server is the address of the test server outside the pods ("the internet").
	server string
	// img is where detour's chart and the pods' images come from now.
	img imageSet
	// registry is the cluster's registry, once a story started it (cluster_stories_test.go).
	registry *Registry
	// registryImages is the image set of the registry, once it holds the images.
	registryImages imageSet
}

// imageSet is where the e2e installs detour's chart from and where its pods' images come
// from: imported into the node's containerd (pull policy Never) and the chart's directory, or
// the cluster's registry (cluster_stories_test.go).
type imageSet struct {
	repo, tag string // detour's image
	refs      images.Refs
	pull      corev1.PullPolicy
	// chart is helm's chart argument and the flags that go with it.
	chart []string
}

var shared struct {
	once sync.Once
	env  *env
	err  error
	// The artifacts, built once for every cluster of the run.
	artOnce sync.Once
	art     *artifacts
	artErr  error
}

func TestMain(m *testing.M) {
	ServeHolder()
	code := m.Run()
	if shared.env != nil {
		if r := shared.env.registry; r != nil {
			if err := r.Close(); err != nil {
				fmt.Fprintln(os.Stderr, "e2e: stop the registry:", err)
			}
		}
		if err := shared.env.node.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "e2e: stop the node:", err)
			code = 1
		}
	}
	if shared.art != nil {
		os.RemoveAll(shared.art.dir)
	}
	os.Exit(code)
}

// setUp returns the shared node, starting it on first use: the artifacts are built, the node
// registers with detour's startup taint, and the test server runs outside the pods.
func setUp(t testing.TB) *env {
	t.Helper()
	bin := requireNode(t)
	shared.once.Do(func() { shared.env, shared.err = newEnv(bin, Options{Taints: []string{StartupTaint + ":NoSchedule"}}) })
	if shared.err != nil {
		t.Fatalf("set up the node: %v", shared.err)
	}
	return shared.env
}

// ownEnv starts a cluster of the test's own with opts and stops it, with its registry, when
// the test ends. It must not run beside the shared node (setUp): they take the same addresses.
func ownEnv(t *testing.T, opts Options) *env {
	t.Helper()
	e, err := newEnv(requireNode(t), opts)
	if err != nil {
		t.Fatalf("start the test's cluster: %v", err)
	}
	t.Cleanup(func() {
		if e.registry != nil {
			if err := e.registry.Close(); err != nil {
				t.Errorf("stop the registry: %v", err)
			}
		}
		if err := e.node.Stop(); err != nil {
			t.Errorf("stop the test's cluster: %v", err)
		}
	})
	return e
}

// newEnv builds the artifacts (once per run) and starts a control-plane node with opts (its
// taints, flannel), the artifacts' images and CoreDNS.
func newEnv(bin string, opts Options) (*env, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	root, err := moduleRoot()
	if err != nil {
		return nil, err
	}
	shared.artOnce.Do(func() { shared.art, shared.artErr = buildArtifacts(ctx, root, bin) })
	if shared.artErr != nil {
		return nil, fmt.Errorf("build detour's image and the test images: %w", shared.artErr)
	}
	art := shared.art
	opts.Images, opts.PauseImage, opts.DNSImage = art.tarballs, art.refs.Pause, DNSImageRef
	n, err := Start(ctx, bin, opts)
	if err != nil {
		return nil, err
	}
	e := &env{node: n, art: art, root: root, server: fmt.Sprintf("%s:%d", nodeIP, serverPort)}
	e.img = e.importedImages()
	argv := []string{art.workloadBin, "serve", "-listen", e.server}
	if _, err := n.holder.start(argv, n.env(), n.logPath("test-server"), ""); err != nil {
		n.Stop()
		return nil, fmt.Errorf("start the test server: %w", err)
	}
	return e, nil
}

func moduleRoot() (string, error) {
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Dir}}").Output()
	if err != nil {
		return "", fmt.Errorf("find the module's root: %w", err)
	}
	return strings.TrimSpace(string(out)), nil
}

// installDetour installs (or upgrades) detour's chart with the e2e values and extra, and
// waits for the webhook; the node agent is scheduled only on nodes labelled
// e2e.detour.dev/agent=yes, so a story decides when it arrives.
func (e *env) installDetour(t testing.TB, ctx context.Context, extra string) {
	t.Helper()
	values := filepath.Join(e.node.Dir, "values.yaml")
	if err := os.WriteFile(values, []byte(e.values()), 0o644); err != nil {
		t.Fatal(err)
	}
	extraPath := filepath.Join(e.node.Dir, "values-extra.yaml")
	if err := os.WriteFile(extraPath, []byte(extra), 0o644); err != nil {
		t.Fatal(err)
	}
	args := append(append([]string{"upgrade", "--install", "detour"}, e.img.chart...),
		"--namespace", detourNamespace, "--create-namespace", "--values", values, "--values", extraPath, "--wait", "--timeout", "4m")
	out, err := e.node.Helm(ctx, args...)
	if err != nil {
		t.Fatalf("helm install detour: %v\n%s\n%s", err, out, e.describe(ctx, detourNamespace))
	}
}

// agentLabel gates the node agent's DaemonSet in the e2e values.
const agentLabel = "e2e.detour.dev/agent"

// values are the chart values the e2e installs with: detour's image as built, the test proxy,
// the node's CNI directories, the plugin's log where the test reads it.
func (e *env) values() string {
	return fmt.Sprintf(`createNamespace: false
image:
  repository: %[1]s
  tag: %[2]s
  pullPolicy: %[3]s
webhook:
  replicas: 1
  failurePolicy: Fail
  config:
    proxy:
      image: %[4]s
      imagePullPolicy: %[3]s
      # Known to the webhook, so that the validator's check runs at the proxy's start
      # (validator.mode auto on this 1.37 node with containerd 2.4); a name, found on the
      # image's PATH as the runtime would.
      command: [testproxy]
      startupProbe:
        tcpSocket: {port: 4191}
        periodSeconds: 1
        failureThreshold: 30
nodeAgent:
  cniConfDir: %[5]s
  cniBinDir: %[6]s
  resync: 2s
  nodeSelector:
    %[7]s: "yes"
  plugin:
    logLevel: debug
    logFile: %[8]s
  repair:
    rate: 5
    burst: 5
`, e.img.repo, e.img.tag, e.img.pull, e.img.refs.Proxy, e.node.CNIConfDir, e.node.CNIBinDir, agentLabel, e.pluginLogPath())
}

// importedImages are the images as the node imported them and the chart's directory.
func (e *env) importedImages() imageSet {
	return imageSet{
		repo: e.art.repo, tag: e.art.tag, refs: e.art.refs, pull: corev1.PullNever,
		chart: []string{filepath.Join(e.root, "manifests", "charts", "detour")},
	}
}

func (e *env) pluginLogPath() string { return nodePluginLog(e.node) }

// nodePluginLog is detour-cni's log on node n (the chart's plugin.logFile, each node's own).
func nodePluginLog(n *Node) string { return filepath.Join(n.Dir, "logs", "detour-cni.log") }

// setAgent puts the node agent on the control-plane node (present) or takes it away.
func (e *env) setAgent(t testing.TB, ctx context.Context, present bool) {
	t.Helper()
	e.setNodeAgent(t, ctx, e.node, present)
}

// namespace creates ns, opted in to injection when inject is set, and waits for its default
// ServiceAccount.
func (e *env) namespace(t testing.TB, ctx context.Context, ns string, inject bool) {
	t.Helper()
	obj := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}
	if inject {
		obj.Annotations = map[string]string{"detour.dev/inject": "enabled"}
	}
	if _, err := e.node.Client.CoreV1().Namespaces().Create(ctx, obj, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	if err := e.node.waitServiceAccount(ctx, ns); err != nil {
		t.Fatalf("namespace %s has no default ServiceAccount: %v", ns, err)
	}
}

// waitFor polls cond until it holds; on timeout the test fails naming what, and what cond
// saw last.
func waitFor(t testing.TB, ctx context.Context, what string, timeout time.Duration, cond func() (bool, error)) {
	t.Helper()
	if err := poll(ctx, timeout, cond); err != nil {
		t.Fatalf("waiting for %s: %v", what, err)
	}
}

// progress is what a condition saw while it does not hold yet (see [seen]).
type progress struct{ msg string }

func (p progress) Error() string { return p.msg }

// seen describes what a condition saw, for the message of a wait that times out: a condition
// returns (done, seen(...)). Unlike its other errors, which make poll retry, it does not stop a
// condition that holds from ending the wait.
func seen(format string, args ...any) error { return progress{fmt.Sprintf(format, args...)} }

// poll runs cond every 250 ms until it holds, timeout passes or ctx ends (the test's deadline,
// or a node component that died: see [Node.Watch]). cond's errors are retried; the last one, or
// the last thing cond said it saw, is part of the error.
func poll(ctx context.Context, timeout time.Duration, cond func() (bool, error)) error {
	var last error
	start := time.Now()
	err := wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, timeout, true, func(context.Context) (bool, error) {
		ok, err := cond()
		var p progress
		if errors.As(err, &p) {
			last = err
			return ok, nil
		}
		if err != nil {
			last = err
			return false, nil
		}
		return ok, nil
	})
	if err == nil {
		return nil
	}
	msg := fmt.Sprintf("not within %s", timeout)
	if ctx.Err() != nil {
		msg = fmt.Sprintf("gave up after %s: %v", time.Since(start).Round(time.Second), context.Cause(ctx))
	}
	if last != nil {
		msg += "; last seen: " + last.Error()
	}
	return errors.New(msg)
}

// testContext returns the context a long test runs in: want from now, but ending cleanup
// before go test's -timeout would (a test that reaches go test's timeout ends in a goroutine
// dump, not with what it waited for), and watching node n, if any (see [Node.Watch]).
func testContext(t testing.TB, n *Node, want time.Duration) (context.Context, context.CancelFunc) {
	deadline := time.Now().Add(want)
	cause := fmt.Errorf("the test's own limit of %s passed", want)
	if d, ok := t.(interface{ Deadline() (time.Time, bool) }); ok {
		if gotest, ok := d.Deadline(); ok && gotest.Add(-cleanupMargin).Before(deadline) {
			deadline = gotest.Add(-cleanupMargin)
			cause = fmt.Errorf("go test's -timeout ends at %s; the test stops %s before, to clean up and report", gotest.Format(time.TimeOnly), cleanupMargin)
		}
	}
	ctx, cancelDeadline := context.WithDeadlineCause(context.Background(), deadline, cause)
	if n == nil {
		return ctx, cancelDeadline
	}
	ctx, cancelWatch := n.Watch(ctx)
	return ctx, func() { cancelWatch(); cancelDeadline() }
}

// cleanupMargin is the time a test keeps, before go test's -timeout, to report and to stop the node.
const cleanupMargin = 3 * time.Minute

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// checkExit is the outcome of p's validator check wherever it runs: 0 once it passed, the exit
// code of its last failed run, or -1 while no run has ended. In the detour-validator init
// container that is the container's last termination; at the proxy's start, the check passed
// when the proxy started (its startup probe passed), and failed as validator.LastFailure says.
func checkExit(p *corev1.Pod) int {
	if validator.CheckContainer(p) == annotations.ValidatorContainer {
		return initExit(p, annotations.ValidatorContainer)
	}
	code, running, failed := validator.LastFailure(p)
	if failed && !running {
		return int(code)
	}
	for _, s := range p.Status.InitContainerStatuses {
		if s.Name == annotations.ProxyContainer && s.Started != nil && *s.Started {
			return 0
		}
	}
	if failed { // a new run under way after a failed one
		return int(code)
	}
	return -1
}

// folded reports whether p's check runs at its proxy's start.
func folded(p *corev1.Pod) bool {
	return p.Annotations[annotations.Validator] == string(annotations.ValidatorImageVolume)
}

// initExit returns the exit code of init container name's last termination, or -1.
func initExit(p *corev1.Pod, name string) int {
	for _, s := range p.Status.InitContainerStatuses {
		if s.Name != name {
			continue
		}
		if s.State.Terminated != nil {
			return int(s.State.Terminated.ExitCode)
		}
		if s.LastTerminationState.Terminated != nil {
			return int(s.LastTerminationState.Terminated.ExitCode)
		}
	}
	return -1
}

// logs returns a container's log.
func (e *env) logs(ctx context.Context, ns, pod, container string) string {
	data, err := e.node.Client.CoreV1().Pods(ns).GetLogs(pod, &corev1.PodLogOptions{Container: container}).DoRaw(ctx)
	if err != nil {
		return fmt.Sprintf("(no log of %s/%s %s: %v)", ns, pod, container, err)
	}
	return string(data)
}

// logsAll is what container logged in every instance the kubelet still keeps: the previous
// one's log (when it restarted) before the current one's, so a count of connections does not
// lose those an earlier instance carried.
func (e *env) logsAll(ctx context.Context, ns, pod, container string) string {
	prev, err := e.node.Client.CoreV1().Pods(ns).GetLogs(pod, &corev1.PodLogOptions{Container: container, Previous: true}).DoRaw(ctx)
	if err != nil {
		return e.logs(ctx, ns, pod, container)
	}
	return string(prev) + "(restarted)\n" + e.logs(ctx, ns, pod, container)
}

// describe summarises the pods and events of ns for a failure message.
func (e *env) describe(ctx context.Context, ns string) string {
	var b strings.Builder
	pods, _ := e.node.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	for _, p := range pods.Items {
		status, _ := yaml.Marshal(p.Status)
		fmt.Fprintf(&b, "pod %s/%s:\n%s\n", ns, p.Name, status)
	}
	events, _ := e.node.Client.CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
	for _, ev := range events.Items {
		fmt.Fprintf(&b, "event %s %s %s: %s\n", ev.InvolvedObject.Name, ev.Type, ev.Reason, ev.Message)
	}
	return b.String()
}

// ensureInstalled installs detour with its node agent on the node (a no-op upgrade when a
// story already did), for what runs without the stories.
func (e *env) ensureInstalled(t testing.TB, ctx context.Context) {
	t.Helper()
	e.installDetour(t, ctx, "")
	e.setAgent(t, ctx, true)
}
