package scale

import (
	"context"
	"fmt"

	"golang.org/x/sync/errgroup"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/annotations"
)

// NodeName is the name of simulated node i.
func NodeName(i int) string { return fmt.Sprintf("scale-%04d", i) }

// CreateNodes registers simulated nodes from..to-1 as a kubelet on containerd 2.4 would, with
// detour's startup taint (as docs/operations.md has the kubelet register them), each with a pod
// range of its own (KWOK gives its pods their addresses from it). KWOK makes them Ready.
func (c *Cluster) CreateNodes(ctx context.Context, from, to int) error {
	g, ctx := errgroup.WithContext(ctx)
	g.SetLimit(16)
	for i := from; i < to; i++ {
		g.Go(func() error {
			node := &corev1.Node{
				ObjectMeta: metav1.ObjectMeta{
					Name:        NodeName(i),
					Annotations: map[string]string{"kwok.x-k8s.io/node": "fake"},
					Labels: map[string]string{
						"kubernetes.io/hostname": NodeName(i), "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
						"type": "kwok",
					},
				},
				Spec: corev1.NodeSpec{
					PodCIDR:  fmt.Sprintf("10.%d.%d.0/24", 64+i/256, i%256),
					PodCIDRs: []string{fmt.Sprintf("10.%d.%d.0/24", 64+i/256, i%256)},
					Taints:   []corev1.Taint{{Key: annotations.CNINotReadyTaint, Effect: corev1.TaintEffectNoSchedule}},
				},
				Status: corev1.NodeStatus{
					NodeInfo: corev1.NodeSystemInfo{
						ContainerRuntimeVersion: "containerd://2.4.2", KubeletVersion: "v1.37.2",
						OperatingSystem: "linux", Architecture: "amd64", BootID: fmt.Sprintf("boot-%d", i),
					},
					Allocatable: corev1.ResourceList{"pods": resourceQuantity("110"), "cpu": resourceQuantity("32"), "memory": resourceQuantity("128Gi")},
					Capacity:    corev1.ResourceList{"pods": resourceQuantity("110"), "cpu": resourceQuantity("32"), "memory": resourceQuantity("128Gi")},
				},
			}
			if _, err := c.Client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
				return fmt.Errorf("create node %s: %w", node.Name, err)
			}
			return nil
		})
	}
	return g.Wait()
}

func resourceQuantity(s string) resource.Quantity { return resource.MustParse(s) }
