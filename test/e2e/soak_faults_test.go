package e2e

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/detourmesh/detour/internal/fsutil"
	"github.com/detourmesh/detour/test/e2e/framework"
)

// faultKind names a fault the soak injects.
type faultKind string

const (
	faultAgentDelete   faultKind = "node-agent-pod-deleted"
	faultContainerd    faultKind = "containerd-restarted"
	faultKubelet       faultKind = "kubelet-restarted"
	faultAPIServer     faultKind = "kube-apiserver-restarted"
	faultWebhookDelete faultKind = "webhook-replica-deleted"
	faultCertRotate    faultKind = "webhook-certificate-rotated"
	faultConflist      faultKind = "primary-conflist-rewritten"
	faultReboot        faultKind = "node-rebooted"
	// faultNone: no fault began within a minute before.
	faultNone faultKind = "no-fault"
)

var allFaults = []faultKind{faultAgentDelete, faultContainerd, faultKubelet, faultAPIServer,
	faultWebhookDelete, faultCertRotate, faultConflist, faultReboot}

// faultRecord is one injected fault: when it began, when the node had recovered from it (the
// component back and ready), and what it did.
type faultRecord struct {
	kind       faultKind
	start, end time.Time
	detail     string
	err        error
}

func (f faultRecord) String() string {
	s := fmt.Sprintf("%s %s → %s (%s): %s", f.start.UTC().Format("15:04:05.000"), f.kind,
		f.end.UTC().Format("15:04:05.000"), f.end.Sub(f.start).Round(100*time.Millisecond), f.detail)
	if f.err != nil {
		s += "; error: " + f.err.Error()
	}
	return s
}

// inject runs one fault to its end and records it. A fault that fails — it could not be
// injected, or the node did not recover — has restored what it stopped and returns its error,
// which ends the soak (it would prove less than it says, or wait on a node that cannot
// recover).
func (s *soak) inject(ctx context.Context, kind faultKind) error {
	rec := faultRecord{kind: kind, start: time.Now()}
	s.logf("fault %s: begins", kind)
	s.mu.Lock()
	s.faults = append(s.faults, rec)
	i := len(s.faults) - 1
	s.mu.Unlock()
	var err error
	switch kind {
	case faultAgentDelete:
		// Every other time forced, as an admin clears a stuck pod: the pod object goes at once,
		// and the token bound to it with it, before the kubelet sends the agent SIGTERM.
		s.agentDeletes++
		rec.detail, err = s.deleteAgent(ctx, s.agentDeletes%2 == 1)
	case faultWebhookDelete:
		rec.detail, err = s.deleteOne(ctx, "app.kubernetes.io/component=webhook", 2, false)
	case faultContainerd, faultKubelet, faultAPIServer:
		name := strings.TrimSuffix(string(kind), "-restarted")
		rec.detail = "SIGTERM, then started again and ready"
		err = s.e.Node.RestartComponent(ctx, name)
	case faultCertRotate:
		rec.detail, err = s.rotateCertificate(ctx)
	case faultConflist:
		rec.detail, err = s.rewriteConflist(10)
	case faultReboot:
		rec.detail, err = s.reboot(ctx)
	}
	rec.end, rec.err = time.Now(), err
	s.mu.Lock()
	s.faults[i] = rec
	s.mu.Unlock()
	s.logf("fault %s: over after %s: %s", kind, rec.end.Sub(rec.start).Round(100*time.Millisecond), rec.detail)
	if err != nil {
		return fmt.Errorf("fault %s (began %s): %w", kind, rec.start.UTC().Format("15:04:05.000"), err)
	}
	return nil
}

// logFaults logs every fault injected so far; s.mu is held.
func (s *soak) logFaults() {
	s.t.Logf("soak faults:")
	for _, f := range s.faults {
		s.t.Logf("  %s", f)
	}
}

// deleteAgent deletes the node agent's pod (see deleteOne) and reads what the agent decided at
// SIGTERM from its log on the node, held open from before the deletion so that the kubelet's
// removal of the file cannot hide it: a deleted pod, forced or not, is no uninstall.
func (s *soak) deleteAgent(ctx context.Context, forced bool) (string, error) {
	const selector = "app.kubernetes.io/component=node-agent"
	logs, err := s.e.HoldAgentLogs(ctx, s.e.Node)
	if err != nil {
		return "", err
	}
	defer logs.Close()
	detail, err := s.deleteOne(ctx, selector, 1, forced)
	if err != nil {
		return detail, err
	}
	decision := logs.AtSIGTERM()
	switch {
	case !strings.Contains(decision, "stopping"):
		// The kubelet gives a force-deleted pod's containers 2 s after SIGTERM.
		return fmt.Sprintf("%s; the agent's log on the node (%d files) shows no decision at SIGTERM, killed first: %q", detail, len(logs.Files), decision), nil
	case strings.Contains(decision, "uninstalling"):
		return detail, fmt.Errorf("%s; the agent uninstalled detour at SIGTERM: %s", detail, decision)
	}
	return detail + "; at SIGTERM: " + strings.TrimSpace(decision), nil
}

// deleteOne deletes one of detour's pods matching selector (seeded choice) — forced: with no
// grace period, as `kubectl delete --force --grace-period=0` — then waits until want of them
// are ready again, the deleted one not among them.
func (s *soak) deleteOne(ctx context.Context, selector string, want int, forced bool) (string, error) {
	pods := s.e.Node.Client.CoreV1().Pods(framework.DetourNamespace)
	how, opts := "deleted", metav1.DeleteOptions{}
	if forced {
		how, opts = "force-deleted", metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}
	}
	var victim corev1.Pod
	err := framework.Poll(ctx, 2*time.Minute, func() (bool, error) {
		list, err := pods.List(ctx, metav1.ListOptions{LabelSelector: selector})
		if err != nil {
			return false, err
		}
		if len(list.Items) == 0 {
			return false, framework.Seen("no pod %s", selector)
		}
		slices.SortFunc(list.Items, func(a, b corev1.Pod) int { return strings.Compare(a.Name, b.Name) })
		victim = list.Items[s.rng.IntN(len(list.Items))]
		return true, pods.Delete(ctx, victim.Name, opts)
	})
	if err != nil {
		return "", fmt.Errorf("delete a pod %s: %w", selector, err)
	}
	start := time.Now()
	var gone, created time.Duration
	// Generous: on a loaded machine the kubelet alone took 3 minutes to kill and remove a pod.
	err = framework.Poll(ctx, 8*time.Minute, func() (bool, error) {
		list, err := pods.List(ctx, metav1.ListOptions{LabelSelector: selector})
		if err != nil {
			return false, err
		}
		ready, present := 0, false
		for _, p := range list.Items {
			if p.UID == victim.UID {
				present = true
				continue
			}
			if created == 0 && p.CreationTimestamp.After(victim.CreationTimestamp.Time) {
				created = time.Since(start)
			}
			if p.DeletionTimestamp == nil && framework.PodReady(&p) {
				ready++
			}
		}
		if !present && gone == 0 {
			gone = time.Since(start)
		}
		return ready >= want, framework.Seen("%d of %d pods %s ready, the deleted one still there: %v", ready, want, selector, present)
	})
	if err != nil {
		return "", fmt.Errorf("deleted pod %s; its replacement is not ready: %w", victim.Name, err)
	}
	return fmt.Sprintf("%s pod %s: gone after %s, its replacement created after %s, %d ready after %s",
		how, victim.Name, gone.Round(100*time.Millisecond), created.Round(100*time.Millisecond), want, time.Since(start).Round(100*time.Millisecond)), nil
}

// rotateCertificate rotates the webhook's serving certificate as its certificate loop does:
// a new key and certificate signed by the CA in the Secret detour-webhook-tls, stored in the
// Secret and written — key, then certificate, each by rename, with the webhook's owner —
// into every replica's certificate directory (an emptyDir in the node's mount namespace),
// where the server's watcher picks them up without a restart. It waits until every replica
// serves the new certificate.
func (s *soak) rotateCertificate(ctx context.Context) (string, error) {
	secrets := s.e.Node.Client.CoreV1().Secrets(framework.DetourNamespace)
	sec, err := secrets.Get(ctx, "detour-webhook-tls", metav1.GetOptions{})
	if err != nil {
		return "", err
	}
	caBlock, _ := pem.Decode(sec.Data["ca.crt"])
	keyBlock, _ := pem.Decode(sec.Data["ca.key"])
	if caBlock == nil || keyBlock == nil {
		return "", fmt.Errorf("secret detour-webhook-tls holds no CA")
	}
	ca, err := x509.ParseCertificate(caBlock.Bytes)
	if err != nil {
		return "", err
	}
	caKey, err := x509.ParseECPrivateKey(keyBlock.Bytes)
	if err != nil {
		return "", err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", err
	}
	serial, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	names := []string{"detour-webhook", "detour-webhook." + framework.DetourNamespace, "detour-webhook." + framework.DetourNamespace + ".svc", "detour-webhook." + framework.DetourNamespace + ".svc.cluster.local"}
	der, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{
		SerialNumber: serial, Subject: pkix.Name{CommonName: names[0]}, DNSNames: names,
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(365 * 24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}, ca, key.Public(), caKey)
	if err != nil {
		return "", err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return "", err
	}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})
	sec.Data["tls.crt"], sec.Data["tls.key"] = certPEM, keyPEM
	if _, err := secrets.Update(ctx, sec, metav1.UpdateOptions{}); err != nil {
		return "", fmt.Errorf("store the new certificate in secret detour-webhook-tls: %w", err)
	}
	pods, err := s.e.Node.Client.CoreV1().Pods(framework.DetourNamespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/component=webhook"})
	if err != nil {
		return "", err
	}
	var rotated []string
	for _, p := range pods.Items {
		if p.DeletionTimestamp != nil || p.Status.PodIP == "" {
			continue
		}
		// The holder's root: paths through it resolve in the node's mount namespace.
		dir := filepath.Join(fmt.Sprintf("/proc/%d/root", s.e.Node.HolderPID()), s.e.Node.Dir, "kubelet", "pods", string(p.UID), "volumes", "kubernetes.io~empty-dir", "tls")
		for _, f := range []struct {
			name string
			data []byte
		}{{"tls.key", keyPEM}, {"tls.crt", certPEM}} {
			if err := replaceAs(filepath.Join(dir, f.name), f.data); err != nil {
				return "", fmt.Errorf("write %s of webhook pod %s: %w", f.name, p.Name, err)
			}
		}
		err := framework.Poll(ctx, time.Minute, func() (bool, error) {
			served, err := s.servedCertificate(ctx, p.Status.PodIP+":9443")
			if err != nil {
				return false, err
			}
			return bytes.Equal(served, der), framework.Seen("the old certificate")
		})
		if err != nil {
			return "", fmt.Errorf("webhook pod %s does not serve the new certificate: %w", p.Name, err)
		}
		rotated = append(rotated, p.Name)
	}
	return fmt.Sprintf("serial %x served by %v", serial, rotated), nil
}

// replaceAs replaces path with data by rename, keeping the owner and mode of the file there.
func replaceAs(path string, data []byte) error {
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	st := fi.Sys().(*syscall.Stat_t)
	tmp := filepath.Join(filepath.Dir(path), ".soak-"+filepath.Base(path))
	if err := os.WriteFile(tmp, data, fi.Mode().Perm()); err != nil {
		return err
	}
	if err := os.Chown(tmp, int(st.Uid), int(st.Gid)); err != nil {
		os.Remove(tmp)
		return err
	}
	return os.Rename(tmp, path)
}

// servedCertificate returns the leaf certificate served at addr in the node.
func (s *soak) servedCertificate(ctx context.Context, addr string) ([]byte, error) {
	dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	raw, err := s.e.Node.Dial(dctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	conn := tls.Client(raw, &tls.Config{InsecureSkipVerify: true})
	defer conn.Close()
	if err := conn.HandshakeContext(dctx); err != nil {
		return nil, err
	}
	return conn.ConnectionState().PeerCertificates[0].Raw, nil
}

// rewriteConflist rewrites the primary's conflist n times, 300 ms apart, as the churn story
// does: alternately by rename and in place, its content alternately changed and unchanged.
func (s *soak) rewriteConflist(n int) (string, error) {
	path := s.e.Node.PrimaryConfigPath()
	if err := s.e.Node.WritePrimaryConfig(); err != nil {
		return "", err
	}
	base := framework.ReadFile(path)
	changed := strings.Replace(base, `"hairpinMode": true,`, `"hairpinMode": true, "mtu": 1500,`, 1)
	for i := range n {
		if err := rewritePrimary(path, i, base, changed); err != nil {
			return "", err
		}
		time.Sleep(300 * time.Millisecond)
	}
	return fmt.Sprintf("%d rewrites, 300ms apart", n), s.e.Node.WritePrimaryConfig()
}

// rewritePrimary is rewrite i of the primary's conflist: content changed on odd i, by
// rename when i%4 < 2, else in place (truncate, write).
func rewritePrimary(path string, i int, base, changed string) error {
	content := base
	if i%2 == 1 {
		content = changed
	}
	if i%4 < 2 {
		return fsutil.ReplaceFile(path, 0o644, func(w io.Writer) error {
			_, err := io.WriteString(w, content)
			return err
		})
	}
	return os.WriteFile(path, []byte(content), 0o644)
}

// reboot reboots the node (see [Node.Reboot]) and waits until detour runs again: the agent
// and both webhook replicas ready, in containers started after the reboot (until the kubelet
// has synced a pod, its status still shows the containers that were killed).
func (s *soak) reboot(ctx context.Context) (string, error) {
	n := s.e.Node
	start := time.Now()
	detail, err := n.Reboot(ctx)
	if err != nil {
		return detail, err
	}
	err = framework.Poll(ctx, 8*time.Minute, func() (bool, error) {
		pods, err := n.Client.CoreV1().Pods(framework.DetourNamespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err
		}
		var ready, waiting []string
		for _, p := range pods.Items {
			if p.DeletionTimestamp == nil && framework.PodReady(&p) && startedAfter(&p, start) {
				ready = append(ready, p.Name)
			} else {
				waiting = append(waiting, p.Name)
			}
		}
		return len(ready) >= 3, framework.Seen("ready since the reboot: %v; not yet: %v", ready, waiting)
	})
	if err != nil {
		return detail, fmt.Errorf("detour's pods are not ready after the reboot: %w", err)
	}
	return detail + "; detour ready again", nil
}

// startedAfter reports whether every container of p runs and started after t.
func startedAfter(p *corev1.Pod, t time.Time) bool {
	for _, st := range p.Status.ContainerStatuses {
		if st.State.Running == nil || st.State.Running.StartedAt.Time.Before(t.Truncate(time.Second)) {
			return false
		}
	}
	return len(p.Status.ContainerStatuses) > 0
}
