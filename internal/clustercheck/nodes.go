package clustercheck

import (
	"fmt"
	"slices"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/klog/v2"
)

// runsOn reports whether the DaemonSet's pods belong on node: its nodeSelector matches and
// its tolerations cover the node's NoSchedule and NoExecute taints (the DaemonSet controller
// adds tolerations for the node.kubernetes.io/ conditions itself). Node affinity is not
// evaluated; the chart sets none.
func runsOn(ds *appsv1.DaemonSet, node *corev1.Node) bool {
	spec := ds.Spec.Template.Spec
	if !labels.SelectorFromSet(spec.NodeSelector).Matches(labels.Set(node.Labels)) {
		return false
	}
	for i := range node.Spec.Taints {
		t := &node.Spec.Taints[i]
		if t.Effect == corev1.TaintEffectPreferNoSchedule || strings.HasPrefix(t.Key, "node.kubernetes.io/") {
			continue
		}
		if !slices.ContainsFunc(spec.Tolerations, func(tol corev1.Toleration) bool {
			return tol.ToleratesTaint(klog.Background(), t, false)
		}) {
			return false
		}
	}
	return true
}

// agentNodes are the nodes the node agent should run on (every node when its DaemonSet cannot
// be read).
func (s *state) agentNodes() []*corev1.Node {
	var out []*corev1.Node
	for i := range s.nodes {
		if s.ds == nil || runsOn(s.ds, &s.nodes[i]) {
			out = append(out, &s.nodes[i])
		}
	}
	return out
}

func podReady(p *corev1.Pod) bool {
	if p.DeletionTimestamp != nil {
		return false
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

func (c *Checker) checkNodeAgent(s *state) Result {
	const name = "node-agent"
	switch {
	case apierrors.IsNotFound(s.dsErr):
		return Result{Name: name, Status: Error, Message: fmt.Sprintf("DaemonSet %s/%s not found: no node gets detour-cni, and nodes registered with the startup taint stay tainted", c.namespace, NodeAgentDaemonSet),
			Fix: "reinstall or upgrade detour (helm upgrade --install)"}
	case s.dsErr != nil:
		return cannot(name, fmt.Errorf("get DaemonSet %s/%s: %w", c.namespace, NodeAgentDaemonSet, s.dsErr))
	case s.nodesErr != nil:
		return cannot(name, s.nodesErr)
	case s.agentsErr != nil:
		return cannot(name, s.agentsErr)
	}
	nodes := s.agentNodes()
	if len(nodes) == 0 {
		return Result{Name: name, Status: Warning, Message: fmt.Sprintf("DaemonSet %s runs on no node: %d nodes, none matches its nodeSelector and tolerations", NodeAgentDaemonSet, len(s.nodes)),
			Fix: "check the chart's nodeAgent.nodeSelector and nodeAgent.tolerations"}
	}
	byNode := map[string][]*corev1.Pod{}
	for i := range s.agents {
		p := &s.agents[i]
		byNode[p.Spec.NodeName] = append(byNode[p.Spec.NodeName], p)
	}
	var bad []string
	for _, n := range nodes {
		pods := byNode[n.Name]
		if slices.ContainsFunc(pods, podReady) {
			continue
		}
		if len(pods) == 0 {
			bad = append(bad, n.Name+" (no agent pod)")
		} else {
			bad = append(bad, fmt.Sprintf("%s (pod %s not ready, %s)", n.Name, pods[0].Name, podPhase(pods[0])))
		}
	}
	if len(bad) > 0 {
		return Result{Name: name, Status: Error, Message: fmt.Sprintf("DaemonSet %s is not ready on %d of %s: %s", NodeAgentDaemonSet, len(bad), plural(len(nodes), "node"), list(bad)),
			Fix: fmt.Sprintf("kubectl -n %s get pods -l app.kubernetes.io/component=node-agent -o wide; describe the pod on the node and read its log (kubectl -n %s logs POD -c %s)", c.namespace, c.namespace, InstallCNIContainer)}
	}
	return Result{Name: name, Status: OK, Message: fmt.Sprintf("DaemonSet %s is ready on every node it runs on (%d)", NodeAgentDaemonSet, len(nodes))}
}

func podPhase(p *corev1.Pod) string {
	for _, s := range append(slices.Clone(p.Status.InitContainerStatuses), p.Status.ContainerStatuses...) {
		if w := s.State.Waiting; w != nil && w.Reason != "" {
			return w.Reason
		}
	}
	if p.DeletionTimestamp != nil {
		return "terminating"
	}
	return strings.ToLower(string(p.Status.Phase))
}

// agentArg returns the value of the install-cni container's --flag=value argument.
func (s *state) agentArg(flag string) (string, bool) {
	if s.ds == nil {
		return "", false
	}
	for _, ctr := range s.ds.Spec.Template.Spec.Containers {
		if ctr.Name != InstallCNIContainer {
			continue
		}
		for _, a := range ctr.Args {
			if a == "--"+flag {
				return "true", true
			}
			if v, ok := strings.CutPrefix(a, "--"+flag+"="); ok {
				return v, true
			}
		}
	}
	return "", false
}

func (s *state) startupTaint() string {
	if t, ok := s.agentArg("startup-taint"); ok && t != "" {
		return t
	}
	return StartupTaint
}

func hasTaint(n *corev1.Node, key string) bool {
	return slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == key })
}

// newNodeGrace is how long a node may carry the startup taint before the check calls it an
// error rather than a node agent still starting.
const newNodeGrace = 2 * time.Minute

func (c *Checker) checkStartupTaint(s *state) Result {
	const name = "startup-taint"
	if s.nodesErr != nil {
		return cannot(name, s.nodesErr)
	}
	taint := s.startupTaint()
	var tainted []string
	allNew := true
	for i := range s.nodes {
		n := &s.nodes[i]
		if !hasTaint(n, taint) {
			continue
		}
		age := c.now().Sub(n.CreationTimestamp.Time)
		allNew = allNew && age < newNodeGrace
		tainted = append(tainted, fmt.Sprintf("%s (registered %s ago)", n.Name, age.Round(time.Second)))
	}
	switch {
	case len(tainted) == 0:
		return Result{Name: name, Status: OK, Message: fmt.Sprintf("no node carries the startup taint %s", taint)}
	case allNew:
		return Result{Name: name, Status: Warning, Message: fmt.Sprintf("%s still %s the startup taint %s, registered under %s ago: %s", plural(len(tainted), "node"), verb(len(tainted), "carries", "carry"), taint, newNodeGrace, list(tainted)),
			Fix: "the node agent removes the taint within seconds of the primary CNI's configuration; run the check again in a minute"}
	}
	return Result{Name: name, Status: Error, Message: fmt.Sprintf("%s still %s the startup taint %s: %s; pods that do not tolerate it are not scheduled there", plural(len(tainted), "node"), verb(len(tainted), "carries", "carry"), taint, list(tainted)),
		Fix: fmt.Sprintf("the node agent removes it once detour's CNI config is on the node, which needs the primary CNI's configuration first: kubectl -n %s get pods -o wide --field-selector spec.nodeName=NODE, read the agent's log (-c %s), and run detour check on the node", c.namespace, InstallCNIContainer)}
}

func (c *Checker) checkReadyLabel(s *state) Result {
	const name = "ready-label"
	if s.nodesErr != nil {
		return cannot(name, s.nodesErr)
	}
	taint := s.startupTaint()
	var missing []string
	nodes := s.agentNodes()
	for _, n := range nodes {
		if n.Labels[ReadyLabel] != "true" && !hasTaint(n, taint) { // tainted nodes: see startup-taint
			missing = append(missing, n.Name)
		}
	}
	if len(missing) == 0 {
		return Result{Name: name, Status: OK, Message: fmt.Sprintf("every untainted node the node agent runs on carries %s=true", ReadyLabel)}
	}
	if _, uninstall := s.agentArg("uninstall"); uninstall {
		return Result{Name: name, Status: Warning, Message: fmt.Sprintf("the node agent runs in uninstall mode and removed %s from %s", ReadyLabel, plural(len(missing), "node")),
			Fix: "finish the uninstall with helm uninstall, or set nodeAgent.uninstall=false to keep detour"}
	}
	return Result{Name: name, Status: Error, Message: fmt.Sprintf("%s without the startup taint %s the ready label %s=true: %s; pods there may start before detour's CNI config is in place, and repair does not act there", plural(len(missing), "node"), verb(len(missing), "lacks", "lack"), ReadyLabel, list(missing)),
		Fix: fmt.Sprintf("register nodes with the taint %s:NoSchedule (kubelet --register-with-taints, Karpenter startupTaints) and check the node agent on these nodes: its log says what it waits for (kubectl -n %s logs POD -c %s)", taint, c.namespace, InstallCNIContainer)}
}
