// Package scale is the scale harness of issue 45 (docs/scale.md): the real kube-apiserver and
// etcd, KWOK simulating N nodes and their pods' lifecycles, detour's chart applied, and on every
// simulated node the node agent's two containers — `detour install-cni` and `detour repair`, the
// very commands of the DaemonSet, run in this process with the chart's arguments and a token
// bound to the node's agent pod — while the API server's audit log attributes every request to
// the part and the node that made it.
package scale

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/detourmesh/detour/internal/controlplane"
)

// Cluster is the control plane and KWOK.
type Cluster struct {
	// Dir holds everything the run writes: the audit log, the nodes' directories, the logs.
	Dir string
	// Config and Client reach the API server as its admin.
	Config *rest.Config
	Client kubernetes.Interface
	// Kubeconfig is the admin's kubeconfig (for helm, kubectl and KWOK).
	Kubeconfig string
	// AuditLog is the API server's audit log, JSON lines.
	AuditLog string
	// BinDir holds hack/test-binaries.sh's binaries.
	BinDir string
	// WebhookAddr is where the API server calls detour's webhook; WebhookCertDir holds the
	// serving certificate (tls.crt, tls.key) its caBundle trusts.
	WebhookAddr, WebhookCertDir string

	env  *envtest.Environment
	kwok *exec.Cmd
	done chan error

	mu        sync.Mutex
	agentErrs []error
}

// StartCluster starts kube-apiserver and etcd with an audit log and webhook (detour's
// MutatingWebhookConfiguration, calling WebhookAddr instead of the Service), and KWOK managing
// the nodes annotated kwok.x-k8s.io/node=fake.
func StartCluster(ctx context.Context, binDir, dir string, webhook *admissionv1.MutatingWebhookConfiguration) (c *Cluster, err error) {
	c = &Cluster{Dir: dir, BinDir: binDir, AuditLog: filepath.Join(dir, "audit.jsonl")}
	policy := filepath.Join(dir, "audit-policy.yaml")
	if err := os.WriteFile(policy, []byte(auditPolicy), 0o644); err != nil {
		return nil, err
	}
	c.env = controlplane.New(binDir)
	webhook = webhook.DeepCopy()
	for i := range webhook.Webhooks {
		if svc := webhook.Webhooks[i].ClientConfig.Service; svc != nil && svc.Path != nil {
			// envtest joins its address and the path with a slash of its own.
			svc.Path = ptr.To(strings.TrimPrefix(*svc.Path, "/"))
		}
	}
	c.env.WebhookInstallOptions.MutatingWebhooks = []*admissionv1.MutatingWebhookConfiguration{webhook}
	args := c.env.ControlPlane.APIServer.Configure()
	args.Set("audit-policy-file", policy)
	args.Set("audit-log-path", c.AuditLog)
	args.Set("audit-log-format", "json")
	// One file, never rotated (the API server rotates at 100 MB by default, which a run of
	// 1,000 nodes passes before its herd ends: the harness read the last file only).
	args.Set("audit-log-maxsize", "0")
	// The API server's defaults for a cluster of its size: what a herd of agents meets.
	args.Set("max-requests-inflight", "400")
	args.Set("max-mutating-requests-inflight", "200")
	if c.Config, err = c.env.Start(); err != nil {
		return nil, fmt.Errorf("start kube-apiserver and etcd from %s: %w", binDir, err)
	}
	defer func() {
		if err != nil {
			c.Stop()
		}
	}()
	c.Config.QPS, c.Config.Burst = 500, 1000
	if c.Client, err = kubernetes.NewForConfig(c.Config); err != nil {
		return c, err
	}
	wio := c.env.WebhookInstallOptions
	c.WebhookAddr = net.JoinHostPort(wio.LocalServingHost, strconv.Itoa(wio.LocalServingPort))
	c.WebhookCertDir = wio.LocalServingCertDir
	c.Kubeconfig = filepath.Join(dir, "admin.kubeconfig")
	if err := controlplane.WriteKubeconfig(c.Kubeconfig, c.Config); err != nil {
		return c, err
	}
	return c, c.startKWOK(ctx)
}

// startKWOK runs KWOK with the stages test-binaries.sh copied from its module.
func (c *Cluster) startKWOK(ctx context.Context) error {
	stages, err := filepath.Glob(filepath.Join(c.BinDir, "kwok-stages", "*.yaml"))
	if err != nil || len(stages) == 0 {
		return fmt.Errorf("no KWOK stages in %s (run hack/test-binaries.sh)", filepath.Join(c.BinDir, "kwok-stages"))
	}
	docs := []string{kwokConfig}
	for _, s := range stages {
		data, err := os.ReadFile(s)
		if err != nil {
			return err
		}
		docs = append(docs, string(data))
	}
	config := filepath.Join(c.Dir, "kwok.yaml")
	if err := os.WriteFile(config, []byte(strings.Join(docs, "\n---\n")), 0o644); err != nil {
		return err
	}
	log, err := os.Create(filepath.Join(c.Dir, "kwok.log"))
	if err != nil {
		return err
	}
	c.kwok = exec.Command(filepath.Join(c.BinDir, "kwok"), "--kubeconfig", c.Kubeconfig, "--config", config)
	c.kwok.Stdout, c.kwok.Stderr = log, log
	if err := c.kwok.Start(); err != nil {
		log.Close()
		return fmt.Errorf("start kwok: %w", err)
	}
	c.done = make(chan error, 1)
	go func() { c.done <- c.kwok.Wait(); log.Close() }()
	return nil
}

// KWOKExited reports KWOK's exit, if it exited.
func (c *Cluster) KWOKExited() error {
	select {
	case err := <-c.done:
		c.done <- err
		return fmt.Errorf("kwok exited: %v (log: %s)", err, filepath.Join(c.Dir, "kwok.log"))
	default:
		return nil
	}
}

// Stop stops KWOK and the control plane.
func (c *Cluster) Stop() error {
	var errs []error
	if c.kwok != nil && c.kwok.Process != nil {
		c.kwok.Process.Signal(os.Interrupt)
		select {
		case <-c.done:
		case <-time.After(10 * time.Second):
			c.kwok.Process.Kill()
			<-c.done
		}
	}
	if c.env != nil {
		errs = append(errs, c.env.Stop())
	}
	return errors.Join(errs...)
}

// auditPolicy records every request's metadata at its end (and a watch's start, to count the
// open ones) but the Leases KWOK renews for every node, which detour never touches.
const auditPolicy = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: None
  resources: [{group: coordination.k8s.io, resources: [leases]}]
- level: Metadata
`

// kwokConfig has KWOK manage the simulated nodes only, renewing their Leases every 40 s as a
// kubelet does; the parallelism is KWOK's defaults, which it does not apply to a configuration
// file.
const kwokConfig = `apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokConfiguration
options:
  manageNodesWithAnnotationSelector: kwok.x-k8s.io/node=fake
  nodeLeaseDurationSeconds: 40
  podPlayStageParallelism: 4
  nodePlayStageParallelism: 4
  nodeLeaseParallelism: 4
  podsOnNodeSyncParallelism: 1
`
