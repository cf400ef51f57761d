package clustercheck

import (
	"bytes"
	"errors"
	"io"
	"os"
	"slices"
	"strings"
	"testing"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

// The check's names are the chart's: the startup taint in values.yaml, and the objects of the
// rendered bundle (manifests/install.yaml, which the manifests tests keep equal to the chart).
func TestNamesMatchTheChart(t *testing.T) {
	raw, err := os.ReadFile("../../manifests/charts/detour/values.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var values struct {
		NodeAgent struct {
			StartupTaint string `json:"startupTaint"`
		} `json:"nodeAgent"`
	}
	if err := yaml.Unmarshal(raw, &values); err != nil {
		t.Fatal(err)
	}
	if values.NodeAgent.StartupTaint != StartupTaint {
		t.Errorf("values.yaml nodeAgent.startupTaint %q, the check's StartupTaint %q", values.NodeAgent.StartupTaint, StartupTaint)
	}

	bundle, err := os.ReadFile("../../manifests/install.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var (
		namespaces []string
		mwc        *admissionv1.MutatingWebhookConfiguration
		svc        *corev1.Service
		cm         *corev1.ConfigMap
		deploy     *appsv1.Deployment
		ds         *appsv1.DaemonSet
	)
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(bundle), 4096)
	for {
		var obj map[string]any
		if err := dec.Decode(&obj); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		if obj == nil {
			continue
		}
		var into any
		switch obj["kind"] {
		case "Namespace":
			namespaces = append(namespaces, obj["metadata"].(map[string]any)["name"].(string))
		case "MutatingWebhookConfiguration":
			mwc = &admissionv1.MutatingWebhookConfiguration{}
			into = mwc
		case "Service":
			svc = &corev1.Service{}
			into = svc
		case "ConfigMap":
			cm = &corev1.ConfigMap{}
			into = cm
		case "Deployment":
			deploy = &appsv1.Deployment{}
			into = deploy
		case "DaemonSet":
			ds = &appsv1.DaemonSet{}
			into = ds
		}
		if into != nil {
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(obj, into); err != nil {
				t.Fatal(err)
			}
		}
	}
	if !slices.Equal(namespaces, []string{DefaultNamespace}) {
		t.Errorf("install.yaml creates namespaces %v, want [%s]", namespaces, DefaultNamespace)
	}
	if mwc == nil || svc == nil || cm == nil || deploy == nil || ds == nil {
		t.Fatalf("install.yaml lacks an object the check reads")
	}
	if mwc.Name != WebhookConfiguration || len(mwc.Webhooks) != 1 || mwc.Webhooks[0].Name != WebhookName {
		t.Errorf("MutatingWebhookConfiguration %s with webhooks %v, want %s with %s", mwc.Name, mwc.Webhooks, WebhookConfiguration, WebhookName)
	} else if s := mwc.Webhooks[0].ClientConfig.Service; s == nil || s.Name != WebhookService || s.Namespace != DefaultNamespace || (s.Port != nil && *s.Port != 443) {
		t.Errorf("the webhook calls %+v, want Service %s/%s:443", s, DefaultNamespace, WebhookService)
	}
	if svc.Name != WebhookService || svc.Namespace != DefaultNamespace || len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].Port != 443 {
		t.Errorf("Service %s/%s ports %v, want %s/%s port 443", svc.Namespace, svc.Name, svc.Spec.Ports, DefaultNamespace, WebhookService)
	}
	if cm.Name != WebhookConfigMap || !strings.Contains(cm.Data["config.yaml"], "image: "+deploy.Spec.Template.Spec.Containers[0].Image) {
		t.Errorf("ConfigMap %s does not name the webhook's image as the validator's:\n%s", cm.Name, cm.Data["config.yaml"])
	}
	if deploy.Name != WebhookDeployment || deploy.Spec.Selector.MatchLabels["app.kubernetes.io/component"] != "webhook" {
		t.Errorf("Deployment %s selector %v, want %s with app.kubernetes.io/component=webhook (the fixes name it)", deploy.Name, deploy.Spec.Selector.MatchLabels, WebhookDeployment)
	}
	if ds.Name != NodeAgentDaemonSet || ds.Spec.Selector.MatchLabels["app.kubernetes.io/component"] != "node-agent" {
		t.Errorf("DaemonSet %s selector %v, want %s with app.kubernetes.io/component=node-agent (the fixes name it)", ds.Name, ds.Spec.Selector.MatchLabels, NodeAgentDaemonSet)
	}
	i := slices.IndexFunc(ds.Spec.Template.Spec.Containers, func(c corev1.Container) bool { return c.Name == InstallCNIContainer })
	if i < 0 || !slices.Contains(ds.Spec.Template.Spec.Containers[i].Args, "--startup-taint="+StartupTaint) {
		t.Errorf("DaemonSet %s has no container %s with --startup-taint=%s", ds.Name, InstallCNIContainer, StartupTaint)
	}
}
