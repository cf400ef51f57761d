package repair

import (
	"fmt"
	"slices"
	"strings"

	"golang.org/x/time/rate"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/inject"
)

// Flags are the raw settings of `detour repair`; [Flags.Parse] validates them.
type Flags struct {
	NodeName string
	// Rate is the sustained number of actions (deletions and annotations) per second; Burst
	// how many may happen at once.
	Rate  float64
	Burst int
	// RequireCNIReady makes the controller act only while its node carries the ready label
	// (detour.dev/cni-ready=true): a pod recreated earlier could fail again on this node.
	RequireCNIReady bool
	// RecreatingOwners are the controllers, as group/Kind, known to recreate a pod that is
	// deleted: only their pods are deleted. Every other owned pod is annotated like a bare one.
	RecreatingOwners []string
	// DefaultInject and ExcludeNamespaces are the webhook's (its configuration's defaultInject
	// and excludeNamespaces): which pods ask for injection, for the count of those running
	// without it.
	DefaultInject     string
	ExcludeNamespaces []string
	// OwnNamespace is detour's namespace, excluded like the webhook excludes it.
	OwnNamespace string
}

// DefaultRecreatingOwners are the built-in controllers that replace a deleted pod without
// counting it as a failure. Jobs are not among them: a Job counts a deleted pod against its
// backoffLimit, so a Job's pod is deleted only where it could never succeed otherwise
// ([checkRunsAgain]). Neither are Argo Workflows, Tekton, Spark or KubeVirt, whose pods are
// not recreated when deleted.
var DefaultRecreatingOwners = []string{"apps/ReplicaSet", "apps/StatefulSet", "apps/DaemonSet"}

// DefaultFlags returns the defaults.
func DefaultFlags() Flags {
	return Flags{Rate: 1, Burst: 5, RequireCNIReady: true, RecreatingOwners: slices.Clone(DefaultRecreatingOwners),
		DefaultInject: string(annotations.InjectDisabled), ExcludeNamespaces: slices.Clone(inject.DefaultExcludeNamespaces)}
}

// Config is a validated controller configuration; only [Flags.Parse] makes one.
type Config struct {
	NodeName        string
	Rate            rate.Limit
	Burst           int
	RequireCNIReady bool
	// RecreatingOwners holds the group/Kind of the controllers whose pods are deleted.
	RecreatingOwners map[string]bool
	// InjectByDefault: a pod whose detour.dev/inject is set neither on it nor on its namespace
	// asks for injection (the webhook's defaultInject: enabled).
	InjectByDefault bool
	// ExcludeNamespaces are never injected.
	ExcludeNamespaces map[string]bool
}

// Parse validates the flags. Errors name the flag, the value and what a valid one looks like.
func (f Flags) Parse() (Config, error) {
	if errs := validation.IsDNS1123Subdomain(f.NodeName); len(errs) > 0 {
		return Config{}, fmt.Errorf("invalid --node-name %q: it must be this node's name (set --node-name or NODE_NAME from the downward API, fieldRef spec.nodeName): %s", f.NodeName, strings.Join(errs, "; "))
	}
	if !(f.Rate > 0 && f.Rate <= 1000) {
		return Config{}, fmt.Errorf("invalid --rate %v: it must be the number of repairs per second, above 0 and at most 1000, such as 1 or 0.2", f.Rate)
	}
	if f.Burst < 1 || f.Burst > 1000 {
		return Config{}, fmt.Errorf("invalid --burst %d: it must be from 1 to 1000", f.Burst)
	}
	owners := map[string]bool{}
	for _, o := range f.RecreatingOwners {
		group, kind, ok := strings.Cut(o, "/")
		if !ok || kind == "" || strings.Contains(kind, "/") || (group != "" && len(validation.IsDNS1123Subdomain(group)) > 0) {
			return Config{}, fmt.Errorf("invalid --recreating-owners entry %q: it must be an API group and a kind, such as apps/ReplicaSet (/Kind for the core group)", o)
		}
		owners[o] = true
	}
	mode, err := annotations.ParseInjectMode(f.DefaultInject)
	if err != nil {
		return Config{}, fmt.Errorf("invalid --default-inject %q: use the webhook's defaultInject, \"disabled\" or \"enabled\"", f.DefaultInject)
	}
	excluded := map[string]bool{}
	for _, ns := range f.ExcludeNamespaces {
		if errs := validation.IsDNS1123Label(ns); len(errs) > 0 {
			return Config{}, fmt.Errorf("invalid --exclude-namespaces entry %q: it must be a namespace's name: %s", ns, strings.Join(errs, "; "))
		}
		excluded[ns] = true
	}
	if f.OwnNamespace != "" {
		if errs := validation.IsDNS1123Label(f.OwnNamespace); len(errs) > 0 {
			return Config{}, fmt.Errorf("invalid --namespace %q: it must be detour's namespace (default $POD_NAMESPACE, from the downward API, fieldRef metadata.namespace): %s", f.OwnNamespace, strings.Join(errs, "; "))
		}
		excluded[f.OwnNamespace] = true
	}
	return Config{NodeName: f.NodeName, Rate: rate.Limit(f.Rate), Burst: f.Burst, RequireCNIReady: f.RequireCNIReady, RecreatingOwners: owners,
		InjectByDefault: mode == annotations.InjectEnabled, ExcludeNamespaces: excluded}, nil
}
