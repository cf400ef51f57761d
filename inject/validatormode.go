package inject

import (
	"cmp"
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

// NodeVersionsKnown reports whether info names both the kubelet's and the runtime's versions:
// a kubelet whose runtime does not answer (restarting) reports "<runtime>://Unknown", which
// says nothing of whether the node mounts image volumes.
func NodeVersionsKnown(info corev1.NodeSystemInfo) bool {
	_, kubelet := utilversion.ParseGeneric(info.KubeletVersion)
	_, v, _ := strings.Cut(info.ContainerRuntimeVersion, "://")
	_, runtime := utilversion.ParseGeneric(v)
	return kubelet == nil && runtime == nil
}

// Cluster is what the webhook knows of the cluster when it decides where the validator's check
// runs.
type Cluster struct {
	// APIServerVersion is the API server's version ("v1.37.2"); empty when unknown.
	APIServerVersion string
	// APIServerImageVolumes is whether the API server keeps a pod's image volumes: its
	// ImageVolume feature gate, as its /metrics report it (kubernetes_feature_enabled). An API
	// server with the gate off drops the volume and its mounts from the pods it stores.
	APIServerImageVolumes Gate
	// APIServerGateWhy says why APIServerImageVolumes is unknown (what reading it said).
	APIServerGateWhy string
	// NodesUnknown is why the nodes are not known (the webhook may not list them); "" when they
	// are.
	NodesUnknown string
	// Nodes is the number of nodes; WithoutImageVolumes describes those that do not carry
	// detour.dev/image-volumes=true — the label the node agent sets once detour is in place
	// there and the node's kubelet and runtime mount image volumes — as "name: why".
	Nodes               int
	WithoutImageVolumes []string
}

// Gate is a feature gate's state as read from a component, or unknown.
type Gate int

const (
	GateUnknown Gate = iota
	GateOn
	GateOff
)

// ValidatorDecision is where the validator's check runs in the pods the webhook injects in
// native sidecar mode, and why. Possible says whether a pod that asks for the check in the
// proxy's start (detour.dev/validator-mode: image-volume) can have it: the API server keeps image
// volumes and some node carries detour.dev/image-volumes=true, so its pod gets scheduled.
type ValidatorDecision struct {
	Mode     annotations.ValidatorModeValue // init-container or image-volume
	Reason   string
	Possible bool
	// WhyNot says why a pod's image-volume request cannot be granted, when it cannot.
	WhyNot string
}

// ResolveValidatorMode decides where the check runs for cfg on cluster c. The check runs in the
// proxy's start only where the API server keeps image volumes (its ImageVolume gate is on) —
// else it drops the pod's volume and mounts, and the pod would crash-loop or stay Pending — and
// where a node can run the pod (it carries detour.dev/image-volumes=true, which the pod
// selects). validator.mode image-volume asks for it wherever that holds; auto also needs the
// configuration to allow it (the proxy's command and a startup probe on one of its ports are
// known) and every node to carry the label, so that no pod waits for a node. Otherwise the
// init container, and the reason says which condition failed.
func ResolveValidatorMode(cfg *Config, c Cluster) ValidatorDecision {
	d := ValidatorDecision{Mode: annotations.ValidatorInitContainer}
	switch {
	case c.APIServerImageVolumes == GateOff:
		d.WhyNot = fmt.Sprintf("the API server %s has its ImageVolume feature gate off, so it would drop the volume", orUnknown(c.APIServerVersion))
	case c.APIServerImageVolumes == GateUnknown:
		d.WhyNot = "the webhook cannot tell whether the API server keeps image volumes (" + cmp.Or(c.APIServerGateWhy, "not read yet") + ")"
	case c.NodesUnknown != "":
		d.WhyNot = c.NodesUnknown
	case c.Nodes == 0:
		d.WhyNot = "no node has registered yet"
	case len(c.WithoutImageVolumes) == c.Nodes:
		d.WhyNot = fmt.Sprintf("no node carries %s=true, so its pods could not be scheduled: %s", annotations.ImageVolumesLabel, nodeList(c.WithoutImageVolumes))
	}
	d.Possible = d.WhyNot == ""
	switch cfg.Validator.Mode {
	case annotations.ValidatorInitContainer:
		d.Reason = "validator.mode is init-container"
		return d
	case annotations.ValidatorImageVolume:
		if !d.Possible {
			d.Reason = "validator.mode is image-volume, but " + d.WhyNot
			return d
		}
		d.Mode, d.Reason = annotations.ValidatorImageVolume, "validator.mode is image-volume"
		return d
	}
	switch why := cfg.foldBlocker(); {
	case why != "":
		d.Reason = why
	case !d.Possible:
		d.Reason = d.WhyNot
	case len(c.WithoutImageVolumes) > 0:
		d.Reason = fmt.Sprintf("%d of %d nodes do not carry %s=true: %s", len(c.WithoutImageVolumes), c.Nodes, annotations.ImageVolumesLabel, nodeList(c.WithoutImageVolumes))
	default:
		d.Mode = annotations.ValidatorImageVolume
		d.Reason = fmt.Sprintf("every node (%d) mounts image volumes, and the proxy's command and a startup probe on one of its ports are known", c.Nodes)
	}
	return d
}

// nodeList names at most five nodes ("name: why"), sorted, and how many more there are.
func nodeList(nodes []string) string {
	names := slices.Sorted(slices.Values(nodes))
	if n := len(names); n > 5 {
		names = append(names[:5], fmt.Sprintf("and %d more", n-5))
	}
	return strings.Join(names, "; ")
}

func orUnknown(s string) string {
	if s == "" {
		return "(version unknown)"
	}
	return s
}

// OfflineCluster is the cluster `detour inject` assumes: one node, which mounts image volumes
// or not, and an API server that keeps them.
func OfflineCluster(imageVolumes bool) Cluster {
	c := Cluster{APIServerVersion: "v" + ImageVolumeVersion.String() + ".0", APIServerImageVolumes: GateOn, Nodes: 1}
	if !imageVolumes {
		c.WithoutImageVolumes = []string{"the target cluster (--image-volumes=false)"}
	}
	return c
}
