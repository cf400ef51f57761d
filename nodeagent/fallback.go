package nodeagent

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/cniplugin"
)

// FallbackEventReason is the reason of the Warning Event on a pod whose sandbox got every
// inbound connection redirected because the kernel refused the socket lookup.
const FallbackEventReason = "DetourInboundFallback"

// FallbackReporter tells people about the node's sandboxes that got the inbound fallback, which
// detour-cni records in its state directory (cniplugin.FallbackRecord) and takes away at DEL:
// once per sandbox, a Warning Event on the pod and the annotation
// [annotations.InboundFallback] on it (the pod's own detour.dev/redirect-inbound still says
// listening); and, at each scrape, detour_cni_inbound_fallback_pods.
type FallbackReporter struct {
	client   kubernetes.Interface
	stateDir string
	node     string
	log      *slog.Logger

	mu sync.Mutex
	// done holds the container IDs of the records told about, or whose pod is gone (a record
	// whose DEL was lost); they are not counted as running pods.
	done map[string]bool
	gone map[string]bool
}

// NewFallbackReporter returns the reporter for the plugin's state directory stateDir on node.
func NewFallbackReporter(client kubernetes.Interface, stateDir, node string, log *slog.Logger) *FallbackReporter {
	return &FallbackReporter{client: client, stateDir: stateDir, node: node, log: log, done: map[string]bool{}, gone: map[string]bool{}}
}

// Run reports now and every interval until ctx ends.
func (r *FallbackReporter) Run(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		r.Report(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Report makes one pass over the records: each new one gets its Event and annotation. A pass
// that cannot tell a pod is tried again at the next.
func (r *FallbackReporter) Report(ctx context.Context) {
	records, err := cniplugin.ReadFallbacks(r.stateDir)
	if err != nil {
		r.log.Warn("cannot read every inbound fallback record of the plugin", "err", err)
	}
	present := map[string]bool{}
	for _, rec := range records {
		present[rec.ContainerID] = true
		r.mu.Lock()
		done := r.done[rec.ContainerID]
		r.mu.Unlock()
		if done {
			continue
		}
		gone, err := r.tell(ctx, rec)
		if err != nil {
			r.log.Warn("cannot report a pod's inbound fallback; trying again (the agent's service account needs get and patch on pods, create on events)",
				"pod", rec.Namespace+"/"+rec.Name, "err", err)
			continue
		}
		r.mu.Lock()
		r.done[rec.ContainerID], r.gone[rec.ContainerID] = true, gone
		r.mu.Unlock()
		if !gone {
			r.log.Warn("a pod got every inbound connection redirected: the kernel refused the socket lookup", "pod", rec.Namespace+"/"+rec.Name, "refusal", rec.Refusal)
		}
	}
	r.mu.Lock()
	for id := range r.done {
		if !present[id] {
			delete(r.done, id)
			delete(r.gone, id)
		}
	}
	r.mu.Unlock()
}

// tell puts rec's Event and annotation on its pod; gone reports a pod that is no longer there
// (or is another pod of the same name).
func (r *FallbackReporter) tell(ctx context.Context, rec cniplugin.FallbackRecord) (gone bool, err error) {
	pods := r.client.CoreV1().Pods(rec.Namespace)
	pod, err := pods.Get(ctx, rec.Name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		return true, nil
	case err != nil:
		return false, err
	case rec.UID != "" && string(pod.UID) != rec.UID:
		return true, nil
	}
	msg := rec.Message()
	if pod.Annotations[annotations.InboundFallback] != msg {
		// The UID makes the patch fail on a pod replaced meanwhile under the same name.
		patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{
			"uid": pod.UID, "annotations": map[string]string{annotations.InboundFallback: msg},
		}})
		if _, err := pods.Patch(ctx, rec.Name, types.MergePatchType, patch, metav1.PatchOptions{}); apierrors.IsNotFound(err) || apierrors.IsConflict(err) {
			return true, nil
		} else if err != nil {
			return false, fmt.Errorf("annotate the pod: %w", err)
		}
	}
	// One Event per sandbox, named after it: an agent that restarts creates none twice.
	suffix := ".inbound-fallback." + shortID(rec.ContainerID)
	name := rec.Name[:min(len(rec.Name), 253-len(suffix))] + suffix // an Event name is at most 253 characters
	at := metav1.NewTime(rec.Time)
	ev := &corev1.Event{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: rec.Namespace},
		InvolvedObject: corev1.ObjectReference{
			Kind: "Pod", APIVersion: "v1", Namespace: rec.Namespace, Name: rec.Name, UID: pod.UID,
		},
		Reason:              FallbackEventReason,
		Message:             msg,
		Type:                corev1.EventTypeWarning,
		Source:              corev1.EventSource{Component: "detour-node-agent", Host: r.node},
		FirstTimestamp:      at,
		LastTimestamp:       at,
		Count:               1,
		Action:              "SetUpSandbox",
		ReportingController: "detour.dev/node-agent",
		ReportingInstance:   "detour-node-agent-" + r.node,
	}
	if _, err := r.client.CoreV1().Events(rec.Namespace).Create(ctx, ev, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return false, fmt.Errorf("record the event: %w", err)
	}
	return false, nil
}

// shortID is a container ID's first 12 characters, as the runtimes print them.
func shortID(id string) string {
	return id[:min(len(id), 12)]
}

var descFallbackPods = prometheus.NewDesc("detour_cni_inbound_fallback_pods",
	"Sandboxes on this node whose pod asked for inbound connections to its listening ports only (detour.dev/redirect-inbound: listening) and got every inbound connection redirected, because the kernel refused the socket lookup (nft_socket, xt_socket) when detour-cni set them up; they keep it until the pod is recreated.", nil, nil)

// Describe implements prometheus.Collector.
func (r *FallbackReporter) Describe(ch chan<- *prometheus.Desc) { ch <- descFallbackPods }

// Collect implements prometheus.Collector: the records in the state directory, but those whose
// pod the reporter found gone.
func (r *FallbackReporter) Collect(ch chan<- prometheus.Metric) {
	records, err := cniplugin.ReadFallbacks(r.stateDir)
	if err != nil && len(records) == 0 {
		r.log.Warn("cannot read the plugin's inbound fallback records; leaving detour_cni_inbound_fallback_pods out of this scrape", "err", err)
		return
	}
	n := 0
	r.mu.Lock()
	for _, rec := range records {
		if !r.gone[rec.ContainerID] {
			n++
		}
	}
	r.mu.Unlock()
	ch <- prometheus.MustNewConstMetric(descFallbackPods, prometheus.GaugeValue, float64(n))
}
