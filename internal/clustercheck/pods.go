package clustercheck

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/repair"
	"github.com/detourmesh/detour/validator"
)

func (c *Checker) checkNamespaces(s *state) Result {
	const name = "opted-in-namespaces"
	if s.nsErr != nil {
		return cannot(name, s.nsErr)
	}
	in := s.optedIn
	pods := "injected pods not counted: " + fmt.Sprint(s.podsErr)
	if s.podsErr == nil {
		pods = plural(s.injected, "injected pod")
	}
	if len(in) == 0 && s.injected == 0 {
		return Result{Name: name, Status: Warning, Message: fmt.Sprintf("no namespace opted in (annotation %s=enabled) and %s", annotations.Inject, pods),
			Fix: fmt.Sprintf("kubectl annotate namespace NAME %s=enabled, then restart its workloads (kubectl -n NAME rollout restart deployment)", annotations.Inject)}
	}
	how := ""
	if s.meshWide {
		how = fmt.Sprintf(" (the webhook's defaultInject is enabled: every namespace but the excluded ones and those annotated %s=disabled)", annotations.Inject)
	}
	return Result{Name: name, Status: OK, Message: fmt.Sprintf("%s opted in%s%s; %s", plural(len(in), "namespace"), parenList(in), how, pods)}
}

// uninjectedCandidate reports whether p, a pod of an opted-in namespace without detour's
// injected marker, should have been injected: it is not being deleted, it does not opt out
// (detour.dev/inject: disabled, read with the webhook's parser), and it is not one the webhook
// never injects ([repair.NeverInjected]). Finished pods count: a Job's pod that ran without the
// mesh is news.
func uninjectedCandidate(p *corev1.Pod) bool {
	mode, err := annotations.ParseInjectMode(p.Annotations[annotations.Inject])
	return p.DeletionTimestamp == nil && !(err == nil && mode == annotations.InjectDisabled) && !repair.NeverInjected(p)
}

// checkUninjected names the pods of opted-in namespaces that run without detour: admitted
// while the API server could not call the webhook under failurePolicy Ignore, or created
// before their namespace opted in.
func (c *Checker) checkUninjected(s *state) Result {
	const name = "uninjected-pods"
	switch {
	case s.podsErr != nil:
		return cannot(name, s.podsErr)
	case s.nsErr != nil:
		return cannot(name, s.nsErr)
	case len(s.uninjected) == 0:
		return Result{Name: name, Status: OK, Message: "every pod of an opted-in namespace is injected"}
	}
	var live, finished []string
	for _, p := range s.uninjected {
		if p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
			finished = append(finished, p.Namespace+"/"+p.Name)
		} else {
			live = append(live, p.Namespace+"/"+p.Name)
		}
	}
	slices.Sort(live)
	slices.Sort(finished)
	var parts []string
	if len(live) > 0 {
		parts = append(parts, fmt.Sprintf("%s of opted-in namespaces %s without detour: %s", plural(len(live), "pod"), verb(len(live), "runs", "run"), list(live)))
	}
	if len(finished) > 0 {
		parts = append(parts, fmt.Sprintf("%s of opted-in namespaces ran without detour: %s", plural(len(finished), "finished pod"), list(finished)))
	}
	return Result{Name: name, Status: Warning, Message: strings.Join(parts, "; "), Objects: slices.Concat(live, finished),
		Fix: "they were admitted while the API server could not call the webhook (failurePolicy Ignore: see webhook-endpoints and webhook-admission), or created before their namespace opted in; " +
			"once the webhook answers, recreate the running ones (kubectl -n NS rollout restart deployment NAME, or delete a bare pod and create it again); " +
			"finished ones (a Job's) have nothing to recreate: they ran outside the mesh, so look at what they did, then delete them"}
}

// validatorExit returns the exit code of pod's validator check when its last run failed and has
// not passed since (validator.LastFailure): a check that finds no redirect spends its whole
// timeout running, so a run under way does not hide the last one's result.
func validatorExit(p *corev1.Pod) (int32, bool) {
	code, _, failed := validator.LastFailure(p)
	return code, failed
}

var exitMeanings = map[int32]string{
	validator.ExitNoRedirect: "no redirect",
	validator.ExitPortInUse:  "proxy port in use", // the validator container's port: the proxy's outbound port
	validator.ExitUsage:      "bad arguments",
	validator.ExitFailure:    "failure",
	validator.ExitNoRoute:    "nothing to check with",
}

// exitMeaning is what code means for p's check: exit 43 at the proxy's start is the check port,
// not the proxy's.
func exitMeaning(p *corev1.Pod, code int32) string {
	if code == validator.ExitPortInUse && validator.CheckContainer(p) == annotations.ProxyContainer {
		return "check port in use"
	}
	if m := exitMeanings[code]; m != "" {
		return m
	}
	return "unknown code"
}

// maxQuoted bounds how many pods' own messages a fix quotes.
const maxQuoted = 3

func (c *Checker) checkValidators(s *state) Result {
	const name = "validator"
	if s.podsErr != nil {
		return cannot(name, s.podsErr)
	}
	var failed []string
	noRedirect, bare := 0, 0
	// checkPort are the pods whose check at the proxy's start found its port taken (exit 43);
	// said are their checks' own messages, which name the socket and its owner.
	var checkPort, said []string
	for i := range s.failing {
		p := &s.failing[i]
		code, _ := validatorExit(p)
		meaning := exitMeaning(p, code)
		where := ""
		if p.Spec.NodeName != "" {
			where = " on " + p.Spec.NodeName
		}
		failed = append(failed, fmt.Sprintf("%s/%s%s (exit %d, %s)", p.Namespace, p.Name, where, code, meaning))
		switch {
		case code == validator.ExitNoRedirect:
			noRedirect++
		case code == validator.ExitPortInUse && validator.CheckContainer(p) == annotations.ProxyContainer:
			checkPort = append(checkPort, p.Namespace+"/"+p.Name)
			if msg := validator.FailureMessage(p); msg != "" && len(said) < maxQuoted {
				said = append(said, fmt.Sprintf("%s/%s: %q", p.Namespace, p.Name, msg))
			}
		}
		if _, ok := p.Annotations[repair.RecreateAnnotation]; ok {
			bare++
		}
	}
	if len(failed) == 0 {
		return Result{Name: name, Status: OK, Message: fmt.Sprintf("no injected pod's validator is failing (%s)", plural(s.injected, "injected pod"))}
	}
	var fix []string
	if noRedirect > 0 {
		fix = append(fix, fmt.Sprintf("exit %d: the pod's network namespace has no redirect because it started before detour's CNI config was on its node; the repair controller deletes controller-owned pods once the node carries %s=true, and annotates bare pods (%s) for you to delete and recreate", validator.ExitNoRedirect, ReadyLabel, repair.RecreateAnnotation))
	}
	if len(checkPort) > 0 {
		f := fmt.Sprintf("exit %d at the proxy's start (%s): a container of the pod listens on the check port (the pod's %s, the webhook's validator.checkPort), where the check listens when the proxy restarts; "+
			"the proxy crash-loops until the pod is recreated: move its port or set validator.checkPort to a port no container uses, then recreate the pod (kubectl rollout restart); the repair controller does not recreate it (Event %s)",
			validator.ExitPortInUse, list(checkPort), annotations.ValidatorCheckPort, repair.CheckPortEventReason)
		if len(said) > 0 {
			f += " — the check says " + strings.Join(said, "; ")
		}
		fix = append(fix, f)
	}
	if noRedirect+len(checkPort) < len(failed) {
		fix = append(fix, fmt.Sprintf("other codes: kubectl -n NS logs POD -c %s (or -c %s where the check runs in the proxy's start) says what failed (docs/validator.md)", annotations.ValidatorContainer, annotations.ProxyContainer))
	}
	if bare > 0 {
		fix = append(fix, fmt.Sprintf("%s %s: kubectl delete pod, then create it again", plural(bare, "bare pod"), verb(bare, "waits", "wait")))
	}
	return Result{Name: name, Status: Error, Message: fmt.Sprintf("the validator of %s failed: %s", plural(len(failed), "injected pod"), list(failed)), Fix: strings.Join(fix, "; ")}
}

func eventTime(e *corev1.Event) time.Time {
	for _, t := range []time.Time{e.LastTimestamp.Time, e.EventTime.Time, e.FirstTimestamp.Time, e.CreationTimestamp.Time} {
		if !t.IsZero() {
			return t
		}
	}
	return time.Time{}
}

func (c *Checker) checkRepair(ctx context.Context) Result {
	const name = "repair"
	evs, err := c.client.CoreV1().Events("").List(ctx, metav1.ListOptions{FieldSelector: "reason=" + repair.EventReason})
	if err != nil {
		return cannot(name, fmt.Errorf("list Events: %w", err))
	}
	now := c.now()
	var recent []*corev1.Event
	for i := range evs.Items {
		e := &evs.Items[i]
		if e.Reason == repair.EventReason && now.Sub(eventTime(e)) <= c.since {
			recent = append(recent, e)
		}
	}
	if len(recent) == 0 {
		return Result{Name: name, Status: OK, Message: fmt.Sprintf("the repair controller recreated or annotated no pod in the last %s", c.since)}
	}
	slices.SortFunc(recent, func(a, b *corev1.Event) int { return eventTime(b).Compare(eventTime(a)) })
	deleted, annotated := 0, 0
	var items []string
	nodes := map[string]int{}
	for _, e := range recent {
		what := "deleted"
		if e.Action == "Annotate" {
			what = "annotated"
			annotated++
		} else {
			deleted++
		}
		nodes[e.Source.Host]++
		items = append(items, fmt.Sprintf("%s/%s on %s (%s %s ago)", e.InvolvedObject.Namespace, e.InvolvedObject.Name, e.Source.Host, what, now.Sub(eventTime(e)).Round(time.Second)))
	}
	return Result{Name: name, Status: Warning,
		Message: fmt.Sprintf("in the last %s the repair controller %s: %s", c.since, actions(deleted, annotated), list(items)),
		Fix:     fmt.Sprintf("these pods started before detour's CNI config was on their node (%s); repairs that repeat on one node mean its node agent does not keep the config in place: check the agent there and run detour check on the node (kubectl get events -A --field-selector reason=%s)", plural(len(nodes), "node"), repair.EventReason)}
}

func (c *Checker) checkVersionSkew(s *state) Result {
	const name = "version-skew"
	images := map[string][]string{} // image → components
	add := func(component, image string) {
		if image != "" && !slices.Contains(images[image], component) {
			images[image] = append(images[image], component)
		}
	}
	if s.deploy != nil {
		for _, ctr := range s.deploy.Spec.Template.Spec.Containers {
			add("webhook", ctr.Image)
		}
	}
	if s.ds != nil {
		for _, ctr := range s.ds.Spec.Template.Spec.Containers {
			add("node agent ("+ctr.Name+")", ctr.Image)
		}
	}
	if s.webhookCMErr == nil {
		var cfg struct {
			Validator struct {
				Image string `json:"image"`
			} `json:"validator"`
		}
		if yaml.Unmarshal([]byte(s.webhookCM.Data["config.yaml"]), &cfg) == nil {
			add("validator", cfg.Validator.Image)
		}
	}
	switch len(images) {
	case 0:
		return Result{Name: name, Status: Warning, Message: "no detour component found to compare images",
			Fix: "see the webhook-deployment and node-agent checks"}
	case 1:
		for img, comps := range images {
			return Result{Name: name, Status: OK, Message: fmt.Sprintf("%s run one image, %s", strings.Join(comps, ", "), img)}
		}
	}
	keys := make([]string, 0, len(images))
	for img := range images {
		keys = append(keys, img)
	}
	slices.Sort(keys)
	var parts []string
	for _, img := range keys {
		parts = append(parts, strings.Join(images[img], ", ")+" run "+img)
	}
	return Result{Name: name, Status: Warning, Message: "detour's components run different images: " + strings.Join(parts, "; "),
		Fix: fmt.Sprintf("finish the upgrade: kubectl -n %s rollout status deployment/%s and daemonset/%s; the validator's image is in ConfigMap %s, which helm upgrade sets", c.namespace, WebhookDeployment, NodeAgentDaemonSet, WebhookConfigMap)}
}

func actions(deleted, annotated int) string {
	var parts []string
	if deleted > 0 {
		parts = append(parts, "deleted "+plural(deleted, "pod"))
	}
	if annotated > 0 {
		parts = append(parts, "annotated "+plural(annotated, "bare pod"))
	}
	return strings.Join(parts, " and ")
}
