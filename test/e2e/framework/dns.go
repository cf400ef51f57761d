package framework

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/detourmesh/detour/internal/image"
)

// The cluster's DNS is CoreDNS (hack/tools/coredns, built by hack/test-binaries.sh) deployed as
// kubeadm deploys it: a Deployment in kube-system labelled k8s-app=kube-dns behind the kube-dns
// Service at the kubelets' clusterDNS address, answering for cluster.local from the API.

// DNSImageRef is the reference of the CoreDNS image DNSImage makes.
const DNSImageRef = "detour.test/coredns:1"

// DNSImage builds an image holding binDir's coredns as its entrypoint.
func DNSImage(binDir string) (v1.Image, error) {
	img, err := image.Build(image.Spec{
		Ref:        DNSImageRef,
		Files:      []image.File{{Path: "/coredns", Source: filepath.Join(binDir, "coredns"), Mode: 0o755}},
		Entrypoint: []string{"/coredns"},
	})
	if err != nil {
		return nil, fmt.Errorf("build the CoreDNS image: %w", err)
	}
	return img, nil
}

// deployDNS applies CoreDNS's objects with the image ref and waits until it answers (its
// Deployment available).
func (n *Node) deployDNS(ctx context.Context, ref string) error {
	path := filepath.Join(n.Dir, "coredns.yaml")
	if err := os.WriteFile(path, []byte(dnsManifest(ref, n.dnsIP())), 0o644); err != nil {
		return err
	}
	if _, stderr, err := n.Kubectl(ctx, "apply", "-f", path); err != nil {
		return fmt.Errorf("apply CoreDNS's objects: %w\n%s", err, stderr)
	}
	var last string
	err := wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		d, err := n.Client.AppsV1().Deployments("kube-system").Get(ctx, "coredns", metav1.GetOptions{})
		if err != nil {
			last = err.Error()
			return false, nil
		}
		last = fmt.Sprintf("%d of %d replicas available", d.Status.AvailableReplicas, *d.Spec.Replicas)
		return d.Status.AvailableReplicas == *d.Spec.Replicas, nil
	})
	if err != nil {
		pods, _, _ := n.Kubectl(ctx, "get", "pods", "-n", "kube-system", "-l", "k8s-app=kube-dns", "-o", "wide")
		return fmt.Errorf("CoreDNS is not available (%s): %w\n%s", last, err, pods)
	}
	return nil
}

// dnsIP is the cluster DNS's address (the kubelets' clusterDNS): kube-dns is a Service of the
// primary family, as kubeadm makes it on a dual-stack cluster; CoreDNS answers A and AAAA
// queries alike.
func (n *Node) dnsIP() netip.Addr { return n.Families().list()[0].dnsIP }

// dnsManifest is CoreDNS's objects: kubeadm's, with a Corefile that forwards nothing (the
// e2e network reaches nothing outside the cluster) and a toleration of detour's startup taint
// (kube-system is never injected, so its DNS need not wait for detour on a node).
func dnsManifest(ref string, ip netip.Addr) string {
	return strings.NewReplacer("IMAGE", ref, "DNS_IP", ip.String(), "STARTUP_TAINT", StartupTaint).Replace(`apiVersion: v1
kind: ServiceAccount
metadata: {name: coredns, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "system:coredns"}
rules:
  - apiGroups: [""]
    resources: [services, pods, namespaces]
    verbs: [list, watch]
  - apiGroups: [discovery.k8s.io]
    resources: [endpointslices]
    verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "system:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:coredns"}
subjects:
  - {kind: ServiceAccount, name: coredns, namespace: kube-system}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: coredns, namespace: kube-system}
data:
  Corefile: |
    .:53 {
        errors
        health {
            lameduck 5s
        }
        ready
        kubernetes cluster.local in-addr.arpa ip6.arpa {
            pods insecure
            fallthrough in-addr.arpa ip6.arpa
            ttl 30
        }
        prometheus :9153
        cache 30
        reload
        loadbalance
    }
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: coredns
  namespace: kube-system
  labels: {k8s-app: kube-dns}
spec:
  replicas: 1
  selector:
    matchLabels: {k8s-app: kube-dns}
  template:
    metadata:
      labels: {k8s-app: kube-dns}
    spec:
      serviceAccountName: coredns
      priorityClassName: system-cluster-critical
      dnsPolicy: Default
      tolerations:
        - {key: CriticalAddonsOnly, operator: Exists}
        - {key: node-role.kubernetes.io/control-plane, effect: NoSchedule}
        - {key: STARTUP_TAINT, operator: Exists, effect: NoSchedule}
      containers:
        - name: coredns
          image: IMAGE
          imagePullPolicy: IfNotPresent
          args: ["-conf", "/etc/coredns/Corefile"]
          ports:
            - {name: dns, containerPort: 53, protocol: UDP}
            - {name: dns-tcp, containerPort: 53, protocol: TCP}
            - {name: metrics, containerPort: 9153, protocol: TCP}
          readinessProbe:
            httpGet: {path: /ready, port: 8181}
            periodSeconds: 1
          livenessProbe:
            httpGet: {path: /health, port: 8080}
            initialDelaySeconds: 60
          resources:
            requests: {cpu: 10m, memory: 32Mi}
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities: {add: [NET_BIND_SERVICE], drop: [ALL]}
          volumeMounts:
            - {name: config, mountPath: /etc/coredns, readOnly: true}
      volumes:
        - name: config
          configMap:
            name: coredns
            items: [{key: Corefile, path: Corefile}]
---
apiVersion: v1
kind: Service
metadata:
  name: kube-dns
  namespace: kube-system
  labels: {k8s-app: kube-dns, kubernetes.io/name: CoreDNS}
spec:
  clusterIP: DNS_IP
  selector: {k8s-app: kube-dns}
  ports:
    - {name: dns, port: 53, protocol: UDP}
    - {name: dns-tcp, port: 53, protocol: TCP}
    - {name: metrics, port: 9153, protocol: TCP}
`)
}
