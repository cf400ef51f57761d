package e2e

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/test/e2e/framework"
)

// clusterState is what the bad-input story must leave as it was.
type clusterState struct {
	objects      []string // kind/namespace/name@resourceVersion in the refusals' namespaces
	pods         []string // namespace/name/uid of every pod outside the story's namespaces
	detour       []string // detour's pods: name, uid and every container's restart count
	cniConfig    []string // every file under the CNI config directory, with its content's hash
	pluginErrors []string // detour-cni's log entries with an error
}

func readClusterState(t testing.TB, ctx context.Context, e *framework.Env) clusterState {
	t.Helper()
	var s clusterState
	c := e.Node.Client.CoreV1()
	for _, ns := range []string{badNS, badNamespaceN} {
		pods, err1 := c.Pods(ns).List(ctx, metav1.ListOptions{})
		cms, err2 := c.ConfigMaps(ns).List(ctx, metav1.ListOptions{})
		sas, err3 := c.ServiceAccounts(ns).List(ctx, metav1.ListOptions{})
		secrets, err4 := c.Secrets(ns).List(ctx, metav1.ListOptions{})
		events, err5 := c.Events(ns).List(ctx, metav1.ListOptions{})
		services, err6 := c.Services(ns).List(ctx, metav1.ListOptions{})
		if err := errors.Join(err1, err2, err3, err4, err5, err6); err != nil {
			t.Fatal(err)
		}
		add := func(kind string, m metav1.ObjectMeta) {
			s.objects = append(s.objects, fmt.Sprintf("%s/%s/%s@%s", kind, m.Namespace, m.Name, m.ResourceVersion))
		}
		for _, o := range pods.Items {
			add("pod", o.ObjectMeta)
		}
		for _, o := range cms.Items {
			add("configmap", o.ObjectMeta)
		}
		for _, o := range sas.Items {
			add("serviceaccount", o.ObjectMeta)
		}
		for _, o := range secrets.Items {
			add("secret", o.ObjectMeta)
		}
		for _, o := range events.Items {
			add("event", o.ObjectMeta)
		}
		for _, o := range services.Items {
			add("service", o.ObjectMeta)
		}
	}
	all, err := c.Pods("").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range all.Items {
		switch p.Namespace {
		case badAdmittedNS, badOffNS:
			continue
		case framework.DetourNamespace:
			restarts := []string{}
			for _, st := range append(slices.Clone(p.Status.InitContainerStatuses), p.Status.ContainerStatuses...) {
				restarts = append(restarts, fmt.Sprintf("%s=%d", st.Name, st.RestartCount))
			}
			s.detour = append(s.detour, fmt.Sprintf("%s/%s restarts %s", p.Name, p.UID, strings.Join(restarts, ",")))
		}
		s.pods = append(s.pods, fmt.Sprintf("%s/%s/%s", p.Namespace, p.Name, p.UID))
	}
	err = filepath.WalkDir(e.Node.CNIConfDir, func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		s.cniConfig = append(s.cniConfig, fmt.Sprintf("%s %x", path, sha256.Sum256(data)))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, cmd := range []string{"ADD", "DEL", "CHECK", "STATUS", "GC"} {
		for _, l := range e.PluginLog(t, cmd, "") {
			if l.Error != "" {
				s.pluginErrors = append(s.pluginErrors, fmt.Sprintf("%s %s: %s", l.Command, l.Pod, l.Error))
			}
		}
	}
	for _, l := range [][]string{s.objects, s.pods, s.detour, s.cniConfig, s.pluginErrors} {
		slices.Sort(l)
	}
	return s
}

// compare fails t for every difference between s (before) and after.
func (s clusterState) compare(t testing.TB, after clusterState) {
	t.Helper()
	for _, f := range []struct {
		what          string
		before, after []string
	}{
		{"objects of namespaces " + badNS + " and " + badNamespaceN, s.objects, after.objects},
		{"pods outside the story's namespaces", s.pods, after.pods},
		{"detour's pods and their restarts", s.detour, after.detour},
		{"files of the CNI config directory", s.cniConfig, after.cniConfig},
		{"detour-cni's log entries with an error", s.pluginErrors, after.pluginErrors},
	} {
		if !slices.Equal(f.before, f.after) {
			t.Errorf("%s changed:\nbefore:\n\t%s\nafter:\n\t%s", f.what, strings.Join(f.before, "\n\t"), strings.Join(f.after, "\n\t"))
		}
	}
}
