// Package demo is `make demo`: detour end to end on one machine. It starts a real
// kube-apiserver and etcd, runs the real webhook over TLS registered with them, admits the
// workload of testdata/workloads/demo.yaml, and then plays one node in network namespaces —
// the reference bridge plugin as the primary CNI, the real node agent installing detour's
// entry, the real plugin run through libcni, and processes standing in for the pod's
// containers — narrating each step. Without root it runs the API half only.
package demo

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
	"sigs.k8s.io/yaml"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/internal/controlplane"
	"github.com/detourmesh/detour/webhook"
)

// Options are the demo's inputs.
type Options struct {
	Out io.Writer
	// Detour and DetourCNI are the built binaries (make build).
	Detour, DetourCNI string
	// TestBinDir holds kube-apiserver, etcd and the reference CNI plugins
	// (hack/test-binaries.sh).
	TestBinDir string
	// Workload is the YAML of the demo's Deployment.
	Workload string
}

// webhookConfig is the webhook's configuration file in the demo. The proxy is played by a
// process of the demo, so its image is never pulled.
const webhookConfig = `# detour webhook configuration (docs/webhook.md); everything else takes its default.
proxy:
  image: registry.example/demo-proxy:stand-in
# Admit pods whose init containers cannot be given egress, with a warning.
conflictPolicy: warn
`

// The demo's Kubernetes names.
const (
	appNamespace    = "shop"
	detourNamespace = "detour-system"
	nodeName        = "demo-node"
)

type demo struct {
	Options
	n        *narrator
	work     string // temporary directory, removed at the end
	cleanups []func()

	env        *envtest.Environment
	cfg        *rest.Config
	client     kubernetes.Interface
	kubeconfig string // the admin kubeconfig file
	warnings   *warningLog
	pod        *corev1.Pod // the demo pod, as the webhook admitted it
}

// Run plays the demo; it returns an error when a step did not do what it should. It cleans up
// everything it made, also when ctx is cancelled (Ctrl-C).
func Run(ctx context.Context, o Options) (err error) {
	d := &demo{Options: o, n: &narrator{w: o.Out, start: time.Now()}, warnings: &warningLog{}}
	fmt.Fprintln(o.Out, "detour demo: the delayed redirect, end to end on this machine")
	d.work, err = os.MkdirTemp("", "detour-demo-")
	if err != nil {
		return err
	}
	interrupted := func() bool { return ctx.Err() != nil }
	steps := []func(context.Context) error{d.startControlPlane, d.startWebhook, d.admitWorkload}
	if os.Geteuid() == 0 {
		steps = append(steps, d.playNode)
	}
	for _, step := range steps {
		if err := step(ctx); err != nil {
			if !interrupted() {
				d.n.Fail("%v", err)
			}
			break
		}
	}
	if os.Geteuid() != 0 && !interrupted() {
		d.n.Section("Node (skipped)")
		d.n.Note("Skipped: playing the node needs root — network namespaces, the bridge plugin and iptables.")
		d.n.Note("Run `sudo make demo` to see the CNI plugin install the redirect and the pod's processes use it.")
	}
	d.cleanup()
	if interrupted() {
		return errors.New("interrupted; everything the demo made was removed")
	}
	return d.summary()
}

func (d *demo) summary() error {
	took := time.Since(d.n.start).Round(100 * time.Millisecond)
	if len(d.n.failures) > 0 {
		fmt.Fprintf(d.Out, "\n✗ the demo found %d problem(s) in %s (see above).\n", len(d.n.failures), took)
		return fmt.Errorf("%d step(s) failed", len(d.n.failures))
	}
	fmt.Fprintf(d.Out, "\n✓ every step did what it should, in %s.\n", took)
	return nil
}

// onCleanup registers fn to run at the end, in reverse order.
func (d *demo) onCleanup(fn func()) { d.cleanups = append(d.cleanups, fn) }

func (d *demo) cleanup() {
	d.n.Section("Cleanup")
	for i := len(d.cleanups) - 1; i >= 0; i-- {
		d.cleanups[i]()
	}
	os.RemoveAll(d.work)
	d.n.OK("stopped every process the demo started and removed what it made (%s)", d.work)
}

func (d *demo) startControlPlane(ctx context.Context) error {
	d.n.Section("Control plane")
	start := time.Now()
	d.env = controlplane.New(d.TestBinDir)
	path := strings.TrimPrefix(webhook.MutatePath, "/") // envtest joins host:port and path with a slash
	fail, reinvoke, none := admissionv1.Fail, admissionv1.IfNeededReinvocationPolicy, admissionv1.SideEffectClassNone
	d.env.WebhookInstallOptions.MutatingWebhooks = []*admissionv1.MutatingWebhookConfiguration{{
		ObjectMeta: metav1.ObjectMeta{Name: "detour"},
		Webhooks: []admissionv1.MutatingWebhook{{
			Name:                    "inject.detour.dev",
			AdmissionReviewVersions: []string{"v1"},
			SideEffects:             &none,
			FailurePolicy:           &fail,
			ReinvocationPolicy:      &reinvoke,
			ClientConfig: admissionv1.WebhookClientConfig{
				Service: &admissionv1.ServiceReference{Name: "detour-webhook", Namespace: detourNamespace, Path: &path},
			},
			Rules: []admissionv1.RuleWithOperations{{
				Operations: []admissionv1.OperationType{admissionv1.Create},
				Rule:       admissionv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"pods"}},
			}},
			NamespaceSelector: &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{
				Key: "kubernetes.io/metadata.name", Operator: metav1.LabelSelectorOpNotIn, Values: []string{detourNamespace, "kube-system"},
			}}},
		}},
	}}
	cfg, err := d.env.Start()
	if err != nil {
		return fmt.Errorf("start kube-apiserver and etcd from %s: %w (run hack/test-binaries.sh)", d.TestBinDir, err)
	}
	d.onCleanup(func() { _ = d.env.Stop() })
	cfg.WarningHandler = d.warnings
	d.cfg = cfg
	d.client = kubernetes.NewForConfigOrDie(cfg)
	d.kubeconfig = filepath.Join(d.work, "admin.kubeconfig")
	if err = controlplane.WriteKubeconfig(d.kubeconfig, cfg); err != nil {
		return err
	}
	info, err := d.client.Discovery().ServerVersion()
	if err != nil {
		return err
	}
	d.n.OK("kube-apiserver %s and etcd running on %s (%s)", info.GitVersion, cfg.Host, time.Since(start).Round(100*time.Millisecond))
	return nil
}

func (d *demo) startWebhook(ctx context.Context) error {
	d.n.Section("Webhook")
	config := filepath.Join(d.work, "webhook.yaml")
	if err := os.WriteFile(config, []byte(webhookConfig), 0o644); err != nil {
		return err
	}
	wio := d.env.WebhookInstallOptions
	port := strconv.Itoa(wio.LocalServingPort)
	logPath := filepath.Join(d.work, "webhook.log")
	proc, err := d.start(ctx, logPath, d.Detour, "webhook", "--config", config, "--cert-dir", wio.LocalServingCertDir,
		"--host", wio.LocalServingHost, "--port", port, "--kubeconfig", d.kubeconfig, "--namespace", detourNamespace,
		"--metrics-bind-address", "0", "--health-probe-bind-address", "127.0.0.1:0")
	if err != nil {
		return err
	}
	addr := net.JoinHostPort(wio.LocalServingHost, port)
	if err := waitFor(ctx, 20*time.Second, func() (bool, error) {
		if !proc.running() {
			return false, errors.New("it exited")
		}
		c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
		if err == nil {
			c.Close()
		}
		return err == nil, nil
	}); err != nil {
		return fmt.Errorf("the webhook did not start serving on %s: %w\n%s", addr, err, tail(logPath))
	}
	d.n.OK("detour webhook serving TLS on %s%s (log: %s)", addr, webhook.MutatePath, logPath)
	d.n.OK("registered as MutatingWebhookConfiguration \"detour\": pods, CREATE, reinvocationPolicy IfNeeded, sideEffects None")
	return nil
}

func (d *demo) admitWorkload(ctx context.Context) error {
	d.n.Section("Workload")
	_, err := d.client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{
		Name: appNamespace, Annotations: map[string]string{annotations.Inject: string(annotations.InjectEnabled)},
	}}, metav1.CreateOptions{})
	if !d.n.Check(err, "namespace %s opted in with %s=%s", appNamespace, annotations.Inject, annotations.InjectEnabled) {
		return nil
	}
	pod, err := d.createDemoPod(ctx, "demo-", nil)
	if err != nil {
		return err
	}
	d.pod = pod
	d.showInjected(pod)
	return nil
}

// createDemoPod creates the pod the demo Deployment's ReplicaSet would (no controller-manager
// runs here), with extra annotations, and reports the webhook's warnings.
func (d *demo) createDemoPod(ctx context.Context, generateName string, extra map[string]string) (*corev1.Pod, error) {
	data, err := os.ReadFile(d.Workload)
	if err != nil {
		return nil, err
	}
	var deploy appsv1.Deployment
	if err := yaml.UnmarshalStrict(data, &deploy); err != nil {
		return nil, fmt.Errorf("read the Deployment in %s: %w", d.Workload, err)
	}
	tmpl := deploy.Spec.Template
	pod := &corev1.Pod{ObjectMeta: *tmpl.ObjectMeta.DeepCopy(), Spec: *tmpl.Spec.DeepCopy()}
	pod.GenerateName, pod.Namespace = generateName, appNamespace
	if pod.Annotations == nil {
		pod.Annotations = map[string]string{}
	}
	for k, v := range extra {
		pod.Annotations[k] = v
	}
	d.warnings.reset()
	created, err := d.client.CoreV1().Pods(appNamespace).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		return nil, fmt.Errorf("create the pod of %s: %w", d.Workload, err)
	}
	d.n.OK("pod %s/%s created from %s (the pod its ReplicaSet would create)", appNamespace, created.Name, filepath.Base(d.Workload))
	if !annotations.IsInjected(created.Annotations) {
		d.n.Fail("the webhook did not inject the pod")
		return created, nil
	}
	warnings := d.warnings.all()
	d.n.OK("the webhook injected it; kubectl apply would print %d warning(s):", len(warnings))
	for _, w := range warnings {
		d.n.Note("Warning: %s", w)
	}
	return created, nil
}

// showInjected prints what the webhook changed in the pod.
func (d *demo) showInjected(pod *corev1.Pod) {
	d.n.Note("The injected pod:")
	var b strings.Builder
	describe := func(kind string, cs []corev1.Container) {
		for _, c := range cs {
			fmt.Fprintf(&b, "%-15s %-17s %s\n", kind, c.Name, identityOf(pod, c))
		}
	}
	describe("initContainer", pod.Spec.InitContainers)
	describe("container", pod.Spec.Containers)
	b.WriteString("annotations:\n")
	for _, k := range annotations.WebhookKeys {
		if v, ok := pod.Annotations[k]; ok {
			fmt.Fprintf(&b, "  %s: %q\n", k, v)
		}
	}
	d.n.Block(b.String())
}

// identityOf describes the UID and GID a container runs as.
func identityOf(pod *corev1.Pod, c corev1.Container) string {
	id, explicit := containerIdentity(pod, c)
	if !explicit {
		if id.GID != 0 {
			return fmt.Sprintf("image's default user, gid %d", id.GID)
		}
		return "image's default user"
	}
	s := fmt.Sprintf("uid %d gid %d", id.UID, id.GID)
	if c.RestartPolicy != nil && *c.RestartPolicy == corev1.ContainerRestartPolicyAlways {
		s += " (native sidecar)"
	}
	return s
}

// warningLog collects the API server's warnings, as kubectl prints them.
type warningLog struct {
	mu   sync.Mutex
	list []string
}

func (w *warningLog) HandleWarningHeader(_ int, _ string, text string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.list = append(w.list, text)
}

func (w *warningLog) reset() { w.mu.Lock(); w.list = nil; w.mu.Unlock() }

func (w *warningLog) all() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]string(nil), w.list...)
}

// process is a component the demo started.
type process struct {
	cmd  *exec.Cmd
	done chan struct{}
}

func (p *process) running() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// start runs a component in the background with its output in logPath; it is stopped with
// SIGTERM at cleanup.
func (d *demo) start(ctx context.Context, logPath, name string, args ...string) (*process, error) {
	log, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(name, args...)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		log.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &process{cmd: cmd, done: make(chan struct{})}
	go func() { cmd.Wait(); log.Close(); close(p.done) }()
	d.onCleanup(func() { p.stop() })
	return p, nil
}

// stop sends SIGTERM and waits a little, then kills.
func (p *process) stop() {
	if !p.running() {
		return
	}
	_ = p.cmd.Process.Signal(os.Interrupt)
	select {
	case <-p.done:
	case <-time.After(5 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// waitFor polls cond until it holds or fails, ctx ends or timeout passes.
func waitFor(ctx context.Context, timeout time.Duration, cond func() (bool, error)) error {
	deadline := time.Now().Add(timeout)
	for {
		ok, err := cond()
		if ok || err != nil {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not within %s", timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// tail returns the last lines of a log file, for error messages.
func tail(path string) string {
	b, _ := os.ReadFile(path)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return strings.Join(lines[max(0, len(lines)-10):], "\n")
}
