package nodeagent_test

import (
	"path/filepath"
	"slices"
	"sync/atomic"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/utils/ptr"

	"github.com/detourmesh/detour/nodeagent"
)

// helm uninstall deletes the DaemonSet, then at once its RBAC and service account, while the
// pods are still terminating: an agent that could read its DaemonSet before and may no longer
// at SIGTERM is being uninstalled. One that could never read it keeps everything (a missing
// Role must not turn every rollout into an uninstall). A refused token, with no plugin token
// to ask with (no WithTokenClient), counts as the uninstall.
func TestUninstallWhenDaemonSetRBACIsGone(t *testing.T) {
	forbidden := apierrors.NewForbidden(schema.GroupResource{Group: "apps", Resource: "daemonsets"}, "detour-node-agent", nil)
	for _, tc := range []struct {
		name            string
		refusal         error
		readableAtStart bool
		uninstall       bool
	}{
		{"readable before", forbidden, true, true},
		{"never readable", forbidden, false, false},
		{"token refused, none to ask with", apierrors.NewUnauthorized("token refused"), true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ds := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Name: "detour-node-agent", Namespace: "detour-system", UID: "ds-1"}}
			pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "agent-1", Namespace: "detour-system", OwnerReferences: []metav1.OwnerReference{{
				APIVersion: "apps/v1", Kind: "DaemonSet", Name: ds.Name, UID: ds.UID, Controller: ptr.To(true)}}}}
			client := fake.NewClientset(ds, pod)
			var refused atomic.Bool
			refused.Store(!tc.readableAtStart)
			client.PrependReactor("get", "daemonsets", func(k8stesting.Action) (bool, runtime.Object, error) {
				if refused.Load() {
					return true, nil, tc.refusal
				}
				return false, nil, nil
			})
			e := newEnv(t)
			primary := filepath.Join(e.confDir, "10-calico.conflist")
			writeFile(t, primary, calico)
			a := e.agent(t, nodeagent.WithNodeClient(client), nodeagent.WithOwnPod("detour-system", "agent-1"))
			stop := run(t, a)
			// The DaemonSet is resolved before the first reconcile puts the entry in place.
			eventually(t, "the entry is in place", func() bool { return slices.Contains(pluginTypes(t, readFile(t, primary)), "detour-cni") })
			refused.Store(true)
			if err := stop(); err != nil {
				t.Fatal(err)
			}
			if entry := slices.Contains(pluginTypes(t, readFile(t, primary)), "detour-cni"); entry == tc.uninstall {
				t.Errorf("entry in place after SIGTERM: %v; want uninstalled %v", entry, tc.uninstall)
			}
		})
	}
}
