package inject

import (
	"fmt"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	utilversion "k8s.io/apimachinery/pkg/util/version"

	"github.com/detourmesh/detour/annotations"
)

// ImageVolumeVersion is the first Kubernetes version whose API server and kubelet have image
// volumes on by default (the ImageVolume feature: beta and on by default since 1.35).
var ImageVolumeVersion = utilversion.MajorMinor(1, 35)

// Minimum versions that mount image volumes (the ImageVolume feature): the kubelet has it on by
// default from 1.35; the runtime must implement the CRI's image mounts.
var imageVolumeRuntimes = map[string]*utilversion.Version{
	"containerd": utilversion.MustParseGeneric("2.1.0"),
	"cri-o":      utilversion.MustParseGeneric("1.31.0"),
}

// ImageVolumes reports whether a node whose kubelet and runtime are those of info (as the
// kubelet reports them in status.nodeInfo) mounts image volumes, and says why for people. The
// node agent labels such a node detour.dev/image-volumes=true.
func ImageVolumes(info corev1.NodeSystemInfo) (bool, string) {
	kubelet, err := utilversion.ParseGeneric(info.KubeletVersion)
	switch {
	case err != nil:
		return false, fmt.Sprintf("the kubelet's version %q cannot be read", info.KubeletVersion)
	case !kubelet.AtLeast(ImageVolumeVersion):
		return false, fmt.Sprintf("the kubelet %s has image volumes off by default (on from %s)", info.KubeletVersion, ImageVolumeVersion)
	}
	name, v, _ := strings.Cut(info.ContainerRuntimeVersion, "://")
	min, known := imageVolumeRuntimes[name]
	if !known {
		return false, fmt.Sprintf("the runtime %q is not one detour knows mounts image volumes (containerd 2.1 or later, CRI-O 1.31 or later)", info.ContainerRuntimeVersion)
	}
	have, err := utilversion.ParseGeneric(v)
	switch {
	case err != nil:
		return false, fmt.Sprintf("the runtime %s has a version detour cannot read", info.ContainerRuntimeVersion)
	case have.LessThan(min):
		return false, fmt.Sprintf("%s %s mounts no image volumes (it needs %s or later)", name, v, min)
	}
	return true, fmt.Sprintf("the kubelet %s and %s %s mount image volumes", info.KubeletVersion, name, v)
}

// Cluster is what the webhook knows of the cluster when it decides where the validator's check
// runs (validator.mode auto).
type Cluster struct {
	// APIServerVersion is the API server's version ("v1.37.2"); empty when unknown.
	APIServerVersion string
	// Nodes is the number of nodes; WithoutImageVolumes describes those whose kubelet or
	// runtime cannot mount image volumes, as "name: why" ([ImageVolumes]).
	Nodes               int
	WithoutImageVolumes []string
}

// ValidatorDecision is where the validator's check runs in the pods the webhook injects in
// native sidecar mode, and why.
type ValidatorDecision struct {
	Mode   annotations.ValidatorModeValue // init-container or image-volume
	Reason string
}

// ResolveValidatorMode decides where the check runs for cfg on cluster c. validator.mode
// init-container and image-volume are the admin's choice; auto picks image-volume when the
// configuration allows it (the proxy's command and a startup probe on one of its ports are
// known), the API server is 1.35 or later and every node's kubelet and runtime mount image
// volumes — else the init container, and the reason says which condition failed. Either way a pod whose check runs in
// the proxy's start selects detour.dev/image-volumes=true, which the node agent sets only on
// such nodes, so no node that cannot mount its volume runs it.
func ResolveValidatorMode(cfg *Config, c Cluster) ValidatorDecision {
	switch cfg.Validator.Mode {
	case annotations.ValidatorInitContainer:
		return ValidatorDecision{annotations.ValidatorInitContainer, "validator.mode is init-container"}
	case annotations.ValidatorImageVolume:
		return ValidatorDecision{annotations.ValidatorImageVolume, "validator.mode is image-volume"}
	}
	initContainer := func(format string, args ...any) ValidatorDecision {
		return ValidatorDecision{annotations.ValidatorInitContainer, fmt.Sprintf(format, args...)}
	}
	if why := cfg.foldBlocker(); why != "" {
		return initContainer("%s", why)
	}
	if v, err := utilversion.ParseGeneric(c.APIServerVersion); err != nil || !v.AtLeast(ImageVolumeVersion) {
		return initContainer("the API server %s is older than %s, where image volumes are on by default", orUnknown(c.APIServerVersion), ImageVolumeVersion)
	}
	if c.Nodes == 0 {
		return initContainer("no node has registered yet")
	}
	if n := len(c.WithoutImageVolumes); n > 0 {
		names := slices.Sorted(slices.Values(c.WithoutImageVolumes))
		if n > 5 {
			names = append(names[:5], fmt.Sprintf("and %d more", n-5))
		}
		return initContainer("%d of %d nodes cannot mount image volumes: %s", n, c.Nodes, strings.Join(names, "; "))
	}
	return ValidatorDecision{annotations.ValidatorImageVolume, fmt.Sprintf("every node (%d) mounts image volumes, and the proxy's command and a startup probe on one of its ports are known", c.Nodes)}
}

func orUnknown(s string) string {
	if s == "" {
		return "(version unknown)"
	}
	return s
}

// OfflineCluster is the cluster `detour inject` assumes: one node, which mounts image volumes
// or not, and an API server new enough for them.
func OfflineCluster(imageVolumes bool) Cluster {
	c := Cluster{APIServerVersion: "v" + ImageVolumeVersion.String() + ".0", Nodes: 1}
	if !imageVolumes {
		c.WithoutImageVolumes = []string{"the target cluster (--image-volumes=false)"}
	}
	return c
}
