package annotations

// Names of the containers the webhook injects. The repair controller finds the validator by
// its name, and the webhook recognizes a pod it already injected by them, so they never change.
const (
	ProxyContainer     = "detour-proxy"
	ValidatorContainer = "detour-validator"
)

// ValidatorVolume is the image volume that holds detour's image in a pod whose validator check
// runs in the proxy's start, and ValidatorMountPath where the proxy container mounts it.
const (
	ValidatorVolume    = "detour-validator"
	ValidatorMountPath = "/.detour"
)

// ImageVolumesLabel is set to "true" by the node agent on a node whose kubelet and container
// runtime mount image volumes; a pod whose check runs in the proxy's start selects it. It
// describes the node's software and stays when detour is uninstalled: the kubelet admits
// running pods again when it restarts, and would reject them without it.
const ImageVolumesLabel = Prefix + "image-volumes"

// Node readiness, set by the node agent once detour's CNI config is in place.
const (
	// CNIReadyLabel is set to "true" on a node whose CNI config includes detour.
	CNIReadyLabel = Prefix + "cni-ready"
	// CNIReadyBootAnnotation holds the node's boot ID (status.nodeInfo.bootID) when the node
	// agent set the ready label: after a reboot the label is stale until the agent, started
	// again, has put detour's entry back, and readers (the repair controller) tell so by the
	// boot ID the kubelet reports having changed.
	CNIReadyBootAnnotation = Prefix + "cni-ready-boot-id"
	// CNINotReadyTaint is the default key of the startup taint nodes are registered with; the
	// node agent removes it once detour's CNI config is in place.
	CNINotReadyTaint = Prefix + "cni-not-ready"
)
