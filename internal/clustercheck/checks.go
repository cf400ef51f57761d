package clustercheck

import (
	"context"
	"fmt"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/inject"
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
	// webhookCM is the webhook's configuration (ConfigMap WebhookConfigMap).
	webhookCM    *corev1.ConfigMap
	webhookCMErr error
	// injected counts the injected pods of the cluster; failing holds those whose validator
	// failed, the only ones a check reads further (a cluster's every pod is not kept: tens of
	// thousands of them would take gigabytes).
	injected int
	failing  []corev1.Pod
	// uninjected are the pods of opted-in namespaces that are not injected although
	// nothing exempts them (see [uninjectedCandidate]).
	uninjected []corev1.Pod
	podsErr    error
	optedIn    []string // namespaces annotated detour.dev/inject=enabled, or unannotated under meshWide
	// meshWide: the webhook's configuration says defaultInject: enabled.
	meshWide bool
	nsLabels map[string]map[string]string
	nsErr    error
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
	s.webhookCM, s.webhookCMErr = c.client.CoreV1().ConfigMaps(c.namespace).Get(ctx, WebhookConfigMap, metav1.GetOptions{})
	var excluded map[string]bool
	s.meshWide, excluded = c.meshWide(s)
	if nss, err := c.client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{}); err != nil {
		s.nsErr = fmt.Errorf("list namespaces: %w", err)
	} else {
		s.nsLabels = map[string]map[string]string{}
		for _, ns := range nss.Items {
			s.nsLabels[ns.Name] = ns.Labels
			v, set := ns.Annotations[annotations.Inject]
			if mode, err := annotations.ParseInjectMode(v); set && err == nil && mode == annotations.InjectEnabled || (!set && s.meshWide && !excluded[ns.Name]) {
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
		optedIn := map[string]bool{}
		for _, ns := range s.optedIn {
			optedIn[ns] = true
		}
		for _, p := range pods.Items {
			switch {
			case annotations.IsInjected(p.Annotations):
				s.injected++
				if _, bad := validatorExit(&p); bad {
					p.ManagedFields = nil
					s.failing = append(s.failing, p)
				}
			case optedIn[p.Namespace] && uninjectedCandidate(&p):
				p.ManagedFields = nil
				s.uninjected = append(s.uninjected, p)
			}
		}
		if opts.Continue = pods.Continue; opts.Continue == "" {
			break
		}
	}
	return s
}

// meshWide reads the webhook's configuration: whether it injects the pods of namespaces
// without detour.dev/inject (defaultInject: enabled), and then the namespaces it never injects:
// its excludeNamespaces, its own, and the ones the chart's namespaceSelector leaves out. A
// configuration that cannot be read or parsed counts as opt-in only (the validator-mode check
// reports it).
func (c *Checker) meshWide(s *state) (bool, map[string]bool) {
	if s.webhookCMErr != nil {
		return false, nil
	}
	cfg, err := inject.ParseConfig([]byte(s.webhookCM.Data["config.yaml"]))
	if err != nil || cfg.DefaultInject != annotations.InjectEnabled {
		return false, nil
	}
	excluded := map[string]bool{c.namespace: true}
	for _, ns := range append(cfg.ExcludeNamespaces, neverInjected...) {
		excluded[ns] = true
	}
	return true, excluded
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
