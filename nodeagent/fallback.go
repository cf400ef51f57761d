package nodeagent

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/cniplugin"
	"github.com/detourmesh/detour/internal/podevent"
)

// FallbackEventReason is the reason of the Warning Event on a pod whose sandbox got every
// inbound connection redirected because the kernel refused the socket lookup.
const FallbackEventReason = "DetourInboundFallback"

// FallbackReporter tells people about the node's sandboxes that got the inbound fallback, which
// detour-cni records in its state directory (cniplugin.FallbackRecord) and takes away at DEL:
// once per sandbox, a Warning Event on the pod and the annotation
// [annotations.InboundFallback] on it (the pod's own detour.dev/redirect-inbound still says
// listening); and detour_cni_inbound_fallback_pods, as the last pass counted.
type FallbackReporter struct {
	client   kubernetes.Interface
	stateDir string
	node     string
	log      *slog.Logger

	mu sync.Mutex
	// told holds the container IDs of the records told about, true for those whose pod is
	// gone (a record whose DEL was lost, not counted as a running pod).
	told map[string]bool
	// pods is the number of records of running pods the last pass found; -1 before a pass, or
	// when it could read no record.
	pods int
}

// NewFallbackReporter returns the reporter for the plugin's state directory stateDir on node.
func NewFallbackReporter(client kubernetes.Interface, stateDir, node string, log *slog.Logger) *FallbackReporter {
	return &FallbackReporter{client: client, stateDir: stateDir, node: node, log: log, told: map[string]bool{}, pods: -1}
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
	pods := 0
	for _, rec := range records {
		present[rec.ContainerID] = true
		r.mu.Lock()
		gone, told := r.told[rec.ContainerID]
		r.mu.Unlock()
		if !told {
			var err error
			if gone, err = r.tell(ctx, rec); err != nil {
				r.log.Warn("cannot report a pod's inbound fallback; trying again (the agent's service account needs get and patch on pods, create on events)",
					"pod", rec.Namespace+"/"+rec.Name, "err", err)
			} else {
				r.mu.Lock()
				r.told[rec.ContainerID] = gone
				r.mu.Unlock()
				if !gone {
					r.log.Warn("a pod got every inbound connection redirected: the kernel refused the socket lookup", "pod", rec.Namespace+"/"+rec.Name, "refusal", rec.Refusal)
				}
			}
		}
		if !gone {
			pods++
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for id := range r.told {
		if !present[id] {
			delete(r.told, id)
		}
	}
	r.pods = pods
	if err != nil && len(records) == 0 {
		r.pods = -1
	}
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
	src := podevent.Source{Component: "detour-node-agent", Controller: "detour.dev/node-agent", Node: r.node}
	ev := podevent.Warning(src, pod, rec.Time, FallbackEventReason, "SetUpSandbox", msg, "inbound-fallback."+shortID(rec.ContainerID))
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

// Collect implements prometheus.Collector: the records of running pods the last pass found
// (none before the first pass, or when it could read no record).
func (r *FallbackReporter) Collect(ch chan<- prometheus.Metric) {
	r.mu.Lock()
	n := r.pods
	r.mu.Unlock()
	if n >= 0 {
		ch <- prometheus.MustNewConstMetric(descFallbackPods, prometheus.GaugeValue, float64(n))
	}
}
