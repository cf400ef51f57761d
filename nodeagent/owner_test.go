package nodeagent_test

import (
	"errors"
	"path/filepath"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes"
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

// At SIGTERM, a refused own token is asked about with the plugin's token: only a 401 for that
// one too is an uninstall. Any other answer of the API server's (403, 404 on a server without
// SelfSubjectReview) authenticated the token, so only the agent's pod is gone; no answer at all
// leaves everything in place too.
func TestUninstallWhenOwnTokenRefusedAskPlugin(t *testing.T) {
	ssr := schema.GroupResource{Group: "authentication.k8s.io", Resource: "selfsubjectreviews"}
	for _, tc := range []struct {
		name      string
		answer    error // of the SelfSubjectReview with the plugin's token
		uninstall bool
	}{
		{"plugin's token accepted", nil, false},
		{"plugin's token refused too", apierrors.NewUnauthorized("token refused"), true},
		{"plugin's token may not review itself", apierrors.NewForbidden(ssr, "", nil), false},
		{"no SelfSubjectReview API", apierrors.NewNotFound(ssr, ""), false},
		{"no answer", errors.New("connection reset by peer"), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ds := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Name: "detour-node-agent", Namespace: "detour-system", UID: "ds-1"}}
			pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "agent-1", Namespace: "detour-system", OwnerReferences: []metav1.OwnerReference{{
				APIVersion: "apps/v1", Kind: "DaemonSet", Name: ds.Name, UID: ds.UID, Controller: ptr.To(true)}}}}
			client := fake.NewClientset(ds, pod)
			(&tokenAPI{clock: time.Now}).install(client)
			var refused atomic.Bool
			client.PrependReactor("get", "daemonsets", func(k8stesting.Action) (bool, runtime.Object, error) {
				if refused.Load() {
					return true, nil, apierrors.NewUnauthorized("token refused")
				}
				return false, nil, nil
			})
			var asked []string
			pluginClient := func(token string) (kubernetes.Interface, error) {
				c := fake.NewClientset()
				c.PrependReactor("create", "selfsubjectreviews", func(k8stesting.Action) (bool, runtime.Object, error) {
					asked = append(asked, token)
					return true, &authenticationv1.SelfSubjectReview{}, tc.answer
				})
				return c, nil
			}
			e := pluginSAEnv(t)
			primary := filepath.Join(e.confDir, "10-calico.conflist")
			writeFile(t, primary, calico)
			a := e.agent(t, nodeagent.WithNodeClient(client), nodeagent.WithOwnPod("detour-system", "agent-1"), nodeagent.WithTokenClient(pluginClient))
			stop := run(t, a)
			eventually(t, "the agent is ready", func() bool { ok, _ := a.Ready(); return ok })
			refused.Store(true)
			if err := stop(); err != nil {
				t.Fatal(err)
			}
			if len(asked) != 1 || asked[0] != "plugin-token-1" {
				t.Errorf("asked the API server with tokens %q, want once with the plugin's", asked)
			}
			if entry := slices.Contains(pluginTypes(t, readFile(t, primary)), "detour-cni"); entry == tc.uninstall {
				t.Errorf("entry in place after SIGTERM: %v; want uninstalled %v", entry, tc.uninstall)
			}
		})
	}
}
