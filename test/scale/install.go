package scale

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

// Namespace is where the harness installs detour.
const Namespace = "detour-system"

// Chart is detour's chart rendered with the harness's values.
type Chart struct {
	// Apply are the objects applied as they are: the namespace, the ServiceAccounts, the RBAC,
	// the admission policies, the ConfigMap, the DaemonSet. The harness plays the DaemonSet's
	// controller and each node's kubelet ([Cluster.StartAgent]) and runs the webhook itself
	// ([Cluster.StartWebhook]), so the webhook's Deployment, Service and budget are left out.
	Apply []string
	// DaemonSet is the node agent's; Webhook the MutatingWebhookConfiguration, which the API
	// server gets pointing at the harness's webhook; WebhookConfig the webhook's configuration
	// file (its ConfigMap's).
	DaemonSet     *appsv1.DaemonSet
	Webhook       *admissionv1.MutatingWebhookConfiguration
	WebhookConfig []byte
}

// Render renders detour's chart at dir with values (helm template).
func Render(ctx context.Context, binDir, dir, chart, values string) (*Chart, error) {
	valuesFile := filepath.Join(dir, "values.yaml")
	if err := os.WriteFile(valuesFile, []byte(values), 0o644); err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, filepath.Join(binDir, "helm"), "template", "detour", chart, "--namespace", Namespace, "--values", valuesFile)
	cmd.Env = append(os.Environ(), "HOME="+dir)
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("helm template %s: %w%s", chart, err, stderrOf(err))
	}
	c := &Chart{}
	for _, doc := range regexp.MustCompile(`(?m)^---\s*$`).Split(string(out), -1) {
		kind := regexp.MustCompile(`(?m)^kind:\s*(\S+)`).FindStringSubmatch(doc)
		if kind == nil {
			continue
		}
		var into any
		switch kind[1] {
		case "Deployment", "Service", "PodDisruptionBudget":
			continue
		case "MutatingWebhookConfiguration":
			c.Webhook = &admissionv1.MutatingWebhookConfiguration{}
			if err := yaml.Unmarshal([]byte(doc), c.Webhook); err != nil {
				return nil, fmt.Errorf("read the chart's MutatingWebhookConfiguration: %w", err)
			}
			continue
		case "DaemonSet":
			c.DaemonSet = &appsv1.DaemonSet{}
			into = c.DaemonSet
		case "ConfigMap":
			var cm corev1.ConfigMap
			if err := yaml.Unmarshal([]byte(doc), &cm); err != nil {
				return nil, fmt.Errorf("read the chart's ConfigMap: %w", err)
			}
			if cm.Name == "detour-webhook" {
				for _, v := range cm.Data {
					c.WebhookConfig = []byte(v)
				}
			}
		}
		if into != nil {
			if err := yaml.Unmarshal([]byte(doc), into); err != nil {
				return nil, fmt.Errorf("read the chart's %s: %w", kind[1], err)
			}
		}
		c.Apply = append(c.Apply, doc)
	}
	if c.DaemonSet == nil || c.Webhook == nil || c.WebhookConfig == nil {
		return nil, fmt.Errorf("the chart at %s rendered no node agent DaemonSet, MutatingWebhookConfiguration or webhook ConfigMap", chart)
	}
	return c, nil
}

// Install applies chart's objects, writes the plugin stub the agents install, and returns the
// chart's DaemonSet as the API server holds it.
func (c *Cluster) Install(ctx context.Context, chart *Chart) (*appsv1.DaemonSet, error) {
	manifest := filepath.Join(c.Dir, "detour.yaml")
	if err := os.WriteFile(manifest, []byte(strings.Join(chart.Apply, "\n---\n")), 0o644); err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, filepath.Join(c.BinDir, "kubectl"), "apply", "--server-side", "-f", manifest)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+c.Kubeconfig, "HOME="+c.Dir)
	if _, err := cmd.Output(); err != nil {
		return nil, fmt.Errorf("kubectl apply %s: %w%s", manifest, err, stderrOf(err))
	}
	if err := os.WriteFile(c.pluginStub(), []byte("detour-cni stands in here: no CNI ADD runs on a simulated node\n"), 0o755); err != nil {
		return nil, err
	}
	ds := chart.DaemonSet
	return c.Client.AppsV1().DaemonSets(ds.Namespace).Get(ctx, ds.Name, metav1.GetOptions{})
}

func stderrOf(err error) string {
	if ee, ok := err.(*exec.ExitError); ok && len(ee.Stderr) > 0 {
		return "\n" + string(ee.Stderr)
	}
	return ""
}
