package clustercheck

import (
	"context"
	"fmt"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/nodeagent"
)

// CiliumConfigMap is the ConfigMap Cilium's Helm chart writes the agent's configuration into,
// in Cilium's release namespace (kube-system by default). Its keys are the agent's flags.
const CiliumConfigMap = "cilium-config"

// ciliumSettings are the agent's settings the primary-cni check reads, from cilium-config.
type ciliumSettings struct {
	where string // namespace/name of the ConfigMap
	// exclusive is cni-exclusive: the agent renames every other CNI configuration file in the
	// conf dir to *.cilium_bak, and watches the directory to do it again.
	exclusive bool
	// conflist is write-cni-conf-when-ready: the file the agent writes ("": none, the agent
	// leaves the CNI configuration to someone else and claims nothing).
	conflist string
	// socketLB: socket-level load balancing (kube-proxy-replacement, or bpf-lb-sock), and
	// hostnsOnly (bpf-lb-sock-hostns-only) keeps it out of the pods' network namespaces.
	kpr, sockLB, hostnsOnly bool
}

// readCilium finds Cilium's ConfigMap in any namespace; nil without one.
func (c *Checker) readCilium(ctx context.Context) (*ciliumSettings, error) {
	list, err := c.client.CoreV1().ConfigMaps("").List(ctx, metav1.ListOptions{FieldSelector: "metadata.name=" + CiliumConfigMap})
	if err != nil {
		return nil, fmt.Errorf("list ConfigMaps named %s: %w", CiliumConfigMap, err)
	}
	var cms []*corev1.ConfigMap
	for i := range list.Items {
		if list.Items[i].Name == CiliumConfigMap {
			cms = append(cms, &list.Items[i])
		}
	}
	if len(cms) == 0 {
		return nil, nil
	}
	// The release namespace of the chart's default first.
	slices.SortFunc(cms, func(a, b *corev1.ConfigMap) int {
		if (a.Namespace == "kube-system") != (b.Namespace == "kube-system") {
			if a.Namespace == "kube-system" {
				return -1
			}
			return 1
		}
		return strings.Compare(a.Namespace, b.Namespace)
	})
	d := cms[0].Data
	on := func(key string) bool { return strings.EqualFold(strings.TrimSpace(d[key]), "true") }
	kpr := strings.ToLower(strings.TrimSpace(d["kube-proxy-replacement"]))
	return &ciliumSettings{
		where:     cms[0].Namespace + "/" + cms[0].Name,
		exclusive: on("cni-exclusive"),
		conflist:  strings.TrimSpace(d["write-cni-conf-when-ready"]),
		// "strict" is kube-proxy-replacement's value before Cilium 1.14 for what "true" is now.
		kpr:        kpr == "true" || kpr == "strict",
		sockLB:     on("bpf-lb-sock"),
		hostnsOnly: on("bpf-lb-sock-hostns-only"),
	}, nil
}

// socketLBInPods reports whether the agent load-balances Services at connect() in the pods'
// network namespaces: kube-proxy replacement turns socket LB on (Cilium's pkg/kpr), and
// bpf-lb-sock-hostns-only keeps it to the host's.
func (s *ciliumSettings) socketLBInPods() bool { return (s.kpr || s.sockLB) && !s.hostnsOnly }

// checkPrimaryCNI reads the primary CNI's settings that break a mesh, where detour knows the
// primary: Cilium's, from its ConfigMap. Socket load balancing in the pods' namespaces
// translates a ClusterIP to a backend at connect(), before detour's redirect: the proxy sees a
// pod IP as the original destination and cannot route by Service. cni.exclusive makes the
// agent take detour's entry out of its conflist each time detour puts it there; detour's
// drop-in, in a subdirectory, it leaves alone.
func (c *Checker) checkPrimaryCNI(ctx context.Context, s *state) Result {
	const name = "primary-cni"
	cil, err := c.readCilium(ctx)
	if err != nil {
		return cannot(name, err)
	}
	if cil == nil {
		return Result{Name: name, Status: OK, Message: fmt.Sprintf("no Cilium configuration (ConfigMap %s) in the cluster: no setting of the primary CNI known to break a mesh", CiliumConfigMap)}
	}
	var problems, fixes, fine []string
	switch {
	case cil.socketLBInPods():
		why := "bpf-lb-sock true"
		if cil.kpr {
			why = "kube-proxy-replacement true, which turns socket load balancing on"
		}
		problems = append(problems, fmt.Sprintf("Cilium load-balances Services at connect() inside the pods (%s, bpf-lb-sock-hostns-only not true): a meshed pod's connection to a ClusterIP reaches its proxy with a backend pod's IP as the original destination, so the proxy cannot route or apply policy by Service", why))
		fixes = append(fixes, `set socketLB.hostNamespaceOnly=true in Cilium's Helm values (bpf-lb-sock-hostns-only: "true" in cilium-config) and restart the agents (kubectl -n kube-system rollout restart daemonset/cilium)`)
	case cil.kpr || cil.sockLB:
		fine = append(fine, "socket load balancing stays in the host's namespace (bpf-lb-sock-hostns-only true)")
	default:
		fine = append(fine, "no socket load balancing")
	}
	if cil.exclusive && cil.conflist != "" {
		entry, dropIn := c.detourForms(s, strings.HasSuffix(cil.conflist, ".conflist"))
		if len(entry) > 0 {
			problems = append(problems, fmt.Sprintf("cni.exclusive is on and detour's configuration is an entry in Cilium's conflist on %s: Cilium writes its conflist again each time the directory changes, taking detour's entry out, and pods start without their redirect between that write and the node agent's", plural(len(entry), "node")+parenList(entry)))
			fixes = append(fixes, "set cni.exclusive=false in Cilium's Helm values, or run a runtime that loads CNI drop-ins (containerd 2.1+, CRI-O 1.33+) with nodeAgent.cniConfigMode auto or drop-in: Cilium leaves detour's drop-in alone")
		} else if dropIn > 0 {
			fine = append(fine, fmt.Sprintf("cni.exclusive is on, and detour's drop-in, which Cilium leaves alone, is the form on every node (%d)", dropIn))
		}
	} else {
		fine = append(fine, "cni.exclusive off")
	}
	if len(problems) > 0 {
		return Result{Name: name, Status: Error, Message: fmt.Sprintf("Cilium (ConfigMap %s): %s", cil.where, strings.Join(problems, "; ")),
			Fix: strings.Join(fixes, "; ")}
	}
	return Result{Name: name, Status: OK, Message: fmt.Sprintf("Cilium (ConfigMap %s): %s", cil.where, strings.Join(fine, "; "))}
}

// detourForms says which nodes the node agent gives detour's entry in the primary's file, as
// its --cni-config-mode and each node's runtime make it choose (nodeagent.ChooseMode), and how
// many get the drop-in. conflist: the primary writes a .conflist (a single-plugin file gets the
// entry).
func (c *Checker) detourForms(s *state, conflist bool) (entry []string, dropIn int) {
	configured := nodeagent.ModeAuto
	if v, ok := s.agentArg("cni-config-mode"); ok {
		if m, err := nodeagent.ParseMode(v); err == nil {
			configured = m
		}
	}
	for _, n := range s.agentNodes() {
		mode, _ := nodeagent.ChooseMode(configured, n.Status.NodeInfo.ContainerRuntimeVersion, conflist, false, false)
		if mode == nodeagent.ModeChainedEntry {
			entry = append(entry, n.Name)
		} else {
			dropIn++
		}
	}
	return entry, dropIn
}
