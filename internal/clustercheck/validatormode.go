package clustercheck

import (
	"fmt"
	"slices"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/inject"
)

// checkValidatorMode says where the validator's check runs in the pods the webhook injects as
// native sidecars, and why: the webhook's own decision (inject.ResolveValidatorMode) from its
// configuration in the ConfigMap, the API server's version and the nodes' kubelet and runtime
// versions. Where the check runs in the proxy's start, such pods run only on nodes the agent
// labelled detour.dev/image-volumes=true: it warns about nodes without the label, and says why
// each cannot mount image volumes, or that no agent labelled it.
func (c *Checker) checkValidatorMode(s *state) Result {
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
	cluster := inject.Cluster{Nodes: len(s.nodes)}
	if v, err := c.client.Discovery().ServerVersion(); err == nil {
		cluster.APIServerVersion = v.GitVersion
	}
	var unlabelled []string
	for i := range s.nodes {
		n := &s.nodes[i]
		if ok, why := inject.ImageVolumes(n.Status.NodeInfo); !ok {
			cluster.WithoutImageVolumes = append(cluster.WithoutImageVolumes, n.Name+": "+why)
		} else if n.Labels[annotations.ImageVolumesLabel] != "true" {
			unlabelled = append(unlabelled, n.Name)
		}
	}
	d := inject.ResolveValidatorMode(cfg, cluster)
	where := "as the detour-validator init container"
	if d.Mode == annotations.ValidatorImageVolume {
		where = "at the start of the detour-proxy container (image volume)"
	}
	msg := fmt.Sprintf("the validator's check runs %s: %s", where, d.Reason)
	if d.Mode == annotations.ValidatorImageVolume && len(unlabelled)+len(cluster.WithoutImageVolumes) > 0 {
		objects := append(slices.Clone(unlabelled), cluster.WithoutImageVolumes...)
		return Result{Name: name, Status: Warning,
			Message: fmt.Sprintf("%s; its pods run only on nodes labelled %s=true, and %d nodes are not: %s",
				msg, annotations.ImageVolumesLabel, len(objects), list(objects)),
			Objects: objects,
			Fix: "the node agent labels a node once detour's configuration is in place there and its kubelet (1.35+) and runtime (containerd 2.1+, CRI-O 1.31+) mount image volumes: " +
				"see node-agent for nodes without it, upgrade the others, or set webhook.config.validator.mode to auto or init-container"}
	}
	return Result{Name: name, Status: OK, Message: msg}
}
