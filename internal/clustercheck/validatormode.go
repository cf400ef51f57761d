package clustercheck

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/inject"
)

// checkValidatorMode says where the validator's check runs in the pods the webhook injects as
// native sidecars, and why: the webhook's own decision (inject.ResolveValidatorMode) from its
// configuration in the ConfigMap, whether the API server keeps image volumes (its ImageVolume
// gate, from its /metrics) and which nodes carry detour.dev/image-volumes=true. Where the check
// runs in the proxy's start, such pods run only on nodes with the label: it warns about nodes
// without it, and says why (the node's kubelet or runtime, or no agent labelled it).
func (c *Checker) checkValidatorMode(ctx context.Context, s *state) Result {
	const name = "validator-mode"
	if s.nodesErr != nil {
		return cannot(name, s.nodesErr)
	}
	if s.webhookCMErr != nil {
		return cannot(name, fmt.Errorf("read the webhook's configuration (ConfigMap %s): %w", WebhookConfigMap, s.webhookCMErr))
	}
	cfg, err := inject.ParseConfig([]byte(s.webhookCM.Data["config.yaml"]))
	if err != nil {
		return Result{Name: name, Status: Error, Message: fmt.Sprintf("the webhook's configuration (ConfigMap %s) does not parse: %v", WebhookConfigMap, err),
			Fix: "fix the chart values under webhook.config (docs/configuration.md) and upgrade; the webhook refuses to start with it"}
	}
	var cluster inject.Cluster
	if v, err := c.client.Discovery().ServerVersion(); err == nil {
		cluster.APIServerVersion = v.GitVersion
	}
	cluster.APIServerImageVolumes, cluster.APIServerGateWhy = c.gate(ctx)
	for i := range s.nodes {
		n := &s.nodes[i]
		if n.Labels[corev1.LabelOSStable] == string(corev1.Windows) {
			continue
		}
		cluster.Nodes++
		if n.Labels[annotations.ImageVolumesLabel] == "true" {
			continue
		}
		why := "no node agent labelled it"
		if ok, reason := inject.ImageVolumes(n.Status.NodeInfo); !ok {
			why = reason
		}
		cluster.WithoutImageVolumes = append(cluster.WithoutImageVolumes, n.Name+": "+why)
	}
	d := inject.ResolveValidatorMode(cfg, cluster)
	where := "as the detour-validator init container"
	if d.Mode == annotations.ValidatorImageVolume {
		where = "at the start of the detour-proxy container (image volume)"
	}
	msg := fmt.Sprintf("the validator's check runs %s: %s", where, d.Reason)
	if d.Mode == annotations.ValidatorImageVolume && len(cluster.WithoutImageVolumes) > 0 {
		return Result{Name: name, Status: Warning,
			Message: fmt.Sprintf("%s; its pods run only on nodes labelled %s=true, and %d nodes are not: %s",
				msg, annotations.ImageVolumesLabel, len(cluster.WithoutImageVolumes), list(cluster.WithoutImageVolumes)),
			Objects: cluster.WithoutImageVolumes,
			Fix: "the node agent labels a node once detour's configuration is in place there and its kubelet (1.35+) and runtime (containerd 2.1+, CRI-O 1.31+) mount image volumes: " +
				"see node-agent for nodes without it, upgrade the others, or set webhook.config.validator.mode to auto or init-container"}
	}
	return Result{Name: name, Status: OK, Message: msg}
}
