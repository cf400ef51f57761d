package clustercheck

import (
	"github.com/detourmesh/detour/annotations"
)

// The names of the objects the chart (manifests/charts/detour) creates. A test reads the chart
// and the rendered bundle and keeps them equal.
const (
	// DefaultNamespace is the release namespace of the chart and of manifests/install.yaml.
	DefaultNamespace = "detour-system"
	// WebhookConfiguration is the MutatingWebhookConfiguration, WebhookName its webhook.
	WebhookConfiguration = "detour"
	WebhookName          = "inject.detour.dev"
	// WebhookService is the webhook's Service, WebhookDeployment its Deployment and
	// WebhookConfigMap the ConfigMap of its configuration file.
	WebhookService    = "detour-webhook"
	WebhookDeployment = "detour-webhook"
	WebhookConfigMap  = "detour-webhook"
	// NodeAgentDaemonSet is the node agent (install-cni and repair containers).
	NodeAgentDaemonSet = "detour-node-agent"
	// InstallCNIContainer is the node agent's container that takes --startup-taint.
	InstallCNIContainer = "install-cni"
	// StartupTaint is the chart's default nodeAgent.startupTaint; the check reads the
	// DaemonSet's --startup-taint when it is set.
	StartupTaint = annotations.CNINotReadyTaint
	// ReadyLabel is the label the node agent sets to "true" once detour's CNI config is in place.
	ReadyLabel = annotations.CNIReadyLabel
)

// DocsURL is where each check's troubleshooting section lives; a Result's Docs is DocsURL
// followed by "#check-cluster-" and the check's name.
const DocsURL = "https://github.com/detourmesh/detour/blob/main/docs/troubleshooting.md"
