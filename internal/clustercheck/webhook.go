package clustercheck

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"slices"
	"strings"
	"time"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/utils/ptr"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/inject"
)

// webhookRef is what the MutatingWebhookConfiguration says about calling the webhook.
type webhookRef struct {
	namespace, service string
	port               int32
	roots              *x509.CertPool
	failurePolicy      admissionv1.FailurePolicyType
}

// serverName is the name the API server checks the webhook's certificate against.
func (w *webhookRef) serverName() string { return w.service + "." + w.namespace + ".svc" }

// checkWebhookConfig reads the MutatingWebhookConfiguration. It returns detour's webhook when
// there is one, and its Service and caBundle when both are usable.
func (c *Checker) checkWebhookConfig(ctx context.Context) (*admissionv1.MutatingWebhook, *webhookRef, Result) {
	const name = "webhook-config"
	mwc, err := c.client.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, WebhookConfiguration, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, nil, Result{Name: name, Status: Error, Message: fmt.Sprintf("MutatingWebhookConfiguration %s not found: the API server calls no detour webhook, so no pod is injected", WebhookConfiguration),
			Fix: "install or upgrade detour (helm upgrade --install); the chart leaves it out on purpose in uninstall mode (nodeAgent.uninstall=true)"}
	} else if err != nil {
		return nil, nil, cannot(name, fmt.Errorf("get MutatingWebhookConfiguration %s: %w", WebhookConfiguration, err))
	}
	var wh *admissionv1.MutatingWebhook
	for i := range mwc.Webhooks {
		if mwc.Webhooks[i].Name == WebhookName {
			wh = &mwc.Webhooks[i]
		}
	}
	if wh == nil {
		return nil, nil, Result{Name: name, Status: Error, Message: fmt.Sprintf("MutatingWebhookConfiguration %s has no webhook %s", WebhookConfiguration, WebhookName),
			Fix: "reinstall detour: the configuration was edited by hand or by another tool"}
	}
	svc := wh.ClientConfig.Service
	if svc == nil {
		return wh, nil, Result{Name: name, Status: Error, Message: fmt.Sprintf("webhook %s calls a URL (%v), not detour's Service", WebhookName, deref(wh.ClientConfig.URL)),
			Fix: fmt.Sprintf("reinstall detour: its webhook is called through Service %s/%s", c.namespace, WebhookService)}
	}
	ref := &webhookRef{namespace: svc.Namespace, service: svc.Name, port: 443, failurePolicy: admissionv1.Fail}
	if svc.Port != nil {
		ref.port = *svc.Port
	}
	if wh.FailurePolicy != nil {
		ref.failurePolicy = *wh.FailurePolicy
	}
	target := fmt.Sprintf("Service %s/%s:%d%s", svc.Namespace, svc.Name, ref.port, deref(svc.Path))
	if len(wh.ClientConfig.CABundle) == 0 {
		return wh, nil, Result{Name: name, Status: Error, Message: fmt.Sprintf("webhook %s (calls %s) has an empty caBundle: the API server cannot verify the webhook, so every call fails", WebhookName, target),
			Fix: fmt.Sprintf("certificates.mode detour: the webhook writes the caBundle when it starts; see its log (kubectl -n %s logs deployment/%s). cert-manager: its CA injector writes it (annotation cert-manager.io/inject-ca-from)", c.namespace, WebhookDeployment)}
	}
	roots, n := parseBundle(wh.ClientConfig.CABundle)
	if n == 0 {
		return wh, nil, Result{Name: name, Status: Error, Message: fmt.Sprintf("webhook %s's caBundle holds no PEM certificate", WebhookName),
			Fix: fmt.Sprintf("restart the webhook (kubectl -n %s rollout restart deployment/%s), which rewrites the caBundle from its Secret; with cert-manager, check its CA injector", c.namespace, WebhookDeployment)}
	}
	ref.roots = roots
	return wh, ref, Result{Name: name, Status: OK, Message: fmt.Sprintf("MutatingWebhookConfiguration %s calls %s (failurePolicy %s) with a caBundle of %s", WebhookConfiguration, target, ref.failurePolicy, plural(n, "certificate"))}
}

// parseBundle returns the PEM certificates of a caBundle as a pool, and how many there are.
func parseBundle(bundle []byte) (*x509.CertPool, int) {
	roots, n := x509.NewCertPool(), 0
	for rest := bundle; ; {
		var b *pem.Block
		if b, rest = pem.Decode(rest); b == nil {
			break
		}
		if cert, err := x509.ParseCertificate(b.Bytes); err == nil && b.Type == "CERTIFICATE" {
			roots.AddCert(cert)
			n++
		}
	}
	return roots, n
}

// Endpoint is one ready address of the webhook's Service: the pod behind it and the port the
// webhook listens on.
type Endpoint struct {
	Namespace, Pod, Address string
	Port                    int32
}

func (e Endpoint) String() string {
	if e.Pod != "" {
		return "pod " + e.Pod
	}
	return e.Address
}

// checkWebhookEndpoints finds the ready endpoints of the webhook's Service.
func (c *Checker) checkWebhookEndpoints(ctx context.Context, ref *webhookRef) ([]Endpoint, Result) {
	const name = "webhook-endpoints"
	ns, svcName, port := c.namespace, WebhookService, int32(443)
	consequence := "pods are admitted uninjected"
	if ref != nil {
		ns, svcName, port = ref.namespace, ref.service, ref.port
		if ref.failurePolicy == admissionv1.Fail {
			consequence = "pod creation fails in the namespaces the webhook selects"
		}
	}
	svc, err := c.client.CoreV1().Services(ns).Get(ctx, svcName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, Result{Name: name, Status: Error, Message: fmt.Sprintf("Service %s/%s not found: the API server cannot call the webhook, so %s", ns, svcName, consequence),
			Fix: "reinstall or upgrade detour (helm upgrade --install)"}
	} else if err != nil {
		return nil, cannot(name, fmt.Errorf("get Service %s/%s: %w", ns, svcName, err))
	}
	var portName string
	found := false
	for _, p := range svc.Spec.Ports {
		if p.Port == port {
			portName, found = p.Name, true
		}
	}
	if !found {
		return nil, Result{Name: name, Status: Error, Message: fmt.Sprintf("Service %s/%s has no port %d, the port the webhook configuration calls", ns, svcName, port),
			Fix: "reinstall detour: the Service or the webhook configuration was edited"}
	}
	slices_, err := c.client.DiscoveryV1().EndpointSlices(ns).List(ctx, metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=" + svcName})
	if err != nil {
		return nil, cannot(name, fmt.Errorf("list the EndpointSlices of Service %s/%s: %w", ns, svcName, err))
	}
	var eps []Endpoint
	for _, sl := range slices_.Items {
		var p *int32
		for _, sp := range sl.Ports {
			if deref(sp.Name) == portName {
				p = sp.Port
			}
		}
		if p == nil {
			continue
		}
		for _, e := range sl.Endpoints {
			if (e.Conditions.Ready != nil && !*e.Conditions.Ready) || len(e.Addresses) == 0 {
				continue
			}
			ep := Endpoint{Namespace: ns, Address: e.Addresses[0], Port: *p}
			if e.TargetRef != nil && e.TargetRef.Kind == "Pod" {
				ep.Pod = e.TargetRef.Name
				if e.TargetRef.Namespace != "" {
					ep.Namespace = e.TargetRef.Namespace
				}
			}
			eps = append(eps, ep)
		}
	}
	slices.SortFunc(eps, func(a, b Endpoint) int { return strings.Compare(a.String(), b.String()) })
	if len(eps) == 0 {
		return nil, Result{Name: name, Status: Error, Message: fmt.Sprintf("Service %s/%s has no ready endpoint: the API server cannot call the webhook, so %s", ns, svcName, consequence),
			Fix: fmt.Sprintf("the webhook's pods are missing or not ready: kubectl -n %s get pods -l app.kubernetes.io/component=webhook; kubectl -n %s logs deployment/%s", c.namespace, c.namespace, WebhookDeployment)}
	}
	names := make([]string, len(eps))
	for i, e := range eps {
		names[i] = e.String()
	}
	return eps, Result{Name: name, Status: OK, Message: fmt.Sprintf("Service %s/%s has %s (%s)", ns, svcName, plural(len(eps), "ready endpoint"), list(names))}
}

// maxDialed bounds how many of the webhook's pods the certificate check dials.
const maxDialed = 5

// checkWebhookCertificate dials the webhook's ready endpoints and verifies the certificate each
// one serves against the caBundle, for the Service's DNS name, as the API server does.
func (c *Checker) checkWebhookCertificate(ctx context.Context, ref *webhookRef, eps []Endpoint) Result {
	const name = "webhook-certificate"
	if len(eps) == 0 {
		return Result{Name: name, Status: Warning, Message: "the webhook's serving certificate was not checked: no ready endpoint to dial",
			Fix: "make the webhook's pods ready first (see webhook-endpoints)"}
	}
	if c.dial == nil {
		return Result{Name: name, Status: Warning, Message: "the webhook's serving certificate was not checked: no way to dial its pods",
			Fix: "run the check with --webhook-dial=port-forward (the default) or direct"}
	}
	var good []string
	var notAfter time.Time
	for i, ep := range eps {
		if i == maxDialed {
			break
		}
		leaf, err := c.servedCertificate(ctx, ep, ref)
		if err != nil {
			return Result{Name: name, Status: Warning, Message: fmt.Sprintf("could not see the certificate %s serves on port %d: %v", ep, ep.Port, err),
				Fix: "the default dialer forwards a port to the pod through the API server, as kubectl port-forward does: it needs create on pods/portforward and a reachable kubelet; from inside the cluster network, --webhook-dial=direct dials the pod's address"}
		}
		now := c.now()
		if _, err := leaf.chain[0].Verify(x509.VerifyOptions{DNSName: ref.serverName(), Roots: ref.roots, Intermediates: leaf.intermediates, CurrentTime: now}); err != nil {
			return Result{Name: name, Status: Error,
				Message: fmt.Sprintf("the certificate %s serves does not verify against webhook %s's caBundle for %s: %v; the API server refuses it, so %s", ep, WebhookName, ref.serverName(), err, consequenceOf(ref)),
				Fix:     fmt.Sprintf("certificates.mode detour: the webhook puts back the caBundle of its Secret within 10 minutes; to do it now, restart it (kubectl -n %s rollout restart deployment/%s). cert-manager: check the Certificate and the CA injector (annotation cert-manager.io/inject-ca-from). Do not set the caBundle by hand", c.namespace, WebhookDeployment)}
		}
		if notAfter.IsZero() || leaf.chain[0].NotAfter.Before(notAfter) {
			notAfter = leaf.chain[0].NotAfter
		}
		good = append(good, ep.String())
	}
	subject, verifies := "the certificate "+good[0]+" serves", "verifies"
	if len(good) > 1 {
		subject, verifies = "the certificates "+list(good)+" serve", "verify"
	}
	if left := notAfter.Sub(c.now()); left < 7*24*time.Hour {
		return Result{Name: name, Status: Warning, Message: fmt.Sprintf("%s %s for %s but one expires in %s (%s)", subject, verifies, ref.serverName(), left.Round(time.Minute), notAfter.UTC().Format(time.RFC3339)),
			Fix: fmt.Sprintf("certificates.mode detour rotates it before expiry: see the webhook's log (kubectl -n %s logs deployment/%s); cert-manager: check the Certificate's renewBefore", c.namespace, WebhookDeployment)}
	}
	return Result{Name: name, Status: OK, Message: fmt.Sprintf("%s %s against the caBundle for %s (valid until %s)", subject, verifies, ref.serverName(), notAfter.UTC().Format("2006-01-02"))}
}

// ProbePod is the name prefix of the pod the admission check creates with dryRun=All; it is
// labeled app.kubernetes.io/name=detour-check.
const ProbePod = "detour-check-probe"

// neverInjected are the namespaces whose pods the webhook never injects (besides detour's own).
var neverInjected = inject.DefaultExcludeNamespaces

// checkAdmission has the API server admit a pod that asks for injection, without storing it
// (dryRun=All; the webhook declares sideEffects None, so the API server calls it): the pod comes
// back injected only when the API server reached the webhook and trusted its certificate — the
// path every real pod takes, which a port-forward from the check's own machine does not cover
// (a firewall between the control plane and the nodes, for one).
func (c *Checker) checkAdmission(ctx context.Context, wh *admissionv1.MutatingWebhook, s *state) Result {
	const name = "webhook-admission"
	probeNS := "default"
	for _, ns := range s.optedIn {
		if ns != c.namespace && !slices.Contains(neverInjected, ns) {
			probeNS = ns
			break
		}
	}
	probeLabels := map[string]string{"app.kubernetes.io/name": "detour-check"}
	nsLabels := s.nsLabels[probeNS]
	if nsLabels == nil {
		nsLabels = map[string]string{corev1.LabelMetadataName: probeNS}
	}
	if !coversPodCreate(wh.Rules) {
		return Result{Name: name, Status: Error, Message: fmt.Sprintf("webhook %s's rules do not cover creating pods (v1): no pod is injected", WebhookName),
			Fix: "the chart's rule is operations [CREATE] on pods, apiGroups [\"\"], apiVersions [v1]; helm upgrade restores it"}
	}
	if sel, err := metav1.LabelSelectorAsSelector(wh.NamespaceSelector); wh.NamespaceSelector != nil && (err != nil || !sel.Matches(labels.Set(nsLabels))) {
		status, what := Warning, "namespace "+probeNS
		if slices.Contains(s.optedIn, probeNS) {
			status, what = Error, "namespace "+probeNS+", which is opted in: its pods are not injected"
		}
		return Result{Name: name, Status: status, Message: fmt.Sprintf("webhook %s's namespaceSelector (%s) does not select %s", WebhookName, selectorString(wh.NamespaceSelector), what),
			Fix: fmt.Sprintf("the chart's selector leaves out only %s and kube-system; helm upgrade restores it", c.namespace)}
	}
	if sel, err := metav1.LabelSelectorAsSelector(wh.ObjectSelector); wh.ObjectSelector != nil && (err != nil || !sel.Matches(labels.Set(probeLabels))) {
		return Result{Name: name, Status: Warning, Message: fmt.Sprintf("webhook %s has an objectSelector (%s): only pods it selects are injected, and the probe pod is not, so the API server's call to the webhook was not checked", WebhookName, selectorString(wh.ObjectSelector)),
			Fix: "the chart sets no objectSelector; helm upgrade restores it"}
	}
	img := "registry.k8s.io/pause:3.10"
	if s.deploy != nil && len(s.deploy.Spec.Template.Spec.Containers) > 0 {
		img = s.deploy.Spec.Template.Spec.Containers[0].Image
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			GenerateName: ProbePod + "-", Namespace: probeNS,
			Labels:      probeLabels,
			Annotations: map[string]string{annotations.Inject: "enabled"},
		},
		Spec: corev1.PodSpec{
			AutomountServiceAccountToken: ptr.To(false),
			SecurityContext: &corev1.PodSecurityContext{
				RunAsNonRoot: ptr.To(true), RunAsUser: ptr.To[int64](65532),
				SeccompProfile: &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
			},
			Containers: []corev1.Container{{
				Name: "probe", Image: img,
				SecurityContext: &corev1.SecurityContext{
					AllowPrivilegeEscalation: ptr.To(false),
					Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
				},
			}},
		},
	}
	ctx, cancel := context.WithTimeout(ctx, 40*time.Second)
	defer cancel()
	start := c.now()
	got, err := c.client.CoreV1().Pods(probeNS).Create(ctx, pod, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}, FieldManager: "detour-check"})
	took := c.now().Sub(start).Round(time.Millisecond)
	probe := fmt.Sprintf("a dry-run pod in namespace %s", probeNS)
	network := fmt.Sprintf("the API server must reach the webhook's pods on their port (firewall rules between the control plane and the nodes, as on private GKE or EKS clusters, often block it); kube-apiserver's log says 'failed calling webhook \"%s\"'", WebhookName)
	switch {
	case err != nil && strings.Contains(err.Error(), WebhookName) && strings.Contains(err.Error(), "denied the request"):
		return Result{Name: name, Status: Error, Message: fmt.Sprintf("the webhook denied %s: %v", probe, err),
			Fix: fmt.Sprintf("the webhook's configuration (ConfigMap %s) refuses a plain pod; its log says why", WebhookConfigMap)}
	case err != nil && strings.Contains(err.Error(), WebhookName):
		return Result{Name: name, Status: Error, Message: fmt.Sprintf("the API server could not call the webhook for %s: %v", probe, err), Fix: network}
	case err != nil:
		return Result{Name: name, Status: Warning, Message: fmt.Sprintf("%s was refused, so the API server's call to the webhook was not checked: %v", probe, err),
			Fix: fmt.Sprintf("the check needs create on pods in %s (dryRun: nothing is stored); a policy (Pod Security, a policy engine) that refuses the probe pod refuses it after the webhook ran", probeNS)}
	case !annotations.IsInjected(got.Annotations):
		if wh.FailurePolicy != nil && *wh.FailurePolicy == admissionv1.Ignore {
			return Result{Name: name, Status: Error, Message: fmt.Sprintf("%s that asks for injection came back uninjected after %s: the API server could not call the webhook and admitted it anyway (failurePolicy Ignore), as it does every pod now", probe, took), Fix: network}
		}
		return Result{Name: name, Status: Error, Message: fmt.Sprintf("%s that asks for injection came back uninjected: the webhook configuration does not select it (namespaceSelector, objectSelector) or the webhook skipped it", probe),
			Fix: fmt.Sprintf("compare MutatingWebhookConfiguration %s with the chart's (helm upgrade restores it) and read the webhook's log for pod %s", WebhookConfiguration, ProbePod)}
	}
	return Result{Name: name, Status: OK, Message: fmt.Sprintf("the API server called the webhook: %s came back injected (detour %s) in %s", probe, got.Annotations[annotations.Injected], took)}
}

// coversPodCreate reports whether a rule sends the creation of v1 pods to the webhook.
func coversPodCreate(rules []admissionv1.RuleWithOperations) bool {
	for _, r := range rules {
		if (slices.Contains(r.Operations, admissionv1.Create) || slices.Contains(r.Operations, admissionv1.OperationAll)) &&
			(slices.Contains(r.APIGroups, "") || slices.Contains(r.APIGroups, "*")) &&
			(slices.Contains(r.APIVersions, "v1") || slices.Contains(r.APIVersions, "*")) &&
			(slices.Contains(r.Resources, "pods") || slices.Contains(r.Resources, "*") || slices.Contains(r.Resources, "*/*")) {
			return true
		}
	}
	return false
}

func selectorString(sel *metav1.LabelSelector) string {
	s, err := metav1.LabelSelectorAsSelector(sel)
	if err != nil {
		return err.Error()
	}
	return s.String()
}

func consequenceOf(ref *webhookRef) string {
	if ref.failurePolicy == admissionv1.Fail {
		return "pod creation fails in the namespaces the webhook selects"
	}
	return "pods are admitted uninjected (failurePolicy Ignore)"
}

type served struct {
	chain         []*x509.Certificate
	intermediates *x509.CertPool
}

// servedCertificate completes a TLS handshake with ep, naming the Service as the API server
// does, and returns the certificates the server presented. It verifies nothing: the caller does,
// to say exactly what is wrong.
func (c *Checker) servedCertificate(ctx context.Context, ep Endpoint, ref *webhookRef) (*served, error) {
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	conn, err := c.dial(ctx, ep)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	tc := tls.Client(conn, &tls.Config{ServerName: ref.serverName(), InsecureSkipVerify: true, MinVersion: tls.VersionTLS12}) //nolint:gosec // verified below against the caBundle
	if err := tc.HandshakeContext(ctx); err != nil {
		return nil, fmt.Errorf("TLS handshake: %w", err)
	}
	chain := tc.ConnectionState().PeerCertificates
	if len(chain) == 0 {
		return nil, fmt.Errorf("the server presented no certificate")
	}
	s := &served{chain: chain, intermediates: x509.NewCertPool()}
	for _, cert := range chain[1:] {
		s.intermediates.AddCert(cert)
	}
	return s, nil
}

func (c *Checker) checkWebhookDeployment(s *state) Result {
	const name = "webhook-deployment"
	if apierrors.IsNotFound(s.deployErr) {
		return Result{Name: name, Status: Error, Message: fmt.Sprintf("Deployment %s/%s not found: nothing serves the webhook", c.namespace, WebhookDeployment),
			Fix: "reinstall or upgrade detour (helm upgrade --install)"}
	} else if s.deployErr != nil {
		return cannot(name, fmt.Errorf("get Deployment %s/%s: %w", c.namespace, WebhookDeployment, s.deployErr))
	}
	d := s.deploy
	want := int32(1)
	if d.Spec.Replicas != nil {
		want = *d.Spec.Replicas
	}
	avail := d.Status.AvailableReplicas
	switch {
	case avail == 0 && want == 0:
		return Result{Name: name, Status: Error, Message: fmt.Sprintf("Deployment %s is scaled to 0 replicas: nothing serves the webhook", WebhookDeployment),
			Fix: fmt.Sprintf("kubectl -n %s scale deployment/%s --replicas=2 (the chart's webhook.replicas)", c.namespace, WebhookDeployment)}
	case avail == 0:
		return Result{Name: name, Status: Error, Message: fmt.Sprintf("Deployment %s has no available replica (0 of %d)", WebhookDeployment, want),
			Fix: fmt.Sprintf("see why its pods do not start or become ready: kubectl -n %s describe deployment/%s; kubectl -n %s logs deployment/%s", c.namespace, WebhookDeployment, c.namespace, WebhookDeployment)}
	case avail < want || d.Status.UpdatedReplicas < want:
		return Result{Name: name, Status: Warning, Message: fmt.Sprintf("Deployment %s: %d of %d replicas available, %d up to date (a rollout in progress, or pods that cannot start)", WebhookDeployment, avail, want, d.Status.UpdatedReplicas),
			Fix: fmt.Sprintf("kubectl -n %s rollout status deployment/%s", c.namespace, WebhookDeployment)}
	}
	return Result{Name: name, Status: OK, Message: fmt.Sprintf("Deployment %s: %d of %d replicas available", WebhookDeployment, avail, want)}
}
