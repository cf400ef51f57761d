package clustercheck

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/version"
	fakediscovery "k8s.io/client-go/discovery/fake"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/utils/ptr"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/inject"
	"github.com/detourmesh/detour/repair"
	"github.com/detourmesh/detour/validator"
)

const (
	ns    = DefaultNamespace
	image = "ghcr.io/detourmesh/detour:v0.1.0"
)

var serviceName = WebhookService + "." + ns + ".svc"

// fixture is a healthy installation as the chart makes it, on two nodes.
type fixture struct {
	mwc     *admissionv1.MutatingWebhookConfiguration
	svc     *corev1.Service
	slice   *discoveryv1.EndpointSlice
	deploy  *appsv1.Deployment
	ds      *appsv1.DaemonSet
	cm      *corev1.ConfigMap
	nodes   []*corev1.Node
	agents  []*corev1.Pod
	objects []runtime.Object // anything else: namespaces, pods, events
}

var agentLabels = map[string]string{"app.kubernetes.io/name": "detour", "app.kubernetes.io/component": "node-agent"}

func readyNode(name string, created time.Time) *corev1.Node {
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, CreationTimestamp: metav1.NewTime(created), Labels: map[string]string{ReadyLabel: "true"}}}
}

func agentPod(node string, ready bool) *corev1.Pod {
	status := corev1.ConditionFalse
	if ready {
		status = corev1.ConditionTrue
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: NodeAgentDaemonSet + "-" + node, Namespace: ns, Labels: agentLabels},
		Spec:       corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: InstallCNIContainer, Image: image}}},
		Status:     corev1.PodStatus{Phase: corev1.PodRunning, Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: status}}},
	}
}

func newFixture(caPEM []byte, now time.Time) *fixture {
	webhookLabels := map[string]string{"app.kubernetes.io/name": "detour", "app.kubernetes.io/component": "webhook"}
	f := &fixture{
		mwc: &admissionv1.MutatingWebhookConfiguration{
			ObjectMeta: metav1.ObjectMeta{Name: WebhookConfiguration},
			Webhooks: []admissionv1.MutatingWebhook{{
				Name: WebhookName, AdmissionReviewVersions: []string{"v1"}, SideEffects: ptr.To(admissionv1.SideEffectClassNone),
				FailurePolicy: ptr.To(admissionv1.Ignore),
				Rules: []admissionv1.RuleWithOperations{{
					Operations: []admissionv1.OperationType{admissionv1.Create},
					Rule:       admissionv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"pods"}, Scope: ptr.To(admissionv1.NamespacedScope)},
				}},
				NamespaceSelector: &metav1.LabelSelector{MatchExpressions: []metav1.LabelSelectorRequirement{{
					Key: corev1.LabelMetadataName, Operator: metav1.LabelSelectorOpNotIn, Values: []string{ns, "kube-system"},
				}}},
				ClientConfig: admissionv1.WebhookClientConfig{
					Service:  &admissionv1.ServiceReference{Namespace: ns, Name: WebhookService, Path: ptr.To("/mutate-v1-pod")},
					CABundle: caPEM,
				},
			}},
		},
		svc: &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: WebhookService, Namespace: ns},
			Spec:       corev1.ServiceSpec{Selector: webhookLabels, Ports: []corev1.ServicePort{{Name: "https", Port: 443}}},
		},
		slice: &discoveryv1.EndpointSlice{
			ObjectMeta:  metav1.ObjectMeta{Name: WebhookService + "-abcde", Namespace: ns, Labels: map[string]string{discoveryv1.LabelServiceName: WebhookService}},
			AddressType: discoveryv1.AddressTypeIPv4,
			Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("https"), Port: ptr.To[int32](9443)}},
			Endpoints: []discoveryv1.Endpoint{{
				Addresses: []string{"10.244.0.10"}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)},
				TargetRef: &corev1.ObjectReference{Kind: "Pod", Namespace: ns, Name: WebhookDeployment + "-7d4b9-x1"},
			}},
		},
		deploy: &appsv1.Deployment{
			ObjectMeta: metav1.ObjectMeta{Name: WebhookDeployment, Namespace: ns},
			Spec: appsv1.DeploymentSpec{
				Replicas: ptr.To[int32](2), Selector: &metav1.LabelSelector{MatchLabels: webhookLabels},
				Template: corev1.PodTemplateSpec{
					ObjectMeta: metav1.ObjectMeta{Labels: webhookLabels},
					Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "webhook", Image: image}}},
				},
			},
			Status: appsv1.DeploymentStatus{Replicas: 2, AvailableReplicas: 2, UpdatedReplicas: 2, ReadyReplicas: 2},
		},
		ds: &appsv1.DaemonSet{
			ObjectMeta: metav1.ObjectMeta{Name: NodeAgentDaemonSet, Namespace: ns},
			Spec: appsv1.DaemonSetSpec{
				Selector: &metav1.LabelSelector{MatchLabels: agentLabels},
				Template: corev1.PodTemplateSpec{
					ObjectMeta: metav1.ObjectMeta{Labels: agentLabels},
					Spec: corev1.PodSpec{
						Tolerations: []corev1.Toleration{{Operator: corev1.TolerationOpExists}},
						Containers: []corev1.Container{
							{Name: InstallCNIContainer, Image: image, Args: []string{"install-cni", "--startup-taint=" + StartupTaint}},
							{Name: "repair", Image: image, Args: []string{"repair"}},
						},
					},
				},
			},
		},
		cm: &corev1.ConfigMap{
			ObjectMeta: metav1.ObjectMeta{Name: WebhookConfigMap, Namespace: ns},
			Data:       map[string]string{"config.yaml": "proxy:\n  image: proxy:v1\nvalidator:\n  image: " + image + "\n  uid: 2103\n"},
		},
		objects: []runtime.Object{
			&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}},
			&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{corev1.LabelMetadataName: "shop"}, Annotations: map[string]string{annotations.Inject: "enabled"}}},
			injectedPod("shop", "web-1", 0),
		},
	}
	for _, n := range []string{"node-a", "node-b"} {
		f.nodes = append(f.nodes, readyNode(n, now.Add(-24*time.Hour)))
		f.agents = append(f.agents, agentPod(n, true))
	}
	return f
}

// foldingConfig is a webhook configuration whose check can run in the proxy's start.
const foldingConfig = "proxy:\n  image: proxy:v1\n  command: [proxy]\n  startupProbe: {tcpSocket: {port: 4191}}\nvalidator:\n  image: " + image + "\n"

func nodeInfo(kubelet string) corev1.NodeSystemInfo {
	return corev1.NodeSystemInfo{KubeletVersion: kubelet, ContainerRuntimeVersion: "containerd://2.4.2"}
}

// serverVersion makes the fake API server report version v.
func serverVersion(v string) func(*fake.Clientset) {
	return func(c *fake.Clientset) {
		c.Discovery().(*fakediscovery.FakeDiscovery).FakedServerVersion = &version.Info{GitVersion: v}
	}
}

// injectedPod is an injected pod whose validator exited with code (0: passed).
func injectedPod(namespace, name string, code int32) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace, Annotations: map[string]string{annotations.Injected: "v0.1.0"}},
		Spec: corev1.PodSpec{
			NodeName:       "node-a",
			InitContainers: []corev1.Container{{Name: annotations.ValidatorContainer, Image: image}},
			Containers:     []corev1.Container{{Name: "app", Image: "app"}},
		},
		Status: corev1.PodStatus{InitContainerStatuses: []corev1.ContainerStatus{{
			Name: annotations.ValidatorContainer, State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: code}},
		}}},
	}
}

func repairEvent(name, action string, at time.Time) *corev1.Event {
	return &corev1.Event{
		ObjectMeta:     metav1.ObjectMeta{Name: name + ".1", Namespace: "shop"},
		InvolvedObject: corev1.ObjectReference{Kind: "Pod", Namespace: "shop", Name: name},
		Reason:         repair.EventReason, Action: action, Type: corev1.EventTypeWarning,
		Source:        corev1.EventSource{Component: repair.Component, Host: "node-a"},
		LastTimestamp: metav1.NewTime(at), FirstTimestamp: metav1.NewTime(at),
	}
}

func (f *fixture) all() []runtime.Object {
	var objs []runtime.Object
	for _, o := range []runtime.Object{f.mwc, f.svc, f.slice, f.deploy, f.ds, f.cm} {
		if o != nil && !isNil(o) {
			objs = append(objs, o)
		}
	}
	for _, n := range f.nodes {
		objs = append(objs, n)
	}
	for _, p := range f.agents {
		objs = append(objs, p)
	}
	return append(objs, f.objects...)
}

func isNil(o runtime.Object) bool {
	switch v := o.(type) {
	case *admissionv1.MutatingWebhookConfiguration:
		return v == nil
	case *corev1.Service:
		return v == nil
	case *discoveryv1.EndpointSlice:
		return v == nil
	case *appsv1.Deployment:
		return v == nil
	case *appsv1.DaemonSet:
		return v == nil
	case *corev1.ConfigMap:
		return v == nil
	}
	return false
}

func find(r Report, name string) Result {
	if res, ok := r.Result(name); ok {
		return res
	}
	return Result{Name: name, Status: "missing"}
}

func TestCheckCluster(t *testing.T) {
	now := time.Now()
	ca := newCA(t, "detour webhook CA")
	good := tlsServer(t, ca.serving(t, 365*24*time.Hour, WebhookService, serviceName))
	expiring := tlsServer(t, ca.serving(t, 48*time.Hour, serviceName))
	wrongName := tlsServer(t, ca.serving(t, 365*24*time.Hour, "other.example"))
	other := newCA(t, "another CA")

	for _, tc := range []struct {
		name   string
		change func(f *fixture)
		server string
		// admit stands for the API server's admission of the dry-run probe pod (default: the
		// webhook injects it).
		admit  func(*corev1.Pod) (*corev1.Pod, error)
		client func(*fake.Clientset)
		// gate is the API server's ImageVolume gate (default on).
		gate inject.Gate
		// want maps check names to the status and a part of the message.
		want map[string]struct {
			status Status
			msg    string
		}
	}{
		{name: "healthy", want: map[string]struct {
			status Status
			msg    string
		}{
			"kubernetes-api":      {OK, "the API server answers"},
			"detour-namespace":    {OK, "detour-system exists"},
			"webhook-config":      {OK, "calls Service detour-system/detour-webhook:443/mutate-v1-pod (failurePolicy Ignore) with a caBundle of 1 certificate"},
			"webhook-endpoints":   {OK, "has 1 ready endpoint (pod detour-webhook-7d4b9-x1)"},
			"webhook-certificate": {OK, "the certificate pod detour-webhook-7d4b9-x1 serves verifies against the caBundle for detour-webhook.detour-system.svc"},
			"webhook-admission":   {OK, "the API server called the webhook: a dry-run pod in namespace shop came back injected (detour v0.1.0) in "},
			"webhook-deployment":  {OK, "2 of 2 replicas available"},
			"node-agent":          {OK, "ready on every node it runs on (2)"},
			"startup-taint":       {OK, "no node carries the startup taint detour.dev/cni-not-ready"},
			"ready-label":         {OK, "carries detour.dev/cni-ready=true"},
			"primary-cni":         {OK, "no Cilium configuration (ConfigMap cilium-config) in the cluster"},
			"opted-in-namespaces": {OK, "1 namespace opted in (shop); 1 injected pod"},
			"uninjected-pods":     {OK, "every pod of an opted-in namespace is injected"},
			"validator-mode":      {OK, "the validator's check runs as the detour-validator init container: proxy.command is not set"},
			"validator":           {OK, "no injected pod's validator is failing (1 injected pod)"},
			"repair":              {OK, "no pod in the last 1h0m0s"},
			"version-skew":        {OK, "webhook, node agent (install-cni), node agent (repair), validator run one image, " + image},
		}},
		{name: "Cilium as its chart installs it", change: func(f *fixture) {
			f.objects = append(f.objects, ciliumConfig(map[string]string{"cni-exclusive": "true", "kube-proxy-replacement": "false", "bpf-lb-sock": "false"}))
			for _, n := range f.nodes {
				n.Status.NodeInfo = nodeInfo("v1.37.2")
			}
		}, want: map[string]struct {
			status Status
			msg    string
		}{"primary-cni": {OK, "Cilium (ConfigMap kube-system/cilium-config): no socket load balancing; cni.exclusive is on, and detour's drop-in, which Cilium leaves alone, is the form on every node (2)"}}},
		{name: "Cilium, exclusive, runtimes without drop-ins", change: func(f *fixture) {
			f.objects = append(f.objects, ciliumConfig(map[string]string{"cni-exclusive": "true"}))
			f.nodes[0].Status.NodeInfo = nodeInfo("v1.37.2")
			f.nodes[1].Status.NodeInfo = corev1.NodeSystemInfo{ContainerRuntimeVersion: "containerd://1.7.27"}
		}, want: map[string]struct {
			status Status
			msg    string
		}{"primary-cni": {Error, "cni.exclusive is on and detour's configuration is an entry in Cilium's conflist on 1 node (node-b)"}}},
		{name: "Cilium, exclusive, chained-entry", change: func(f *fixture) {
			f.objects = append(f.objects, ciliumConfig(map[string]string{"cni-exclusive": "true"}))
			f.ds.Spec.Template.Spec.Containers[0].Args = append(f.ds.Spec.Template.Spec.Containers[0].Args, "--cni-config-mode=chained-entry")
			for _, n := range f.nodes {
				n.Status.NodeInfo = nodeInfo("v1.37.2")
			}
		}, want: map[string]struct {
			status Status
			msg    string
		}{"primary-cni": {Error, "an entry in Cilium's conflist on 2 nodes (node-a, node-b)"}}},
		{name: "Cilium, exclusive off, in-file entry", change: func(f *fixture) {
			f.objects = append(f.objects, ciliumConfig(map[string]string{"cni-exclusive": "false"}))
			f.ds.Spec.Template.Spec.Containers[0].Args = append(f.ds.Spec.Template.Spec.Containers[0].Args, "--cni-config-mode=chained-entry")
		}, want: map[string]struct {
			status Status
			msg    string
		}{"primary-cni": {OK, "no socket load balancing; cni.exclusive off"}}},
		{name: "Cilium replacing kube-proxy, socket LB in pods", change: func(f *fixture) {
			f.objects = append(f.objects, ciliumConfig(map[string]string{"kube-proxy-replacement": "true", "bpf-lb-sock": "false"}))
		}, want: map[string]struct {
			status Status
			msg    string
		}{"primary-cni": {Error, "Cilium load-balances Services at connect() inside the pods (kube-proxy-replacement true, which turns socket load balancing on, bpf-lb-sock-hostns-only not true)"}}},
		{name: "Cilium, socket LB without kube-proxy replacement", change: func(f *fixture) {
			f.objects = append(f.objects, ciliumConfig(map[string]string{"bpf-lb-sock": "true", "bpf-lb-sock-hostns-only": "false"}))
		}, want: map[string]struct {
			status Status
			msg    string
		}{"primary-cni": {Error, "inside the pods (bpf-lb-sock true, bpf-lb-sock-hostns-only not true)"}}},
		{name: "Cilium replacing kube-proxy, socket LB in the host namespace only", change: func(f *fixture) {
			f.objects = append(f.objects, ciliumConfig(map[string]string{"kube-proxy-replacement": "true", "bpf-lb-sock-hostns-only": "true"}))
		}, want: map[string]struct {
			status Status
			msg    string
		}{"primary-cni": {OK, "socket load balancing stays in the host's namespace (bpf-lb-sock-hostns-only true); cni.exclusive off"}}},
		{name: "Cilium in its own namespace, both broken", change: func(f *fixture) {
			cm := ciliumConfig(map[string]string{"kube-proxy-replacement": "true", "cni-exclusive": "true"})
			cm.Namespace = "cilium"
			f.objects = append(f.objects, cm)
			f.nodes[1].Status.NodeInfo = corev1.NodeSystemInfo{ContainerRuntimeVersion: "cri-o://1.30.4"}
		}, want: map[string]struct {
			status Status
			msg    string
		}{"primary-cni": {Error, "Cilium (ConfigMap cilium/cilium-config): Cilium load-balances Services at connect() inside the pods"}}},
		{name: "API unreachable", client: func(c *fake.Clientset) {
			c.PrependReactor("get", "version", func(k8stesting.Action) (bool, runtime.Object, error) {
				return true, nil, errors.New("dial tcp 10.0.0.1:6443: connect: connection refused")
			})
		}, want: map[string]struct {
			status Status
			msg    string
		}{"kubernetes-api": {Error, "cannot reach the API server: dial tcp"}, "webhook-config": {"missing", ""}}},
		{name: "not installed", change: func(f *fixture) { *f = fixture{} }, want: map[string]struct {
			status Status
			msg    string
		}{"detour-namespace": {Error, "namespace detour-system not found"}, "webhook-config": {"missing", ""}}},
		{name: "uninstalled, the namespace left", change: func(f *fixture) { f.mwc, f.deploy, f.ds = nil, nil, nil }, want: map[string]struct {
			status Status
			msg    string
		}{"detour-namespace": {Error, "detour is not installed in namespace detour-system: no Deployment detour-webhook, no DaemonSet detour-node-agent, no MutatingWebhookConfiguration detour"}, "webhook-config": {"missing", ""}, "node-agent": {"missing", ""}}},
		{name: "no webhook configuration", change: func(f *fixture) { f.mwc = nil }, want: map[string]struct {
			status Status
			msg    string
		}{"webhook-config": {Error, "MutatingWebhookConfiguration detour not found"}, "webhook-endpoints": {OK, "1 ready endpoint"}, "webhook-certificate": {"missing", ""}}},
		{name: "empty caBundle", change: func(f *fixture) { f.mwc.Webhooks[0].ClientConfig.CABundle = nil }, want: map[string]struct {
			status Status
			msg    string
		}{"webhook-config": {Error, "has an empty caBundle"}}},
		{name: "wrong caBundle", change: func(f *fixture) { f.mwc.Webhooks[0].ClientConfig.CABundle = other.pem }, want: map[string]struct {
			status Status
			msg    string
		}{"webhook-config": {OK, ""}, "webhook-certificate": {Error, "does not verify against webhook inject.detour.dev's caBundle for detour-webhook.detour-system.svc: x509: certificate signed by unknown authority"}}},
		{name: "certificate for another name", server: wrongName, want: map[string]struct {
			status Status
			msg    string
		}{"webhook-certificate": {Error, "x509: certificate is valid for other.example, not detour-webhook.detour-system.svc"}}},
		{name: "certificate expiring", server: expiring, want: map[string]struct {
			status Status
			msg    string
		}{"webhook-certificate": {Warning, "verifies for detour-webhook.detour-system.svc but one expires in 4"}}},
		{name: "webhook pod unreachable", server: "127.0.0.1:1", want: map[string]struct {
			status Status
			msg    string
		}{"webhook-certificate": {Warning, "could not see the certificate pod detour-webhook-7d4b9-x1 serves on port 9443"}}},
		{name: "no ready endpoint", change: func(f *fixture) {
			f.slice.Endpoints[0].Conditions.Ready = ptr.To(false)
			f.deploy.Status.AvailableReplicas = 0
		}, want: map[string]struct {
			status Status
			msg    string
		}{
			"webhook-endpoints":   {Error, "Service detour-system/detour-webhook has no ready endpoint: the API server cannot call the webhook, so pods are admitted uninjected"},
			"webhook-certificate": {Warning, "no ready endpoint to dial"},
			"webhook-deployment":  {Error, "Deployment detour-webhook has no available replica (0 of 2)"},
		}},
		{name: "webhook scaled to 0", change: func(f *fixture) {
			f.slice.Endpoints = nil
			f.deploy.Spec.Replicas = ptr.To[int32](0)
			f.deploy.Status = appsv1.DeploymentStatus{}
		}, want: map[string]struct {
			status Status
			msg    string
		}{"webhook-deployment": {Error, "Deployment detour-webhook is scaled to 0 replicas"}, "webhook-endpoints": {Error, "no ready endpoint"}}},
		{name: "two replicas", change: func(f *fixture) {
			second := f.slice.Endpoints[0]
			second.Addresses = []string{"10.244.1.10"}
			second.TargetRef = &corev1.ObjectReference{Kind: "Pod", Namespace: ns, Name: WebhookDeployment + "-7d4b9-x2"}
			f.slice.Endpoints = append(f.slice.Endpoints, second)
		}, want: map[string]struct {
			status Status
			msg    string
		}{
			"webhook-endpoints":   {OK, "has 2 ready endpoints (pod detour-webhook-7d4b9-x1, pod detour-webhook-7d4b9-x2)"},
			"webhook-certificate": {OK, "the certificates pod detour-webhook-7d4b9-x1, pod detour-webhook-7d4b9-x2 serve verify against the caBundle"},
		}},
		{name: "the API server cannot reach the webhook", admit: func(p *corev1.Pod) (*corev1.Pod, error) { return p, nil }, want: map[string]struct {
			status Status
			msg    string
		}{"webhook-certificate": {OK, ""}, "webhook-admission": {Error, "a dry-run pod in namespace shop that asks for injection came back uninjected after 0s: the API server could not call the webhook and admitted it anyway (failurePolicy Ignore)"}}},
		{name: "the API server cannot reach the webhook, failurePolicy Fail", change: func(f *fixture) { f.mwc.Webhooks[0].FailurePolicy = ptr.To(admissionv1.Fail) },
			admit: func(*corev1.Pod) (*corev1.Pod, error) {
				return nil, apierrors.NewInternalError(errors.New(`failed calling webhook "inject.detour.dev": failed to call webhook: Post "https://detour-webhook.detour-system.svc:443/mutate-v1-pod?timeout=10s": context deadline exceeded`))
			}, want: map[string]struct {
				status Status
				msg    string
			}{"webhook-admission": {Error, `the API server could not call the webhook for a dry-run pod in namespace shop: Internal error occurred: failed calling webhook "inject.detour.dev"`}}},
		{name: "the webhook configuration does not select the pod", change: func(f *fixture) { f.mwc.Webhooks[0].FailurePolicy = ptr.To(admissionv1.Fail) },
			admit: func(p *corev1.Pod) (*corev1.Pod, error) { return p, nil }, want: map[string]struct {
				status Status
				msg    string
			}{"webhook-admission": {Error, "the webhook configuration does not select it"}}},
		{name: "an opted-in namespace the webhook does not select", change: func(f *fixture) {
			f.mwc.Webhooks[0].NamespaceSelector.MatchExpressions[0].Values = []string{ns, "kube-system", "shop"}
		}, want: map[string]struct {
			status Status
			msg    string
		}{"webhook-admission": {Error, "webhook inject.detour.dev's namespaceSelector (kubernetes.io/metadata.name notin (detour-system,kube-system,shop)) does not select namespace shop, which is opted in: its pods are not injected"}}},
		{name: "rules without pod creation", change: func(f *fixture) {
			f.mwc.Webhooks[0].Rules[0].Operations = []admissionv1.OperationType{admissionv1.Update}
		}, want: map[string]struct {
			status Status
			msg    string
		}{"webhook-admission": {Error, "webhook inject.detour.dev's rules do not cover creating pods (v1): no pod is injected"}}},
		{name: "an objectSelector", change: func(f *fixture) {
			f.mwc.Webhooks[0].ObjectSelector = &metav1.LabelSelector{MatchLabels: map[string]string{"mesh": "on"}}
		}, want: map[string]struct {
			status Status
			msg    string
		}{"webhook-admission": {Warning, "webhook inject.detour.dev has an objectSelector (mesh=on)"}}},
		{name: "no permission to create pods", admit: func(*corev1.Pod) (*corev1.Pod, error) {
			return nil, apierrors.NewForbidden(corev1.Resource("pods"), "", errors.New(`User "dev" cannot create resource "pods" in API group "" in the namespace "shop"`))
		}, want: map[string]struct {
			status Status
			msg    string
		}{"webhook-admission": {Warning, "a dry-run pod in namespace shop was refused, so the API server's call to the webhook was not checked"}}},
		{name: "rollout", change: func(f *fixture) { f.deploy.Status.AvailableReplicas = 1 }, want: map[string]struct {
			status Status
			msg    string
		}{"webhook-deployment": {Warning, "1 of 2 replicas available, 2 up to date"}}},
		{name: "no Service", change: func(f *fixture) { f.svc = nil }, want: map[string]struct {
			status Status
			msg    string
		}{"webhook-endpoints": {Error, "Service detour-system/detour-webhook not found"}}},
		{name: "failurePolicy Fail", change: func(f *fixture) {
			f.mwc.Webhooks[0].FailurePolicy = ptr.To(admissionv1.Fail)
			f.slice.Endpoints = nil
		}, want: map[string]struct {
			status Status
			msg    string
		}{"webhook-endpoints": {Error, "so pod creation fails in the namespaces the webhook selects"}}},
		{name: "seed 000: a node tainted, its agent not ready", change: func(f *fixture) {
			n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-c", CreationTimestamp: metav1.NewTime(now.Add(-10 * time.Minute))},
				Spec: corev1.NodeSpec{Taints: []corev1.Taint{{Key: StartupTaint, Effect: corev1.TaintEffectNoSchedule}}}}
			f.nodes = append(f.nodes, n)
			f.agents = append(f.agents, agentPod("node-c", false))
			f.agents[2].Status.ContainerStatuses = []corev1.ContainerStatus{{Name: InstallCNIContainer, State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff"}}}}
		}, want: map[string]struct {
			status Status
			msg    string
		}{
			"node-agent":    {Error, "DaemonSet detour-node-agent is not ready on 1 of 3 nodes: node-c (pod detour-node-agent-node-c not ready, CrashLoopBackOff)"},
			"startup-taint": {Error, "1 node still carries the startup taint detour.dev/cni-not-ready: node-c (registered 10m0s ago)"},
			"ready-label":   {OK, ""},
		}},
		{name: "a new node, tainted for seconds", change: func(f *fixture) {
			f.nodes = append(f.nodes, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-c", CreationTimestamp: metav1.NewTime(now.Add(-20 * time.Second))},
				Spec: corev1.NodeSpec{Taints: []corev1.Taint{{Key: StartupTaint, Effect: corev1.TaintEffectNoSchedule}}}})
		}, want: map[string]struct {
			status Status
			msg    string
		}{"startup-taint": {Warning, "registered under 2m0s ago"}, "node-agent": {Error, "node-c (no agent pod)"}}},
		{name: "a custom startup taint", change: func(f *fixture) {
			f.ds.Spec.Template.Spec.Containers[0].Args[1] = "--startup-taint=example.com/cni"
			f.nodes[0].Spec.Taints = []corev1.Taint{{Key: "example.com/cni", Effect: corev1.TaintEffectNoSchedule}}
		}, want: map[string]struct {
			status Status
			msg    string
		}{"startup-taint": {Error, "the startup taint example.com/cni: node-a"}}},
		{name: "a node without the label nor the taint", change: func(f *fixture) { delete(f.nodes[1].Labels, ReadyLabel) }, want: map[string]struct {
			status Status
			msg    string
		}{"ready-label": {Error, "1 node without the startup taint lacks the ready label detour.dev/cni-ready=true: node-b"}}},
		{name: "uninstall mode", change: func(f *fixture) {
			f.ds.Spec.Template.Spec.Containers[0].Args = append(f.ds.Spec.Template.Spec.Containers[0].Args, "--uninstall", "--hold")
			delete(f.nodes[1].Labels, ReadyLabel)
		}, want: map[string]struct {
			status Status
			msg    string
		}{"ready-label": {Warning, "uninstall mode"}}},
		{name: "nodes the agent does not run on", change: func(f *fixture) {
			f.ds.Spec.Template.Spec.NodeSelector = map[string]string{"pool": "mesh"}
			f.nodes[0].Labels["pool"] = "mesh"
			f.nodes[1].Spec.Taints = []corev1.Taint{{Key: "gpu", Effect: corev1.TaintEffectNoSchedule}}
			delete(f.nodes[1].Labels, ReadyLabel)
			f.agents = f.agents[:1]
		}, want: map[string]struct {
			status Status
			msg    string
		}{"node-agent": {OK, "ready on every node it runs on (1)"}, "ready-label": {OK, ""}}},
		{name: "no DaemonSet", change: func(f *fixture) { f.ds = nil }, want: map[string]struct {
			status Status
			msg    string
		}{"node-agent": {Error, "DaemonSet detour-system/detour-node-agent not found"}}},
		{name: "nobody opted in", change: func(f *fixture) { f.objects = f.objects[:1] }, want: map[string]struct {
			status Status
			msg    string
		}{"opted-in-namespaces": {Warning, "no namespace opted in (annotation detour.dev/inject=enabled) and 0 injected pods"}, "webhook-admission": {OK, "namespace default"}}},
		{name: "validators failed", change: func(f *fixture) {
			crashing := injectedPod("shop", "web-2", 0)
			crashing.Status.InitContainerStatuses[0].State = corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff"}}
			crashing.Status.InitContainerStatuses[0].LastTerminationState = corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: validator.ExitNoRedirect}}
			bare := injectedPod("shop", "bare", validator.ExitNoRedirect)
			bare.Annotations[repair.RecreateAnnotation] = "recreate it"
			passedLater := injectedPod("shop", "web-3", 0)
			passedLater.Status.InitContainerStatuses[0].LastTerminationState = corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: validator.ExitNoRedirect}}
			runningAgain := injectedPod("shop", "web-4", 0)
			runningAgain.Status.InitContainerStatuses[0].State = corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}
			runningAgain.Status.InitContainerStatuses[0].LastTerminationState = corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: validator.ExitNoRedirect}}
			uninjected := injectedPod("shop", "plain", validator.ExitNoRedirect)
			uninjected.Annotations = nil
			f.objects = append(f.objects, crashing, bare, passedLater, runningAgain, uninjected, injectedPod("other", "api", validator.ExitPortInUse))
		}, want: map[string]struct {
			status Status
			msg    string
		}{"validator": {Error, "the validator of 4 injected pods failed: other/api on node-a (exit 43, proxy port in use), shop/bare on node-a (exit 42, no redirect), shop/web-2 on node-a (exit 42, no redirect), shop/web-4 on node-a (exit 42, no redirect)"}}},
		{name: "pods admitted uninjected", change: func(f *fixture) {
			plain := func(ns, name string) *corev1.Pod {
				p := injectedPod(ns, name, 0)
				p.Annotations, p.Spec.InitContainers, p.Status.InitContainerStatuses = nil, nil, nil
				return p
			}
			optedOut := plain("shop", "opted-out")
			optedOut.Annotations = map[string]string{annotations.Inject: "disabled"}
			hostNet := plain("shop", "host")
			hostNet.Spec.HostNetwork = true
			done := plain("shop", "done")
			done.Status.Phase = corev1.PodSucceeded
			mirror := plain("shop", "static")
			mirror.Annotations = map[string]string{corev1.MirrorPodAnnotationKey: "x"}
			// The annotations read as the webhook reads them (surrounding spaces ignored).
			optedOutSpaced := plain("shop", "opted-out-spaced")
			optedOutSpaced.Annotations = map[string]string{annotations.Inject: " disabled"}
			padded := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "padded", Annotations: map[string]string{annotations.Inject: "enabled\n"}}}
			f.objects = append(f.objects, plain("shop", "web-2"), plain("shop", "bare"), plain("other", "not-opted-in"), optedOut, hostNet, done, mirror,
				optedOutSpaced, padded, plain("padded", "api"))
		}, want: map[string]struct {
			status Status
			msg    string
		}{"uninjected-pods": {Warning, "3 pods of opted-in namespaces run without detour: padded/api, shop/bare, shop/web-2; 1 finished pod of opted-in namespaces ran without detour: shop/done"}}},
		{name: "mesh-wide: namespaces without the annotation count as opted in", change: func(f *fixture) {
			f.cm.Data["config.yaml"] += "defaultInject: enabled\n"
			plain := func(ns, name string) *corev1.Pod {
				p := injectedPod(ns, name, 0)
				p.Annotations, p.Spec.InitContainers, p.Status.InitContainerStatuses = nil, nil, nil
				return p
			}
			f.objects = append(f.objects,
				&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "other"}},
				&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "legacy", Annotations: map[string]string{annotations.Inject: "disabled"}}},
				&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "kube-public"}},
				plain("other", "api"), plain("legacy", "old"), plain("kube-public", "info"), plain(ns, "tool"))
		}, want: map[string]struct {
			status Status
			msg    string
		}{
			"opted-in-namespaces": {OK, "2 namespaces opted in (other, shop) (the webhook's defaultInject is enabled: every namespace but the excluded ones and those annotated detour.dev/inject=disabled); 1 injected pod"},
			"uninjected-pods":     {Warning, "1 pod of opted-in namespaces runs without detour: other/api"},
		}},
		{name: "recent repairs", change: func(f *fixture) {
			f.objects = append(f.objects,
				repairEvent("web-1", "Delete", now.Add(-5*time.Minute)),
				repairEvent("bare", "Annotate", now.Add(-10*time.Minute)),
				repairEvent("old", "Delete", now.Add(-2*time.Hour)))
		}, want: map[string]struct {
			status Status
			msg    string
		}{"repair": {Warning, "in the last 1h0m0s the repair controller deleted 1 pod and annotated 1 bare pod: shop/web-1 on node-a (deleted 5m0s ago), shop/bare on node-a (annotated 10m0s ago)"}}},
		// Issue 21: where the check runs, and why, from the webhook's own configuration and the
		// nodes' versions and labels.
		{name: "the check in the proxy's start", change: func(f *fixture) {
			f.cm.Data["config.yaml"] = foldingConfig
			for _, n := range f.nodes {
				n.Status.NodeInfo = nodeInfo("v1.37.2")
				n.Labels[annotations.ImageVolumesLabel] = "true"
			}
		}, client: serverVersion("v1.37.2"), want: map[string]struct {
			status Status
			msg    string
		}{"validator-mode": {OK, "the validator's check runs at the start of the detour-proxy container (image volume): every node (2) mounts image volumes"}}},
		{name: "a node that cannot mount image volumes", change: func(f *fixture) {
			f.cm.Data["config.yaml"] = foldingConfig
			f.nodes[0].Status.NodeInfo, f.nodes[1].Status.NodeInfo = nodeInfo("v1.37.2"), nodeInfo("v1.34.3")
			f.nodes[0].Labels[annotations.ImageVolumesLabel] = "true"
		}, client: serverVersion("v1.37.2"), want: map[string]struct {
			status Status
			msg    string
		}{"validator-mode": {OK, "runs as the detour-validator init container: 1 of 2 nodes do not carry detour.dev/image-volumes=true: node-b: the kubelet v1.34.3 has image volumes off by default"}}},
		// Issue 34: an API server with its ImageVolume gate off keeps no image volume.
		{name: "the API server's gate off", change: func(f *fixture) {
			f.cm.Data["config.yaml"] = foldingConfig
			for _, n := range f.nodes {
				n.Status.NodeInfo = nodeInfo("v1.37.2")
				n.Labels[annotations.ImageVolumesLabel] = "true"
			}
		}, gate: inject.GateOff, client: serverVersion("v1.35.2"), want: map[string]struct {
			status Status
			msg    string
		}{"validator-mode": {OK, "runs as the detour-validator init container: the API server v1.35.2 has its ImageVolume feature gate off"}}},
		{name: "image-volume pinned, a node not labelled", change: func(f *fixture) {
			f.cm.Data["config.yaml"] = foldingConfig + "  mode: image-volume\n"
			f.nodes[0].Status.NodeInfo, f.nodes[1].Status.NodeInfo = nodeInfo("v1.37.2"), nodeInfo("v1.37.2")
			f.nodes[0].Labels[annotations.ImageVolumesLabel] = "true"
		}, client: serverVersion("v1.37.2"), want: map[string]struct {
			status Status
			msg    string
		}{"validator-mode": {Warning, "its pods run only on nodes labelled detour.dev/image-volumes=true, and 1 nodes are not: node-b"}}},
		{name: "the proxy's check failed", change: func(f *fixture) {
			p := f.objects[2].(*corev1.Pod)
			p.Annotations[annotations.Validator] = "image-volume"
			p.Status.InitContainerStatuses = []corev1.ContainerStatus{{Name: annotations.ProxyContainer, LastTerminationState: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{
				ExitCode: 42, Message: "detour: no redirect in this pod's network namespace: …"}}}}
		}, want: map[string]struct {
			status Status
			msg    string
		}{"validator": {Error, "the validator of 1 injected pod failed: shop/web-1 on node-a (exit 42, no redirect)"}}},
		// At the proxy's start, exit 43 is the check port taken by a container of the pod (after a
		// proxy restart), not the proxy's port.
		{name: "the proxy's check port taken", change: func(f *fixture) {
			p := f.objects[2].(*corev1.Pod)
			p.Annotations[annotations.Validator] = "image-volume"
			p.Status.InitContainerStatuses = []corev1.ContainerStatus{{Name: annotations.ProxyContainer, LastTerminationState: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{
				ExitCode: validator.ExitPortInUse, Message: "detour: port 4142 is taken by a socket listening on 0.0.0.0:4142 owned by uid 1000, not by the proxy (uid 2102): …"}}}}
		}, want: map[string]struct {
			status Status
			msg    string
		}{"validator": {Error, "the validator of 1 injected pod failed: shop/web-1 on node-a (exit 43, check port in use)"}}},
		// Issue 32.4: a proxy that started has passed its check, although its last termination
		// is a failed check (before a reboot; the new sandbox had the redirect).
		{name: "the proxy's check failed once, then passed", change: func(f *fixture) {
			p := f.objects[2].(*corev1.Pod)
			p.Annotations[annotations.Validator] = "image-volume"
			started := true
			p.Status.InitContainerStatuses = []corev1.ContainerStatus{{Name: annotations.ProxyContainer, Started: &started,
				State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{}},
				LastTerminationState: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{
					ExitCode: 42, Message: "detour: no redirect in this pod's network namespace: …"}}}}
		}, want: map[string]struct {
			status Status
			msg    string
		}{"validator": {OK, "no injected pod's validator is failing (1 injected pod)"}}},
		{name: "version skew", change: func(f *fixture) { f.ds.Spec.Template.Spec.Containers[1].Image = "ghcr.io/detourmesh/detour:v0.2.0" }, want: map[string]struct {
			status Status
			msg    string
		}{"version-skew": {Warning, "detour's components run different images: webhook, node agent (install-cni), validator run " + image + "; node agent (repair) run ghcr.io/detourmesh/detour:v0.2.0"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(ca.pem, now)
			if tc.change != nil {
				tc.change(f)
			}
			client := fake.NewClientset(f.all()...)
			admit := tc.admit
			if admit == nil {
				admit = func(p *corev1.Pod) (*corev1.Pod, error) {
					p.Annotations[annotations.Injected] = "v0.1.0"
					return p, nil
				}
			}
			client.PrependReactor("create", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
				create := a.(k8stesting.CreateActionImpl)
				if !slices.Equal(create.CreateOptions.DryRun, []string{metav1.DryRunAll}) {
					t.Errorf("the check created a pod without dryRun=All: %+v", create.CreateOptions)
				}
				p, err := admit(create.Object.(*corev1.Pod).DeepCopy())
				return true, p, err
			})
			if tc.client != nil {
				tc.client(client)
			}
			server := good
			if tc.server != "" {
				server = tc.server
			}
			gate := tc.gate
			if gate == 0 {
				gate = inject.GateOn
			}
			r := New(client, WithDialer(dialTo(server)), WithClock(func() time.Time { return now }),
				WithImageVolumeGate(func(context.Context) (inject.Gate, string) { return gate, "" })).Run(context.Background())
			var text bytes.Buffer
			r.WriteText(&text)
			for name, w := range tc.want {
				got := find(r, name)
				if got.Status != w.status || !strings.Contains(got.Message, w.msg) {
					t.Errorf("%s: %s %q\nwant %s containing %q\nreport:\n%s", name, got.Status, got.Message, w.status, w.msg, text.String())
				}
				if got.Status == Error || got.Status == Warning {
					if got.Fix == "" || got.Docs != DocsURL+"#check-cluster-"+name {
						t.Errorf("%s: fix %q, docs %q: want a fix and the docs link", name, got.Fix, got.Docs)
					}
				}
			}
			if tc.name == "healthy" {
				if r.Failed() || r.Warnings != 0 || len(r.Results) != len(tc.want) {
					t.Errorf("healthy cluster: %d errors, %d warnings, %d results:\n%s", r.Errors, r.Warnings, len(r.Results), text.String())
				}
				for i, res := range r.Results {
					if i >= len(CheckNames) || res.Name != CheckNames[i] {
						t.Errorf("result %d is %s; CheckNames lists the checks in order: %v", i, res.Name, CheckNames)
					}
				}
			}
			for _, res := range r.Results {
				if strings.Contains(res.Message, "\n") {
					t.Errorf("%s: the message is more than one line: %q", res.Name, res.Message)
				}
			}
		})
	}
}

func TestReportOutput(t *testing.T) {
	r := Report{}
	r.add(Result{Name: "kubernetes-api", Status: OK, Message: "the API server answers (Kubernetes v1.37.2)"})
	r.add(Result{Name: "repair", Status: Warning, Message: "repaired 1 pod", Fix: "look at node-a"})
	r.add(Result{Name: "validator", Status: Error, Message: "the validator of 1 injected pod failed", Fix: "recreate it"})
	var text bytes.Buffer
	if err := r.WriteText(&text); err != nil {
		t.Fatal(err)
	}
	want := `✓ the API server answers (Kubernetes v1.37.2)
‼ repaired 1 pod
    fix: look at node-a
    see: ` + DocsURL + `#check-cluster-repair
✗ the validator of 1 injected pod failed
    fix: recreate it
    see: ` + DocsURL + `#check-cluster-validator

3 checks: 1 ✓, 1 ‼, 1 ✗
`
	if text.String() != want {
		t.Errorf("text output:\n%s\nwant:\n%s", text.String(), want)
	}
	var js bytes.Buffer
	if err := r.WriteJSON(&js); err != nil {
		t.Fatal(err)
	}
	var back Report
	if err := json.Unmarshal(js.Bytes(), &back); err != nil || back.Errors != 1 || back.Warnings != 1 || back.Results[2].Status != Error || back.Results[0].Docs != "" {
		t.Errorf("JSON output %s: %v", js.String(), err)
	}
}

// Every check's docs link leads to a section of docs/troubleshooting.md.
func TestTroubleshootingHasEveryCheck(t *testing.T) {
	doc, err := os.ReadFile("../../docs/troubleshooting.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range CheckNames {
		if !strings.Contains(string(doc), "\n### check-cluster: "+name+"\n") {
			t.Errorf("docs/troubleshooting.md has no section \"### check-cluster: %s\" (the anchor of the check's docs link)", name)
		}
	}
}

// The message names the first few uninjected pods; Objects (in -o json) names every one, so a
// script can act on all of them.
func TestUninjectedPodsObjects(t *testing.T) {
	s := &state{}
	var want []string
	for i := range 7 {
		p := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "shop", Name: fmt.Sprintf("web-%d", i)}}
		if i == 6 {
			p.Status.Phase = corev1.PodSucceeded
		}
		s.uninjected = append(s.uninjected, p)
		want = append(want, "shop/"+p.Name)
	}
	res := (&Checker{}).checkUninjected(s)
	if res.Status != Warning || !slices.Equal(res.Objects, want) {
		t.Errorf("objects %v, want %v", res.Objects, want)
	}
	if msg := "6 pods of opted-in namespaces run without detour: shop/web-0, shop/web-1, shop/web-2, shop/web-3, shop/web-4 and 1 more; 1 finished pod of opted-in namespaces ran without detour: shop/web-6"; res.Message != msg {
		t.Errorf("message %q\nwant %q", res.Message, msg)
	}
}

// ciliumConfig is Cilium's ConfigMap as its chart renders it into kube-system, with data
// besides the conflist it writes.
func ciliumConfig(data map[string]string) *corev1.ConfigMap {
	d := map[string]string{"write-cni-conf-when-ready": "/host/etc/cni/net.d/05-cilium.conflist", "enable-policy": "default"}
	for k, v := range data {
		d[k] = v
	}
	return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: CiliumConfigMap, Namespace: "kube-system"}, Data: d}
}

// The fix for exit 43 says where the check runs: at the proxy's start, a container of the pod
// holds the check port and the proxy crash-loops until the pod is recreated — with the check's
// own message, which names the socket and its owner, when the termination message has it; in
// the validator container, the generic pointer to its log.
func TestValidatorsPortInUseFix(t *testing.T) {
	const said = "port 4142 is taken by a socket listening on 0.0.0.0:4142 owned by uid 1000, not by the proxy (uid 2102): …"
	atStart := func(name, message string) corev1.Pod {
		p := injectedPod("shop", name, 0)
		p.Annotations[annotations.Validator] = "image-volume"
		p.Status.InitContainerStatuses = []corev1.ContainerStatus{{Name: annotations.ProxyContainer,
			State:                corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff"}},
			LastTerminationState: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: validator.ExitPortInUse, Message: message}}}}
		return *p
	}
	for _, tc := range []struct {
		name    string
		pods    []corev1.Pod
		message string
		fix     []string
		not     []string
	}{
		{"at the proxy's start", []corev1.Pod{atStart("web-1", "detour validate: …\ndetour: "+said+"\n")},
			"shop/web-1 on node-a (exit 43, check port in use)",
			[]string{"exit 43 at the proxy's start (shop/web-1): a container of the pod listens on the check port (the pod's detour.dev/validator-check-port, the webhook's validator.checkPort)",
				"the proxy crash-loops until the pod is recreated: move its port or set validator.checkPort",
				"Event DetourCheckPortInUse",
				`the check says shop/web-1: "` + said + `"`},
			[]string{"other codes"}},
		{"without the check's message", []corev1.Pod{atStart("web-2", "detour: \n")},
			"shop/web-2 on node-a (exit 43, check port in use)",
			[]string{"exit 43 at the proxy's start (shop/web-2)"}, []string{"the check says"}},
		{"in the validator container", []corev1.Pod{*injectedPod("shop", "web-3", validator.ExitPortInUse)},
			"shop/web-3 on node-a (exit 43, proxy port in use)",
			[]string{"other codes: kubectl -n NS logs POD -c detour-validator"}, []string{"at the proxy's start"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := (&Checker{}).checkValidators(&state{injected: len(tc.pods), failing: tc.pods})
			if res.Status != Error || !strings.Contains(res.Message, tc.message) {
				t.Errorf("%s %q, want an error naming %q", res.Status, res.Message, tc.message)
			}
			for _, w := range tc.fix {
				if !strings.Contains(res.Fix, w) {
					t.Errorf("fix\n%s\nlacks\n%s", res.Fix, w)
				}
			}
			for _, w := range tc.not {
				if strings.Contains(res.Fix, w) {
					t.Errorf("fix\n%s\nhas\n%s", res.Fix, w)
				}
			}
		})
	}
}
