package webhook

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	toolscache "k8s.io/client-go/tools/cache"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/inject"
)

// ValidatorModes keeps the webhook's decision of where the validator's check runs
// ([inject.ResolveValidatorMode]) up to date with the cluster: whether the API server keeps
// image volumes (its feature gate, [ValidatorModes.SetAPIServerGate]) and which Linux nodes
// carry detour.dev/image-volumes=true — the label each node's agent sets, and takes off, as its
// kubelet and runtime mount image volumes or not, in place upgrades and downgrades included.
// It keeps what it needs of each node (the label, its versions for the reason) from a watch
// whose cache holds nothing else of a Node ([nodeImageVolumes]), so a node's status updates cost
// a map lookup, and decides again only when something it depends on changes. A decision that
// changes the mode is logged at info level with its reason, and shown by the
// detour_webhook_validator_mode gauge.
type ValidatorModes struct {
	cfg       *inject.Config
	apiServer string
	log       *slog.Logger
	gauge     *prometheus.GaugeVec

	mu           sync.Mutex
	nodes        map[string]string // name → why it does not carry the label; "" when it does
	without      int
	gate         inject.Gate
	gateWhy      string
	gateRead     atomic.Bool
	nodesUnknown string
	decision     atomic.Pointer[inject.ValidatorDecision]
	// announced: a decision was logged at info level (the first one with nodes is, whatever
	// its mode).
	announced bool
}

// NewValidatorModes returns the decision for cfg on an API server of version apiServer, before
// any node or the API server's gate is known; gauge may be nil.
func NewValidatorModes(cfg *inject.Config, apiServer string, log *slog.Logger, gauge *prometheus.GaugeVec) *ValidatorModes {
	v := &ValidatorModes{cfg: cfg, apiServer: apiServer, log: log, gauge: gauge, nodes: map[string]string{}}
	v.decideLocked()
	return v
}

// Current is the decision now.
func (v *ValidatorModes) Current() inject.ValidatorDecision { return *v.decision.Load() }

// SetAPIServerGate records whether the API server keeps image volumes (why says why it is
// unknown).
func (v *ValidatorModes) SetAPIServerGate(g inject.Gate, why string) {
	v.gateRead.Store(true)
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.gate == g && v.gateWhy == why {
		return
	}
	v.gate, v.gateWhy = g, why
	v.decideLocked()
}

// GateRead reports whether the API server's gate was read (or tried) once.
func (v *ValidatorModes) GateRead() bool { return v.gateRead.Load() }

// SetNodesUnknown records that the webhook cannot know the nodes, and why (it may not list
// them): then every pod gets the init container.
func (v *ValidatorModes) SetNodesUnknown(why string) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.nodesUnknown = why
	v.decideLocked()
}

// Handler is the node watch's event handler.
func (v *ValidatorModes) Handler() toolscache.ResourceEventHandler {
	return toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { v.set(obj, true) },
		UpdateFunc: func(_, obj any) { v.set(obj, true) },
		DeleteFunc: func(obj any) { v.set(obj, false) },
	}
}

func (v *ValidatorModes) set(obj any, present bool) {
	if tomb, ok := obj.(toolscache.DeletedFinalStateUnknown); ok {
		obj = tomb.Obj
	}
	node, ok := obj.(*corev1.Node)
	if !ok {
		return
	}
	if node.Labels[corev1.LabelOSStable] == string(corev1.Windows) {
		present = false // the webhook never injects Windows pods: such a node does not count
	}
	why := ""
	if node.Labels[annotations.ImageVolumesLabel] != "true" {
		why = "no node agent labelled it"
		if ok, reason := inject.ImageVolumes(node.Status.NodeInfo); !ok {
			why = reason
		}
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	before, known := v.nodes[node.Name]
	switch {
	case !present && !known, present && known && before == why:
		return // nothing the decision depends on changed
	case !present:
		delete(v.nodes, node.Name)
	default:
		v.nodes[node.Name] = why
	}
	if known && before != "" {
		v.without--
	}
	if present && why != "" {
		v.without++
	}
	v.decideLocked()
}

// decideLocked decides again; v.mu is held (or v is not shared yet).
func (v *ValidatorModes) decideLocked() {
	c := inject.Cluster{APIServerVersion: v.apiServer, APIServerImageVolumes: v.gate, APIServerGateWhy: v.gateWhy,
		NodesUnknown: v.nodesUnknown, Nodes: len(v.nodes)}
	for name, why := range v.nodes {
		if len(c.WithoutImageVolumes) == v.without {
			break
		}
		if why != "" {
			c.WithoutImageVolumes = append(c.WithoutImageVolumes, name+": "+why)
		}
	}
	d := inject.ResolveValidatorMode(v.cfg, c)
	last := v.decision.Load()
	if last != nil && *last == d {
		return
	}
	v.decision.Store(&d)
	level := slog.LevelInfo
	switch {
	case len(v.nodes) == 0 && v.nodesUnknown == "" && v.cfg.Validator.Mode == annotations.ValidatorAuto:
		level = slog.LevelDebug // before the node cache has anything: not a decision yet
	case last != nil && last.Mode == d.Mode && v.announced:
		level = slog.LevelDebug // the same mode, a new count of nodes in its reason
	default:
		v.announced = true
	}
	v.log.Log(context.Background(), level, "validator mode", "mode", d.Mode, "reason", d.Reason, "configured", v.cfg.Validator.Mode)
	if v.gauge != nil {
		for _, m := range []annotations.ValidatorModeValue{annotations.ValidatorInitContainer, annotations.ValidatorImageVolume} {
			value := 0.0
			if m == d.Mode {
				value = 1
			}
			v.gauge.WithLabelValues(string(m)).Set(value)
		}
	}
}

// nodeImageVolumes is the cache's transform for Nodes: of a Node it keeps its name, its OS and
// image-volume labels and the kubelet's and runtime's versions, nothing of the rest (its
// images, conditions, other labels), so that a large cluster's nodes cost the webhook little
// memory.
func nodeImageVolumes(obj any) (any, error) {
	node, ok := obj.(*corev1.Node)
	if !ok {
		return obj, nil
	}
	labels := map[string]string{}
	for _, k := range []string{annotations.ImageVolumesLabel, corev1.LabelOSStable} {
		if v, ok := node.Labels[k]; ok {
			labels[k] = v
		}
	}
	return &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: node.Name, ResourceVersion: node.ResourceVersion, Labels: labels},
		Status: corev1.NodeStatus{NodeInfo: corev1.NodeSystemInfo{
			KubeletVersion: node.Status.NodeInfo.KubeletVersion, ContainerRuntimeVersion: node.Status.NodeInfo.ContainerRuntimeVersion,
		}},
	}, nil
}
