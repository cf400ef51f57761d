package framework

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
)

// The flannel cluster: flannel, not a conflist of the test's, is the primary CNI, installed as
// its users install it (kube-flannel.yml): a DaemonSet whose init containers copy its CNI
// plugin into the node's plugin directory and write its conflist, and whose flanneld, with the
// kube subnet manager, takes the node's pod range from the Node (the controller-manager
// allocates it) and routes between the nodes. The backend is vxlan: the nodes share one L2
// segment, where host-gw would work too, but vxlan is flannel's default and what most of its
// users run, and it puts an encapsulation under the pods' traffic that the bridge cluster does
// not have.

const (
	// FlannelNetwork is the name of flannel's network (kube-flannel.yml's conflist's "name").
	FlannelNetwork = "cbr0"
	// FlannelNamespace is where kube-flannel.yml installs it.
	FlannelNamespace = "kube-flannel"
	// flannelConflist is the file its install-cni init container writes.
	flannelConflist = "10-flannel.conflist"
)

// flannelDir holds flanneld's subnet file (its /run/flannel) and the plugin's state; it is
// under the cni directory that every node mounts its own over (cluster.go).
func (n *Node) flannelDir() string { return n.root().ownFlannelDir() }

// ownFlannelDir is where this node's flannelDir is on the host's side of its mounts.
func (n *Node) ownFlannelDir() string { return filepath.Join(n.Dir, "cni", "flannel") }

// FlannelSubnetFile is the subnet file flanneld writes on this node.
func (n *Node) FlannelSubnetFile() string { return filepath.Join(n.ownFlannelDir(), "subnet.env") }

// deployFlannel applies flannel's objects with image; its DaemonSet's pod on each node writes
// the node's conflist, and the node becomes Ready then.
func (n *Node) deployFlannel(ctx context.Context, image string) error {
	path := filepath.Join(n.Dir, "flannel.yaml")
	if err := os.WriteFile(path, []byte(n.flannelManifest(image)), 0o644); err != nil {
		return err
	}
	if _, stderr, err := n.Kubectl(ctx, "apply", "-f", path); err != nil {
		return fmt.Errorf("apply flannel's objects: %w\n%s", err, stderr)
	}
	return nil
}

// waitFlannel waits until flanneld runs on the node: it writes its subnet file once it holds
// the node's lease and its vxlan device is up. The node is Ready before (the conflist comes from
// an init container), and a pod started in between fails its sandbox until then, as on any
// flannel node.
func (n *Node) waitFlannel(ctx context.Context) error {
	path := n.FlannelSubnetFile()
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(context.Context) (bool, error) {
		return fileExists(path), nil
	})
	if err != nil {
		return fmt.Errorf("flanneld wrote no subnet file %s on %s: %w", path, n.Name, err)
	}
	return nil
}

// takePodCIDR waits until the controller-manager allocated the node's pod range and sets
// PodSubnet to it.
func (n *Node) takePodCIDR(ctx context.Context) error {
	var cidr string
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		node, err := n.Client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		cidr = node.Spec.PodCIDR
		return cidr != "", nil
	})
	if err != nil {
		return fmt.Errorf("the controller-manager allocated no pod range to %s: %w", n.Name, err)
	}
	p, err := netip.ParsePrefix(cidr)
	if err != nil {
		return fmt.Errorf("%s's pod range %q: %w", n.Name, cidr, err)
	}
	n.PodSubnet, n.fams[0].pods = p, p
	return nil
}

// flannelManifest is kube-flannel.yml (v0.28) with the node's paths: the hostPaths are the
// control-plane node's, which every node mounts its own directories over. flanneld reaches
// the API server at its address, not through the kubernetes Service, whose rules kube-proxy
// writes only once the node is Ready — which it is once flannel is (Cilium's k8sServiceHost
// does the same).
func (n *Node) flannelManifest(image string) string {
	r := n.root()
	run := r.flannelDir()
	return fmt.Sprintf(`apiVersion: v1
kind: Namespace
metadata:
  name: %[1]s
  labels: {k8s-app: flannel, pod-security.kubernetes.io/enforce: privileged}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: flannel, namespace: %[1]s}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: flannel}
rules:
  - apiGroups: [""]
    resources: [pods]
    verbs: [get]
  - apiGroups: [""]
    resources: [nodes]
    verbs: [get, list, watch]
  - apiGroups: [""]
    resources: [nodes/status]
    verbs: [patch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: flannel}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: flannel}
subjects:
  - {kind: ServiceAccount, name: flannel, namespace: %[1]s}
---
apiVersion: v1
kind: ConfigMap
metadata:
  name: kube-flannel-cfg
  namespace: %[1]s
  labels: {tier: node, app: flannel}
data:
  cni-conf.json: |
    {
      "name": %[2]q,
      "cniVersion": "0.3.1",
      "plugins": [
        {
          "type": "flannel",
          "subnetFile": %[3]q,
          "dataDir": %[4]q,
          "delegate": {"hairpinMode": true, "isDefaultGateway": true},
          "ipam": {"type": "host-local", "dataDir": %[5]q}
        },
        {"type": "portmap", "capabilities": {"portMappings": true}}
      ]
    }
  net-conf.json: |
    {"Network": %[6]q, "Backend": {"Type": "vxlan"}}
---
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: kube-flannel-ds
  namespace: %[1]s
  labels: {tier: node, app: flannel}
spec:
  selector:
    matchLabels: {app: flannel}
  template:
    metadata:
      labels: {tier: node, app: flannel}
    spec:
      hostNetwork: true
      priorityClassName: system-node-critical
      tolerations:
        - {operator: Exists, effect: NoSchedule}
      serviceAccountName: flannel
      initContainers:
        - name: install-cni-plugin
          image: %[7]s
          imagePullPolicy: IfNotPresent
          command: [cp]
          args: [-f, /flannel, /opt/cni/bin/flannel]
          volumeMounts:
            - {name: cni-plugin, mountPath: /opt/cni/bin}
        - name: install-cni
          image: %[7]s
          imagePullPolicy: IfNotPresent
          command: [cp]
          args: [-f, /etc/kube-flannel/cni-conf.json, /etc/cni/net.d/%[8]s]
          volumeMounts:
            - {name: cni, mountPath: /etc/cni/net.d}
            - {name: flannel-cfg, mountPath: /etc/kube-flannel/}
      containers:
        - name: kube-flannel
          image: %[7]s
          imagePullPolicy: IfNotPresent
          command: [/opt/bin/flanneld]
          args: [--ip-masq, --kube-subnet-mgr, --iface=node0]
          resources:
            requests: {cpu: 100m, memory: 50Mi}
          securityContext:
            privileged: false
            capabilities: {add: [NET_ADMIN, NET_RAW]}
          env:
            - name: POD_NAME
              valueFrom: {fieldRef: {fieldPath: metadata.name}}
            - name: POD_NAMESPACE
              valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
            - {name: EVENT_QUEUE_DEPTH, value: "5000"}
            - {name: KUBERNETES_SERVICE_HOST, value: %[9]q}
            - {name: KUBERNETES_SERVICE_PORT, value: "%[10]d"}
          volumeMounts:
            - {name: run, mountPath: /run/flannel}
            - {name: flannel-cfg, mountPath: /etc/kube-flannel/}
      volumes:
        - name: run
          hostPath: {path: %[11]s}
        - name: cni-plugin
          hostPath: {path: %[12]s}
        - name: cni
          hostPath: {path: %[13]s}
        - name: flannel-cfg
          configMap: {name: kube-flannel-cfg}
`, FlannelNamespace, FlannelNetwork, filepath.Join(run, "subnet.env"), filepath.Join(run, "data"),
		filepath.Join(r.Dir, "cni", "ipam"), ClusterCIDR, image, flannelConflist, NodeIP, APIPort,
		run, r.CNIBinDir, r.CNIConfDir)
}
