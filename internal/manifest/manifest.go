// Package manifest reads Kubernetes manifests for the offline commands: [InjectStream] applies
// the webhook's mutation to every pod and pod template of a YAML or JSON stream (`detour
// inject`), [PodAnnotations] finds the one pod template whose annotations `detour rules` reads.
package manifest

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	yamlutil "k8s.io/apimachinery/pkg/util/yaml"
	sigsjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/inject"
)

// InjectOptions configure [InjectStream].
type InjectOptions struct {
	Config *inject.Config
	// NamespaceAnnotations stand for the annotations of every document's namespace. Nil means
	// an opted-in namespace ({detour.dev/inject: enabled}): injecting is what the caller asked.
	NamespaceAnnotations map[string]string
	// NativeSidecars says whether the target cluster runs native sidecars (Kubernetes ≥ 1.29).
	NativeSidecars bool
	// Validator is where the validator's check runs (inject.ResolveValidatorMode).
	Validator annotations.ValidatorModeValue

	// assumeOptIn is set when NamespaceAnnotations was nil: the namespace's opt-in is only
	// assumed, so injected pods carry their own.
	assumeOptIn bool
}

// Notice is a message about one object of the stream, for stderr.
type Notice struct {
	Object  string // e.g. "Deployment shop/web"
	Message string
}

func (n Notice) String() string { return n.Object + ": " + n.Message }

// podTemplatePaths are where each workload kind keeps its pod template.
var podTemplatePaths = map[string][]string{
	"Deployment":            {"spec", "template"},
	"StatefulSet":           {"spec", "template"},
	"DaemonSet":             {"spec", "template"},
	"ReplicaSet":            {"spec", "template"},
	"ReplicationController": {"spec", "template"},
	"Job":                   {"spec", "template"},
	"CronJob":               {"spec", "jobTemplate", "spec", "template"},
	"PodTemplate":           {"template"},
}

// InjectStream applies [inject.Mutate], as the webhook would, to every pod and pod template in a YAML
// or JSON stream (several documents, Lists, any workload kind) and writes the stream back as
// YAML. Documents without pods, and pods that are not injected, are written unchanged, byte
// for byte; in injected ones only what the mutation changed differs (keys come out sorted).
// Nothing is written when any object fails or is denied: the error names the object.
func InjectStream(r io.Reader, w io.Writer, o InjectOptions) ([]Notice, error) {
	if o.Config == nil {
		return nil, errors.New("inject: no configuration")
	}
	if o.NamespaceAnnotations == nil {
		o.NamespaceAnnotations = optedInNamespace
		o.assumeOptIn = true
	}
	var out bytes.Buffer
	var notices []Notice
	var errs []error
	reader := yamlutil.NewYAMLReader(bufio.NewReader(r))
	for n := 1; ; n++ {
		doc, err := reader.Read()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("read document %d: %w", n, err)
		}
		obj, err := decodeDocument(doc)
		if err != nil {
			return nil, fmt.Errorf("document %d: %w", n, err)
		}
		if obj == nil { // empty, or only comments
			continue
		}
		changed, ns, err := injectObject(obj, "", o)
		notices = append(notices, ns...)
		if err != nil {
			errs = append(errs, fmt.Errorf("document %d: %w", n, err))
			continue
		}
		if out.Len() > 0 {
			out.WriteString("---\n")
		}
		if !changed {
			out.Write(bytes.TrimLeft(doc, "\n"))
			if !bytes.HasSuffix(doc, []byte("\n")) {
				out.WriteByte('\n')
			}
			continue
		}
		b, err := json.Marshal(obj)
		if err == nil {
			b, err = yaml.JSONToYAML(b)
		}
		if err != nil {
			return nil, fmt.Errorf("document %d: encode: %w", n, err)
		}
		out.Write(b)
	}
	if len(errs) > 0 {
		return notices, errors.Join(errs...)
	}
	_, err := w.Write(out.Bytes())
	return notices, err
}

var optedInNamespace = map[string]string{annotations.Inject: string(annotations.InjectEnabled)}

// decodeDocument decodes one YAML or JSON document into a generic object, numbers kept
// exact; nil for an empty document.
func decodeDocument(doc []byte) (map[string]any, error) {
	j, err := yaml.YAMLToJSON(doc)
	if err != nil {
		return nil, fmt.Errorf("parse YAML: %w", err)
	}
	if t := bytes.TrimSpace(j); len(t) == 0 || bytes.Equal(t, []byte("null")) {
		return nil, nil
	}
	return decodeJSON(j)
}

// decodeJSON decodes a JSON object into a generic one, numbers kept exact.
func decodeJSON(j []byte) (map[string]any, error) {
	var v any
	d := json.NewDecoder(bytes.NewReader(j))
	d.UseNumber()
	if err := d.Decode(&v); err != nil {
		return nil, fmt.Errorf("parse: %w", err)
	}
	obj, ok := v.(map[string]any)
	if !ok {
		return nil, fmt.Errorf("a document must be a Kubernetes object, found %T", v)
	}
	return obj, nil
}

func str(m map[string]any, keys ...string) string {
	var cur any = m
	for _, k := range keys {
		mm, ok := cur.(map[string]any)
		if !ok {
			return ""
		}
		cur = mm[k]
	}
	s, _ := cur.(string)
	return s
}

// objectName is "Kind namespace/name" for messages.
func objectName(obj map[string]any) string {
	name := str(obj, "metadata", "name")
	if name == "" {
		name = str(obj, "metadata", "generateName") + "*"
	}
	if ns := str(obj, "metadata", "namespace"); ns != "" {
		name = ns + "/" + name
	}
	return str(obj, "kind") + " " + name
}

// injectObject injects the pod or pod template of obj (the items of a List), in place.
func injectObject(obj map[string]any, namespace string, o InjectOptions) (bool, []Notice, error) {
	kind := str(obj, "kind")
	if ns := str(obj, "metadata", "namespace"); ns != "" {
		namespace = ns
	}
	if items, ok := obj["items"].([]any); ok && strings.HasSuffix(kind, "List") {
		var notices []Notice
		changed := false
		for i, it := range items {
			item, ok := it.(map[string]any)
			if !ok {
				return false, notices, fmt.Errorf("%s: item %d is not an object", kind, i)
			}
			c, n, err := injectObject(item, namespace, o)
			notices = append(notices, n...)
			if err != nil {
				return false, notices, fmt.Errorf("%s item %d: %w", kind, i, err)
			}
			changed = changed || c
		}
		return changed, notices, nil
	}
	var template map[string]any
	if kind == "Pod" && str(obj, "apiVersion") == "v1" {
		template = obj
	} else if path, ok := podTemplatePaths[kind]; ok {
		template = dig(obj, path)
		if template == nil {
			return false, nil, fmt.Errorf("%s: no pod template at .%s", objectName(obj), strings.Join(path, "."))
		}
	} else {
		if path := unknownTemplate(obj); path != "" {
			return false, []Notice{{objectName(obj), fmt.Sprintf(
				"left unchanged: detour inject does not know the kind %s, although it has a pod template at .%s; "+
					"the webhook injects the pods it creates in an opted-in namespace, or inject a Deployment, Job, ... holding the same template", kind, path)}}, nil
		}
		return false, nil, nil
	}
	name := objectName(obj)
	changed, res, err := injectTemplate(template, namespace, o)
	var notices []Notice
	for _, w := range res.Warnings {
		notices = append(notices, Notice{name, w})
	}
	if err != nil {
		return false, notices, fmt.Errorf("%s: %w", name, err)
	}
	if res.Outcome == inject.Skipped {
		notices = append(notices, Notice{name, "not injected (" + res.Reason + ")"})
	}
	return changed, notices, nil
}

func dig(m map[string]any, path []string) map[string]any {
	for _, k := range path {
		next, ok := m[k].(map[string]any)
		if !ok {
			return nil
		}
		m = next
	}
	return m
}

// podOf decodes a pod template (or a pod) case-sensitively, as the API server does.
func podOf(template map[string]any) (*corev1.Pod, error) {
	b, err := json.Marshal(template)
	if err != nil {
		return nil, err
	}
	var pod corev1.Pod
	if err := sigsjson.UnmarshalCaseSensitivePreserveInts(b, &pod); err != nil {
		return nil, fmt.Errorf("decode the pod: %w", err)
	}
	return &pod, nil
}

// injectTemplate mutates template in place and reports whether it changed.
func injectTemplate(template map[string]any, namespace string, o InjectOptions) (bool, inject.Result, error) {
	orig, err := podOf(template)
	if err != nil {
		return false, inject.Result{}, err
	}
	pod := orig.DeepCopy()
	res, err := inject.Mutate(pod, inject.Input{Namespace: namespace, NamespaceAnnotations: o.NamespaceAnnotations, NativeSidecars: o.NativeSidecars, Validator: o.Validator}, o.Config)
	if err != nil || equality.Semantic.DeepEqual(orig, pod) {
		return false, res, err
	}
	if _, own := pod.Annotations[annotations.Inject]; o.assumeOptIn && res.Outcome == inject.Injected && !own {
		// The pod was injected as if its namespace were opted in; it carries that opt-in
		// itself, so that the webhook injects it again, the same way, wherever it is applied,
		// instead of skipping it (and removing detour's containers) in a namespace that is not.
		pod.Annotations[annotations.Inject] = string(annotations.InjectEnabled)
	}
	// Every field the mutation changed is written back, and nothing else: the change from the
	// decoded pod to the mutated one is applied to the template as written, so that fields the
	// typed Pod does not know and the author's own forms (quantities, omitted defaults) survive.
	before, err := generic(orig)
	if err != nil {
		return false, res, err
	}
	after, err := generic(pod)
	if err != nil {
		return false, res, err
	}
	rewritten, _ := rewrite(template, before, after).(map[string]any)
	if rewritten == nil {
		return false, res, errors.New("the mutated pod is not an object; report this as a bug")
	}
	for k := range template {
		if _, ok := rewritten[k]; !ok {
			delete(template, k)
		}
	}
	for k, v := range rewritten {
		template[k] = v
	}
	// The rewritten template must hold exactly the mutated pod.
	check, err := podOf(template)
	if err != nil || !equality.Semantic.DeepEqual(check.ObjectMeta, pod.ObjectMeta) || !equality.Semantic.DeepEqual(check.Spec, pod.Spec) {
		return false, res, fmt.Errorf("the rewritten pod differs from the mutation (%v); report this as a bug", err)
	}
	return true, res, nil
}

// generic is the JSON form of v as a generic value, numbers kept exact (as decodeDocument
// reads a document).
func generic(v any) (map[string]any, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	return decodeJSON(b)
}

// rewrite returns raw (a value as written in the manifest) changed as before (raw decoded
// into the typed pod and encoded again) became after (the mutated pod, encoded): a value the
// mutation left alone keeps its written form; in an object, each member is rewritten in turn,
// members the mutation removed are removed and members it added are written whole; in a list
// of named objects (containers, volumes, ports, env) each element is matched by name, and a
// list of the same length element by element; anything else is after's value.
func rewrite(raw, before, after any) any {
	if reflect.DeepEqual(before, after) {
		return raw
	}
	switch b := after.(type) {
	case map[string]any:
		a, _ := before.(map[string]any)
		r, _ := raw.(map[string]any)
		out := make(map[string]any, len(r)+len(b))
		for k, v := range r {
			out[k] = v
		}
		for k := range a {
			if _, ok := b[k]; !ok {
				delete(out, k)
			}
		}
		for k, bv := range b {
			av, ok := a[k]
			switch {
			case ok && reflect.DeepEqual(av, bv):
				// Unchanged: as written, or absent where the manifest omits it.
			case ok:
				out[k] = rewrite(r[k], av, bv)
			default:
				out[k] = added(bv)
			}
		}
		return out
	case []any:
		a, _ := before.([]any)
		r, _ := raw.([]any)
		if len(r) != len(a) {
			return added(b)
		}
		if index, ok := byName(a); ok {
			if _, ok := byName(b); ok {
				out := make([]any, len(b))
				for i, bv := range b {
					if j, ok := index[name(bv)]; ok {
						out[i] = rewrite(r[j], a[j], bv)
					} else {
						out[i] = added(bv)
					}
				}
				return out
			}
		}
		if len(a) == len(b) {
			out := make([]any, len(b))
			for i := range b {
				out[i] = rewrite(r[i], a[i], b[i])
			}
			return out
		}
		return added(b)
	}
	return after
}

// added is a value the mutation added, as written: without the empty resources that encoding
// a container gives (the manifest's own containers omit it too).
func added(v any) any {
	switch v := v.(type) {
	case map[string]any:
		if r, ok := v["resources"].(map[string]any); ok && len(r) == 0 {
			delete(v, "resources")
		}
		for k, e := range v {
			v[k] = added(e)
		}
	case []any:
		for i, e := range v {
			v[i] = added(e)
		}
	}
	return v
}

// name is the name member of a list element, or "".
func name(v any) string {
	m, _ := v.(map[string]any)
	s, _ := m["name"].(string)
	return s
}

// byName indexes the elements of list by their names; ok is false unless every element is an
// object with a name of its own.
func byName(list []any) (map[string]int, bool) {
	index := make(map[string]int, len(list))
	for i, v := range list {
		n := name(v)
		if _, dup := index[n]; n == "" || dup {
			return nil, false
		}
		index[n] = i
	}
	return index, true
}

// unknownTemplate returns the path of what looks like a pod template (an object with
// spec.containers) at .spec.template or .template of an object of a kind detour does not know
// (an Argo Rollout, an OpenKruise CloneSet...), or "".
func unknownTemplate(obj map[string]any) string {
	for _, path := range [][]string{{"spec", "template"}, {"template"}} {
		if t := dig(obj, path); t != nil {
			if spec, ok := t["spec"].(map[string]any); ok {
				if _, ok := spec["containers"]; ok {
					return strings.Join(path, ".")
				}
			}
		}
	}
	return ""
}

// PodAnnotations returns the annotations of the first pod or pod template in a YAML or JSON
// stream (several documents, Lists), as detour inject finds them, and the name of the object
// holding it, for messages.
func PodAnnotations(r io.Reader) (string, map[string]string, error) {
	reader := yamlutil.NewYAMLReader(bufio.NewReader(r))
	var skipped []string
	for n := 1; ; n++ {
		doc, err := reader.Read()
		if err == io.EOF {
			break
		}
		if err != nil {
			return "", nil, fmt.Errorf("read document %d: %w", n, err)
		}
		obj, err := decodeDocument(doc)
		if err != nil {
			return "", nil, fmt.Errorf("document %d: %w", n, err)
		}
		if obj == nil {
			continue
		}
		name, a, found, err := podAnnotationsOf(obj, &skipped)
		if found || err != nil {
			return name, a, err
		}
	}
	if len(skipped) == 0 {
		return "", nil, errors.New("no object found")
	}
	return "", nil, fmt.Errorf("no pod found in %s; give a Pod or a workload (Deployment, Job, ...)", strings.Join(skipped, ", "))
}

// podAnnotationsOf looks for a pod or a pod template in obj (the items of a List, in order);
// found is false when it holds none, and the object's name is added to skipped.
func podAnnotationsOf(obj map[string]any, skipped *[]string) (string, map[string]string, bool, error) {
	kind := str(obj, "kind")
	if items, ok := obj["items"].([]any); ok && strings.HasSuffix(kind, "List") {
		for _, it := range items {
			if item, ok := it.(map[string]any); ok {
				if name, a, found, err := podAnnotationsOf(item, skipped); found || err != nil {
					return name, a, found, err
				}
			}
		}
		return "", nil, false, nil
	}
	name := objectName(obj)
	var template map[string]any
	switch path, ok := podTemplatePaths[kind]; {
	case kind == "Pod":
		template = obj
	case ok:
		if template = dig(obj, path); template == nil {
			return name, nil, true, fmt.Errorf("%s has no pod template at .%s", name, strings.Join(path, "."))
		}
	default:
		*skipped = append(*skipped, name)
		return "", nil, false, nil
	}
	pod, err := podOf(template)
	if err != nil {
		return name, nil, true, fmt.Errorf("%s: %w", name, err)
	}
	return name, pod.Annotations, true, nil
}
