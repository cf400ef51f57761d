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
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/repair"
	"github.com/detourmesh/detour/validator"
)

// state is what several checks read: listed once.
type state struct {
	nodes     []corev1.Node
	nodesErr  error
	ds        *appsv1.DaemonSet
	dsErr     error
	agents    []corev1.Pod // the DaemonSet's pods
	agentsErr error
	deploy    *appsv1.Deployment
	deployErr error
	injected  []corev1.Pod // every injected pod of the cluster
	podsErr   error
	optedIn   []string // namespaces annotated detour.dev/inject=enabled
	nsLabels  map[string]map[string]string
	nsErr     error
}

func (c *Checker) load(ctx context.Context) *state {
	s := &state{}
	nodes, err := c.client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		s.nodesErr = fmt.Errorf("list nodes: %w", err)
	} else {
		s.nodes = nodes.Items
	}
	s.ds, s.dsErr = c.client.AppsV1().DaemonSets(c.namespace).Get(ctx, NodeAgentDaemonSet, metav1.GetOptions{})
	if s.dsErr == nil {
		sel, err := metav1.LabelSelectorAsSelector(s.ds.Spec.Selector)
		if err != nil {
			s.agentsErr = fmt.Errorf("DaemonSet %s's selector: %w", NodeAgentDaemonSet, err)
		} else if pods, err := c.client.CoreV1().Pods(c.namespace).List(ctx, metav1.ListOptions{LabelSelector: sel.String()}); err != nil {
			s.agentsErr = fmt.Errorf("list the node agent's pods: %w", err)
		} else {
			s.agents = pods.Items
		}
	}
	s.deploy, s.deployErr = c.client.AppsV1().Deployments(c.namespace).Get(ctx, WebhookDeployment, metav1.GetOptions{})
	if nss, err := c.client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{}); err != nil {
		s.nsErr = fmt.Errorf("list namespaces: %w", err)
	} else {
		s.nsLabels = map[string]map[string]string{}
		for _, ns := range nss.Items {
			s.nsLabels[ns.Name] = ns.Labels
			if ns.Annotations[annotations.Inject] == "enabled" {
				s.optedIn = append(s.optedIn, ns.Name)
			}
		}
	}
	opts := metav1.ListOptions{Limit: 500}
	for {
		pods, err := c.client.CoreV1().Pods("").List(ctx, opts)
		if err != nil {
			s.podsErr = fmt.Errorf("list pods: %w", err)
			break
		}
		for _, p := range pods.Items {
			if annotations.IsInjected(p.Annotations) {
				s.injected = append(s.injected, p)
			}
		}
		if opts.Continue = pods.Continue; opts.Continue == "" {
			break
		}
	}
	return s
}

// cannot is the result of a check that could not read what it needs.
func cannot(name string, err error) Result {
	fix := "check the kubeconfig's context and network path to the API server"
	if apierrors.IsForbidden(err) {
		fix = "run the check as a user that can get and list detour's objects, nodes, namespaces, pods and events (docs/operations.md lists the permissions)"
	}
	return Result{Name: name, Status: Error, Message: fmt.Sprintf("%s: %v", name, err), Fix: fix}
}

func (c *Checker) checkAPI(_ context.Context) Result {
	const name = "kubernetes-api"
	where := "the API server"
	if c.host != "" {
		where += " at " + c.host
	}
	v, err := c.client.Discovery().ServerVersion()
	if err != nil {
		return Result{Name: name, Status: Error, Message: fmt.Sprintf("cannot reach %s: %v", where, err),
			Fix: "check the kubeconfig and its context (kubectl config current-context, --kubeconfig, --context) and that the API server answers (kubectl version)"}
	}
	return Result{Name: name, Status: OK, Message: fmt.Sprintf("%s answers (Kubernetes %s)", where, v.GitVersion)}
}

func (c *Checker) checkNamespace(ctx context.Context) Result {
	const name = "detour-namespace"
	_, err := c.client.CoreV1().Namespaces().Get(ctx, c.namespace, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return Result{Name: name, Status: Error, Message: fmt.Sprintf("namespace %s not found: detour is not installed there", c.namespace),
			Fix: fmt.Sprintf("install detour (helm install detour manifests/charts/detour -n %s, or kubectl apply -f manifests/install.yaml), or pass -n with the namespace it is installed in", DefaultNamespace)}
	case apierrors.IsForbidden(err):
		return Result{Name: name, Status: Warning, Message: fmt.Sprintf("cannot read namespace %s (%v); the checks go on", c.namespace, err),
			Fix: "run the check as a user that can get namespaces"}
	case err != nil:
		return cannot(name, fmt.Errorf("get namespace %s: %w", c.namespace, err))
	}
	return Result{Name: name, Status: OK, Message: fmt.Sprintf("detour's namespace %s exists", c.namespace)}
}

// checkInstalled reports, as the detour-namespace check, a namespace without any of detour's
// main objects (after helm uninstall, when the namespace stays): one line instead of a ✗ per
// missing object.
func (c *Checker) checkInstalled(ctx context.Context, s *state) (Result, bool) {
	_, err := c.client.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, WebhookConfiguration, metav1.GetOptions{})
	if !apierrors.IsNotFound(err) || !apierrors.IsNotFound(s.deployErr) || !apierrors.IsNotFound(s.dsErr) {
		return Result{}, true
	}
	return Result{Name: "detour-namespace", Status: Error,
		Message: fmt.Sprintf("detour is not installed in namespace %s: no Deployment %s, no DaemonSet %s, no MutatingWebhookConfiguration %s", c.namespace, WebhookDeployment, NodeAgentDaemonSet, WebhookConfiguration),
		Fix:     fmt.Sprintf("install detour (helm install detour manifests/charts/detour -n %s, or kubectl apply -f manifests/install.yaml), or pass -n with the namespace it is installed in", DefaultNamespace)}, false
}

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
var neverInjected = []string{"kube-system", "kube-public", "kube-node-lease"}

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

// runsOn reports whether the DaemonSet's pods belong on node: its nodeSelector matches and
// its tolerations cover the node's NoSchedule and NoExecute taints (the DaemonSet controller
// adds tolerations for the node.kubernetes.io/ conditions itself). Node affinity is not
// evaluated; the chart sets none.
func runsOn(ds *appsv1.DaemonSet, node *corev1.Node) bool {
	spec := ds.Spec.Template.Spec
	if !labels.SelectorFromSet(spec.NodeSelector).Matches(labels.Set(node.Labels)) {
		return false
	}
	for i := range node.Spec.Taints {
		t := &node.Spec.Taints[i]
		if t.Effect == corev1.TaintEffectPreferNoSchedule || strings.HasPrefix(t.Key, "node.kubernetes.io/") {
			continue
		}
		if !slices.ContainsFunc(spec.Tolerations, func(tol corev1.Toleration) bool {
			return tol.ToleratesTaint(klog.Background(), t, false)
		}) {
			return false
		}
	}
	return true
}

// agentNodes are the nodes the node agent should run on (every node when its DaemonSet cannot
// be read).
func (s *state) agentNodes() []*corev1.Node {
	var out []*corev1.Node
	for i := range s.nodes {
		if s.ds == nil || runsOn(s.ds, &s.nodes[i]) {
			out = append(out, &s.nodes[i])
		}
	}
	return out
}

func podReady(p *corev1.Pod) bool {
	if p.DeletionTimestamp != nil {
		return false
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

func (c *Checker) checkNodeAgent(s *state) Result {
	const name = "node-agent"
	switch {
	case apierrors.IsNotFound(s.dsErr):
		return Result{Name: name, Status: Error, Message: fmt.Sprintf("DaemonSet %s/%s not found: no node gets detour-cni, and nodes registered with the startup taint stay tainted", c.namespace, NodeAgentDaemonSet),
			Fix: "reinstall or upgrade detour (helm upgrade --install)"}
	case s.dsErr != nil:
		return cannot(name, fmt.Errorf("get DaemonSet %s/%s: %w", c.namespace, NodeAgentDaemonSet, s.dsErr))
	case s.nodesErr != nil:
		return cannot(name, s.nodesErr)
	case s.agentsErr != nil:
		return cannot(name, s.agentsErr)
	}
	nodes := s.agentNodes()
	if len(nodes) == 0 {
		return Result{Name: name, Status: Warning, Message: fmt.Sprintf("DaemonSet %s runs on no node: %d nodes, none matches its nodeSelector and tolerations", NodeAgentDaemonSet, len(s.nodes)),
			Fix: "check the chart's nodeAgent.nodeSelector and nodeAgent.tolerations"}
	}
	byNode := map[string][]*corev1.Pod{}
	for i := range s.agents {
		p := &s.agents[i]
		byNode[p.Spec.NodeName] = append(byNode[p.Spec.NodeName], p)
	}
	var bad []string
	for _, n := range nodes {
		pods := byNode[n.Name]
		if slices.ContainsFunc(pods, podReady) {
			continue
		}
		if len(pods) == 0 {
			bad = append(bad, n.Name+" (no agent pod)")
		} else {
			bad = append(bad, fmt.Sprintf("%s (pod %s not ready, %s)", n.Name, pods[0].Name, podPhase(pods[0])))
		}
	}
	if len(bad) > 0 {
		return Result{Name: name, Status: Error, Message: fmt.Sprintf("DaemonSet %s is not ready on %d of %s: %s", NodeAgentDaemonSet, len(bad), plural(len(nodes), "node"), list(bad)),
			Fix: fmt.Sprintf("kubectl -n %s get pods -l app.kubernetes.io/component=node-agent -o wide; describe the pod on the node and read its log (kubectl -n %s logs POD -c %s)", c.namespace, c.namespace, InstallCNIContainer)}
	}
	return Result{Name: name, Status: OK, Message: fmt.Sprintf("DaemonSet %s is ready on every node it runs on (%d)", NodeAgentDaemonSet, len(nodes))}
}

func podPhase(p *corev1.Pod) string {
	for _, s := range append(slices.Clone(p.Status.InitContainerStatuses), p.Status.ContainerStatuses...) {
		if w := s.State.Waiting; w != nil && w.Reason != "" {
			return w.Reason
		}
	}
	if p.DeletionTimestamp != nil {
		return "terminating"
	}
	return strings.ToLower(string(p.Status.Phase))
}

// agentArg returns the value of the install-cni container's --flag=value argument.
func (s *state) agentArg(flag string) (string, bool) {
	if s.ds == nil {
		return "", false
	}
	for _, ctr := range s.ds.Spec.Template.Spec.Containers {
		if ctr.Name != InstallCNIContainer {
			continue
		}
		for _, a := range ctr.Args {
			if a == "--"+flag {
				return "true", true
			}
			if v, ok := strings.CutPrefix(a, "--"+flag+"="); ok {
				return v, true
			}
		}
	}
	return "", false
}

func (s *state) startupTaint() string {
	if t, ok := s.agentArg("startup-taint"); ok && t != "" {
		return t
	}
	return StartupTaint
}

func hasTaint(n *corev1.Node, key string) bool {
	return slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == key })
}

// newNodeGrace is how long a node may carry the startup taint before the check calls it an
// error rather than a node agent still starting.
const newNodeGrace = 2 * time.Minute

func (c *Checker) checkStartupTaint(s *state) Result {
	const name = "startup-taint"
	if s.nodesErr != nil {
		return cannot(name, s.nodesErr)
	}
	taint := s.startupTaint()
	var tainted []string
	allNew := true
	for i := range s.nodes {
		n := &s.nodes[i]
		if !hasTaint(n, taint) {
			continue
		}
		age := c.now().Sub(n.CreationTimestamp.Time)
		allNew = allNew && age < newNodeGrace
		tainted = append(tainted, fmt.Sprintf("%s (registered %s ago)", n.Name, age.Round(time.Second)))
	}
	switch {
	case len(tainted) == 0:
		return Result{Name: name, Status: OK, Message: fmt.Sprintf("no node carries the startup taint %s", taint)}
	case allNew:
		return Result{Name: name, Status: Warning, Message: fmt.Sprintf("%s still %s the startup taint %s, registered under %s ago: %s", plural(len(tainted), "node"), verb(len(tainted), "carries", "carry"), taint, newNodeGrace, list(tainted)),
			Fix: "the node agent removes the taint within seconds of the primary CNI's configuration; run the check again in a minute"}
	}
	return Result{Name: name, Status: Error, Message: fmt.Sprintf("%s still %s the startup taint %s: %s; pods that do not tolerate it are not scheduled there", plural(len(tainted), "node"), verb(len(tainted), "carries", "carry"), taint, list(tainted)),
		Fix: fmt.Sprintf("the node agent removes it once detour's CNI config is on the node, which needs the primary CNI's configuration first: kubectl -n %s get pods -o wide --field-selector spec.nodeName=NODE, read the agent's log (-c %s), and run detour check on the node", c.namespace, InstallCNIContainer)}
}

func (c *Checker) checkReadyLabel(s *state) Result {
	const name = "ready-label"
	if s.nodesErr != nil {
		return cannot(name, s.nodesErr)
	}
	taint := s.startupTaint()
	var missing []string
	nodes := s.agentNodes()
	for _, n := range nodes {
		if n.Labels[ReadyLabel] != "true" && !hasTaint(n, taint) { // tainted nodes: see startup-taint
			missing = append(missing, n.Name)
		}
	}
	if len(missing) == 0 {
		return Result{Name: name, Status: OK, Message: fmt.Sprintf("every untainted node the node agent runs on carries %s=true", ReadyLabel)}
	}
	if _, uninstall := s.agentArg("uninstall"); uninstall {
		return Result{Name: name, Status: Warning, Message: fmt.Sprintf("the node agent runs in uninstall mode and removed %s from %s", ReadyLabel, plural(len(missing), "node")),
			Fix: "finish the uninstall with helm uninstall, or set nodeAgent.uninstall=false to keep detour"}
	}
	return Result{Name: name, Status: Error, Message: fmt.Sprintf("%s without the startup taint %s the ready label %s=true: %s; pods there may start before detour's CNI config is in place, and repair does not act there", plural(len(missing), "node"), verb(len(missing), "lacks", "lack"), ReadyLabel, list(missing)),
		Fix: fmt.Sprintf("register nodes with the taint %s:NoSchedule (kubelet --register-with-taints, Karpenter startupTaints) and check the node agent on these nodes: its log says what it waits for (kubectl -n %s logs POD -c %s)", taint, c.namespace, InstallCNIContainer)}
}

func (c *Checker) checkNamespaces(s *state) Result {
	const name = "opted-in-namespaces"
	if s.nsErr != nil {
		return cannot(name, s.nsErr)
	}
	in := s.optedIn
	pods := "injected pods not counted: " + fmt.Sprint(s.podsErr)
	if s.podsErr == nil {
		pods = plural(len(s.injected), "injected pod")
	}
	if len(in) == 0 && len(s.injected) == 0 {
		return Result{Name: name, Status: Warning, Message: fmt.Sprintf("no namespace opted in (annotation %s=enabled) and %s", annotations.Inject, pods),
			Fix: fmt.Sprintf("kubectl annotate namespace NAME %s=enabled, then restart its workloads (kubectl -n NAME rollout restart deployment)", annotations.Inject)}
	}
	return Result{Name: name, Status: OK, Message: fmt.Sprintf("%s opted in%s; %s", plural(len(in), "namespace"), parenList(in), pods)}
}

// validatorExit returns the exit code of pod's validator when it failed and has not passed
// since: in its current state, or in its last one while it waits to run again.
func validatorExit(p *corev1.Pod) (int32, bool) {
	for _, s := range p.Status.InitContainerStatuses {
		if s.Name != annotations.ValidatorContainer {
			continue
		}
		if t := s.State.Terminated; t != nil {
			return t.ExitCode, t.ExitCode != 0
		}
		if t := s.LastTerminationState.Terminated; s.State.Waiting != nil && t != nil {
			return t.ExitCode, t.ExitCode != 0
		}
	}
	return 0, false
}

var exitMeanings = map[int32]string{
	validator.ExitNoRedirect: "no redirect",
	validator.ExitPortInUse:  "proxy port in use",
	validator.ExitUsage:      "bad arguments",
	validator.ExitFailure:    "failure",
}

func (c *Checker) checkValidators(s *state) Result {
	const name = "validator"
	if s.podsErr != nil {
		return cannot(name, s.podsErr)
	}
	var failed []string
	noRedirect, bare := 0, 0
	for i := range s.injected {
		p := &s.injected[i]
		code, bad := validatorExit(p)
		if !bad {
			continue
		}
		meaning := exitMeanings[code]
		if meaning == "" {
			meaning = "unknown code"
		}
		where := ""
		if p.Spec.NodeName != "" {
			where = " on " + p.Spec.NodeName
		}
		failed = append(failed, fmt.Sprintf("%s/%s%s (exit %d, %s)", p.Namespace, p.Name, where, code, meaning))
		if code == validator.ExitNoRedirect {
			noRedirect++
		}
		if _, ok := p.Annotations[repair.RecreateAnnotation]; ok {
			bare++
		}
	}
	if len(failed) == 0 {
		return Result{Name: name, Status: OK, Message: fmt.Sprintf("no injected pod's validator is failing (%s)", plural(len(s.injected), "injected pod"))}
	}
	var fix []string
	if noRedirect > 0 {
		fix = append(fix, fmt.Sprintf("exit %d: the pod's network namespace has no redirect because it started before detour's CNI config was on its node; the repair controller deletes controller-owned pods once the node carries %s=true, and annotates bare pods (%s) for you to delete and recreate", validator.ExitNoRedirect, ReadyLabel, repair.RecreateAnnotation))
	}
	if noRedirect < len(failed) {
		fix = append(fix, fmt.Sprintf("other codes: kubectl -n NS logs POD -c %s says what failed (docs/validator.md)", annotations.ValidatorContainer))
	}
	if bare > 0 {
		fix = append(fix, fmt.Sprintf("%s %s: kubectl delete pod, then create it again", plural(bare, "bare pod"), verb(bare, "waits", "wait")))
	}
	return Result{Name: name, Status: Error, Message: fmt.Sprintf("the validator of %s failed: %s", plural(len(failed), "injected pod"), list(failed)), Fix: strings.Join(fix, "; ")}
}

func eventTime(e *corev1.Event) time.Time {
	for _, t := range []time.Time{e.LastTimestamp.Time, e.EventTime.Time, e.FirstTimestamp.Time, e.CreationTimestamp.Time} {
		if !t.IsZero() {
			return t
		}
	}
	return time.Time{}
}

func (c *Checker) checkRepair(ctx context.Context) Result {
	const name = "repair"
	evs, err := c.client.CoreV1().Events("").List(ctx, metav1.ListOptions{FieldSelector: "reason=" + repair.EventReason})
	if err != nil {
		return cannot(name, fmt.Errorf("list Events: %w", err))
	}
	now := c.now()
	var recent []*corev1.Event
	for i := range evs.Items {
		e := &evs.Items[i]
		if e.Reason == repair.EventReason && now.Sub(eventTime(e)) <= c.since {
			recent = append(recent, e)
		}
	}
	if len(recent) == 0 {
		return Result{Name: name, Status: OK, Message: fmt.Sprintf("the repair controller recreated or annotated no pod in the last %s", c.since)}
	}
	slices.SortFunc(recent, func(a, b *corev1.Event) int { return eventTime(b).Compare(eventTime(a)) })
	deleted, annotated := 0, 0
	var items []string
	nodes := map[string]int{}
	for _, e := range recent {
		what := "deleted"
		if e.Action == "Annotate" {
			what = "annotated"
			annotated++
		} else {
			deleted++
		}
		nodes[e.Source.Host]++
		items = append(items, fmt.Sprintf("%s/%s on %s (%s %s ago)", e.InvolvedObject.Namespace, e.InvolvedObject.Name, e.Source.Host, what, now.Sub(eventTime(e)).Round(time.Second)))
	}
	return Result{Name: name, Status: Warning,
		Message: fmt.Sprintf("in the last %s the repair controller %s: %s", c.since, actions(deleted, annotated), list(items)),
		Fix:     fmt.Sprintf("these pods started before detour's CNI config was on their node (%s); repairs that repeat on one node mean its node agent does not keep the config in place: check the agent there and run detour check on the node (kubectl get events -A --field-selector reason=%s)", plural(len(nodes), "node"), repair.EventReason)}
}

func (c *Checker) checkVersionSkew(ctx context.Context, s *state) Result {
	const name = "version-skew"
	images := map[string][]string{} // image → components
	add := func(component, image string) {
		if image != "" && !slices.Contains(images[image], component) {
			images[image] = append(images[image], component)
		}
	}
	if s.deploy != nil {
		for _, ctr := range s.deploy.Spec.Template.Spec.Containers {
			add("webhook", ctr.Image)
		}
	}
	if s.ds != nil {
		for _, ctr := range s.ds.Spec.Template.Spec.Containers {
			add("node agent ("+ctr.Name+")", ctr.Image)
		}
	}
	if cm, err := c.client.CoreV1().ConfigMaps(c.namespace).Get(ctx, WebhookConfigMap, metav1.GetOptions{}); err == nil {
		var cfg struct {
			Validator struct {
				Image string `json:"image"`
			} `json:"validator"`
		}
		if yaml.Unmarshal([]byte(cm.Data["config.yaml"]), &cfg) == nil {
			add("validator", cfg.Validator.Image)
		}
	}
	switch len(images) {
	case 0:
		return Result{Name: name, Status: Warning, Message: "no detour component found to compare images",
			Fix: "see the webhook-deployment and node-agent checks"}
	case 1:
		for img, comps := range images {
			return Result{Name: name, Status: OK, Message: fmt.Sprintf("%s run one image, %s", strings.Join(comps, ", "), img)}
		}
	}
	keys := make([]string, 0, len(images))
	for img := range images {
		keys = append(keys, img)
	}
	slices.Sort(keys)
	var parts []string
	for _, img := range keys {
		parts = append(parts, strings.Join(images[img], ", ")+" run "+img)
	}
	return Result{Name: name, Status: Warning, Message: "detour's components run different images: " + strings.Join(parts, "; "),
		Fix: fmt.Sprintf("finish the upgrade: kubectl -n %s rollout status deployment/%s and daemonset/%s; the validator's image is in ConfigMap %s, which helm upgrade sets", c.namespace, WebhookDeployment, NodeAgentDaemonSet, WebhookConfigMap)}
}

func actions(deleted, annotated int) string {
	var parts []string
	if deleted > 0 {
		parts = append(parts, "deleted "+plural(deleted, "pod"))
	}
	if annotated > 0 {
		parts = append(parts, "annotated "+plural(annotated, "bare pod"))
	}
	return strings.Join(parts, " and ")
}

// maxListed bounds the names a message lists.
const maxListed = 5

func list(items []string) string {
	if len(items) <= maxListed {
		return strings.Join(items, ", ")
	}
	return strings.Join(items[:maxListed], ", ") + fmt.Sprintf(" and %d more", len(items)-maxListed)
}

func parenList(items []string) string {
	if len(items) == 0 {
		return ""
	}
	return " (" + list(items) + ")"
}

func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

func verb(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}

func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}
