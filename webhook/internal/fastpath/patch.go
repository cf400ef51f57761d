package fastpath

import (
	"bytes"
	"encoding/json"
	"maps"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"gomodules.xyz/jsonpatch/v2"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Patch returns the JSON patch that turns the request's pod JSON into mutated, or ok false
// when the change is not the shape it handles (the caller then diffs the whole documents).
//
// The patch is computed from the typed pods, never written by hand: annotations and the node
// selector key by key, the volumes by name (removed and added whole), and each container list
// by container name — removed containers, inserted containers (whole), and, for a container
// present in both, the diff of that container alone. Diffing the whole
// pod document instead (what controller-runtime's typed defaulter does) costs most of an
// admission: inserting the validator at the front of the init containers shifts every element,
// so the generic array diff rewrites them all field by field. Fields the typed Pod does not know
// (a newer API server's) are never touched: a changed container's diff is taken from its raw
// JSON, less what merely decoding and encoding it changes.
func Patch(orig, mutated *corev1.Pod, rawPod []byte) ([]jsonpatch.JsonPatchOperation, bool) {
	// A pod without a spec (never a real one) may lack the "spec" member the paths need.
	if !sameExceptWhatPatchDiffs(orig, mutated) || reflect.ValueOf(&orig.Spec).Elem().IsZero() {
		return nil, false
	}
	if len(orig.Annotations) == 0 && len(mutated.Annotations) > 0 && reflect.DeepEqual(orig.ObjectMeta, metav1.ObjectMeta{}) {
		// The request may have no metadata at all, or only fields unknown here: whole-document
		// diff.
		return nil, false
	}
	ops := mapOps("/metadata/annotations", orig.Annotations, mutated.Annotations)
	ops = append(ops, mapOps("/spec/nodeSelector", orig.Spec.NodeSelector, mutated.Spec.NodeSelector)...)
	volumes, ok := volumeOps("/spec/volumes", orig.Spec.Volumes, mutated.Spec.Volumes)
	if !ok {
		return nil, false
	}
	ops = append(ops, volumes...)
	// The raw containers are read, once, only for a container whose fields changed.
	var rawSpec *struct {
		Spec struct {
			InitContainers []json.RawMessage `json:"initContainers"`
			Containers     []json.RawMessage `json:"containers"`
		} `json:"spec"`
	}
	rawContainers := func(key string, n int) ([]json.RawMessage, bool) {
		if rawSpec == nil {
			if err := json.Unmarshal(rawPod, &rawSpec); err != nil || rawSpec == nil {
				return nil, false
			}
		}
		list := rawSpec.Spec.Containers
		if key == "initContainers" {
			list = rawSpec.Spec.InitContainers
		}
		return list, len(list) == n
	}
	for _, l := range []struct {
		key           string
		before, after []corev1.Container
	}{
		{"initContainers", orig.Spec.InitContainers, mutated.Spec.InitContainers},
		{"containers", orig.Spec.Containers, mutated.Spec.Containers},
	} {
		key := l.key
		listOps, ok := containerOps("/spec/"+key, l.before, l.after, func() ([]json.RawMessage, bool) { return rawContainers(key, len(l.before)) })
		if !ok {
			return nil, false
		}
		ops = append(ops, listOps...)
	}
	return ops, true
}

// sameExceptWhatPatchDiffs reports whether the mutation changed nothing but what Patch diffs.
func sameExceptWhatPatchDiffs(a, b *corev1.Pod) bool {
	x, y := *a, *b
	x.Annotations, y.Annotations = nil, nil
	x.Spec.NodeSelector, y.Spec.NodeSelector = nil, nil
	x.Spec.Volumes, y.Spec.Volumes = nil, nil
	x.Spec.InitContainers, y.Spec.InitContainers = nil, nil
	x.Spec.Containers, y.Spec.Containers = nil, nil
	return equalValues(&x, &y) // b is a deep copy of a: untouched parts are identical
}

// mapOps turns the string map at path from before into after, key by key in key order (the
// same pod always gets the same patch); a map that comes or goes is added or removed whole.
func mapOps(path string, before, after map[string]string) []jsonpatch.JsonPatchOperation {
	switch {
	case len(before) == 0 && len(after) == 0:
		return nil
	case len(before) == 0:
		return []jsonpatch.JsonPatchOperation{jsonpatch.NewOperation("add", path, after)}
	case len(after) == 0 && after == nil:
		return []jsonpatch.JsonPatchOperation{jsonpatch.NewOperation("remove", path, nil)}
	}
	var ops []jsonpatch.JsonPatchOperation
	for _, k := range slices.Sorted(maps.Keys(before)) {
		if _, ok := after[k]; !ok {
			ops = append(ops, jsonpatch.NewOperation("remove", path+"/"+escape(k), nil))
		}
	}
	for _, k := range slices.Sorted(maps.Keys(after)) {
		if old, ok := before[k]; !ok || old != after[k] {
			ops = append(ops, jsonpatch.NewOperation("add", path+"/"+escape(k), after[k]))
		}
	}
	return ops
}

// volumeOps turns the volume list at path from before into after by name: removed volumes
// go, new ones are added whole at their place. A volume present in both must be unchanged and
// keep its order (the mutation never edits a volume), else ok is false.
func volumeOps(path string, before, after []corev1.Volume) ([]jsonpatch.JsonPatchOperation, bool) {
	switch {
	case len(before) == 0 && len(after) == 0:
		return nil, true
	case len(before) == 0:
		return []jsonpatch.JsonPatchOperation{jsonpatch.NewOperation("add", path, after)}, true
	case len(after) == 0:
		return []jsonpatch.JsonPatchOperation{jsonpatch.NewOperation("remove", path, nil)}, true
	}
	inAfter := map[string]int{}
	for i, v := range after {
		inAfter[v.Name] = i
	}
	if len(inAfter) != len(after) {
		return nil, false
	}
	var ops []jsonpatch.JsonPatchOperation
	inBefore := map[string]bool{}
	last := -1
	for i := len(before) - 1; i >= 0; i-- {
		if _, ok := inAfter[before[i].Name]; !ok {
			ops = append(ops, jsonpatch.NewOperation("remove", path+"/"+strconv.Itoa(i), nil))
		}
	}
	for i := range before {
		j, ok := inAfter[before[i].Name]
		if !ok {
			continue
		}
		if inBefore[before[i].Name] || j < last || !equalValues(&before[i], &after[j]) {
			return nil, false
		}
		inBefore[before[i].Name], last = true, j
	}
	for j, v := range after {
		if !inBefore[v.Name] {
			ops = append(ops, jsonpatch.NewOperation("add", path+"/"+strconv.Itoa(j), v))
		}
	}
	return ops, true
}

// containerOps turns the list before into after, matching containers by name; raw returns
// the list's raw JSON elements, which before was decoded from.
func containerOps(path string, before, after []corev1.Container, raw func() ([]json.RawMessage, bool)) ([]jsonpatch.JsonPatchOperation, bool) {
	if len(before) == 0 {
		if len(after) == 0 {
			return nil, true
		}
		return []jsonpatch.JsonPatchOperation{jsonpatch.NewOperation("add", path, after)}, true
	}
	if len(after) == 0 {
		return []jsonpatch.JsonPatchOperation{jsonpatch.NewOperation("remove", path, nil)}, true
	}
	inAfter := map[string]int{}
	for i, c := range after {
		if _, dup := inAfter[c.Name]; dup {
			return nil, false
		}
		inAfter[c.Name] = i
	}
	inBefore := map[string]bool{}
	for _, c := range before {
		if inBefore[c.Name] {
			return nil, false
		}
		inBefore[c.Name] = true
	}
	var ops []jsonpatch.JsonPatchOperation
	// Remove, from the end so indices stay valid.
	var kept []int // indices into before
	for i := len(before) - 1; i >= 0; i-- {
		if _, ok := inAfter[before[i].Name]; !ok {
			ops = append(ops, jsonpatch.NewOperation("remove", path+"/"+strconv.Itoa(i), nil))
		}
	}
	for i, c := range before {
		if _, ok := inAfter[c.Name]; ok {
			kept = append(kept, i)
		}
	}
	// The kept containers must keep their order; then inserting the new ones in ascending
	// position yields after.
	last := -1
	for _, i := range kept {
		if inAfter[before[i].Name] < last {
			return nil, false
		}
		last = inAfter[before[i].Name]
	}
	for j, c := range after {
		if !inBefore[c.Name] {
			ops = append(ops, jsonpatch.NewOperation("add", path+"/"+strconv.Itoa(j), c))
		}
	}
	// Changes inside kept containers, at their final index.
	var list []json.RawMessage
	for _, i := range kept {
		j := inAfter[before[i].Name]
		// fieldOps compares field by field: no operations means the containers are equal,
		// and declining means they differ (in a way it does not handle).
		prefix := path + "/" + strconv.Itoa(j)
		if sub, ok := fieldOps(prefix, reflect.ValueOf(&before[i]).Elem(), reflect.ValueOf(&after[j]).Elem(), 0); ok {
			ops = append(ops, sub...)
			continue
		}
		if equalValues(&before[i], &after[j]) {
			continue
		}
		a, err1 := json.Marshal(&before[i])
		b, err2 := json.Marshal(&after[j])
		if err1 != nil || err2 != nil {
			return nil, false
		}
		if list == nil {
			var ok bool
			if list, ok = raw(); !ok {
				return nil, false
			}
		}
		sub, ok := rawDiff(list[i], a, b)
		if !ok {
			return nil, false
		}
		for _, op := range sub {
			op.Path = prefix + op.Path
			ops = append(ops, op)
		}
	}
	return ops, true
}

// field is a struct field and its JSON name.
type field struct {
	index     int
	name      string
	omitEmpty bool
}

var fieldsOf sync.Map // reflect.Type → []field

func jsonFields(t reflect.Type) []field {
	if f, ok := fieldsOf.Load(t); ok {
		return f.([]field)
	}
	var fs []field
	for i := range t.NumField() {
		sf := t.Field(i)
		name, opts, _ := strings.Cut(sf.Tag.Get("json"), ",")
		if !sf.IsExported() || name == "-" || name == "" {
			fs = nil
			break // embedded or untagged fields: not handled here
		}
		fs = append(fs, field{index: i, name: name, omitEmpty: strings.Contains(opts, "omitempty")})
	}
	fieldsOf.Store(t, fs)
	return fs
}

func isScalar(k reflect.Kind) bool {
	switch k {
	case reflect.String, reflect.Bool, reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64, reflect.Float32, reflect.Float64:
		return true
	}
	return false
}

// fieldOps diffs two values of a struct type field by field, without any JSON, when every
// difference is one whose place in the raw JSON the typed values alone tell: a pointer that
// was nil (absent or null in raw: add the new value whole) or becomes nil (remove it), a
// scalar (add, which replaces), or a pointer to a struct whose fields differ only so (depth
// one level). Anything else (slices, maps, struct values, deeper structs) reports ok false,
// and the caller diffs the JSON against the raw container instead.
func fieldOps(prefix string, a, b reflect.Value, depth int) ([]jsonpatch.JsonPatchOperation, bool) {
	fs := jsonFields(a.Type())
	if fs == nil {
		return nil, false
	}
	var ops []jsonpatch.JsonPatchOperation
	for _, f := range fs {
		fa, fb := a.Field(f.index), b.Field(f.index)
		if deepEqual(fa, fb) {
			continue
		}
		path := prefix + "/" + escape(f.name)
		switch {
		case fa.Kind() == reflect.Pointer && fa.IsNil():
			ops = append(ops, jsonpatch.NewOperation("add", path, fb.Interface()))
		case fa.Kind() == reflect.Pointer && fb.IsNil():
			ops = append(ops, jsonpatch.NewOperation("remove", path, nil))
		case fa.Kind() == reflect.Pointer && isScalar(fa.Elem().Kind()):
			ops = append(ops, jsonpatch.NewOperation("add", path, fb.Interface()))
		case fa.Kind() == reflect.Pointer && fa.Elem().Kind() == reflect.Struct && depth == 0:
			sub, ok := fieldOps(path, fa.Elem(), fb.Elem(), depth+1)
			if !ok {
				return nil, false
			}
			ops = append(ops, sub...)
		case isScalar(fa.Kind()):
			if f.omitEmpty && fb.IsZero() {
				ops = append(ops, jsonpatch.NewOperation("remove", path, nil)) // a's value is set: raw has it
			} else {
				ops = append(ops, jsonpatch.NewOperation("add", path, fb.Interface()))
			}
		default:
			return nil, false
		}
	}
	return ops, true
}

// rawDiff is the patch that applies to raw, from which a was decoded, the change from a to b.
// Usually that is the typed diff itself: it only touches fields whose typed values differ,
// and rawDiff checks that each of its paths exists in raw and that it replaces no object or
// array of raw (whose fields unknown here would be lost). Otherwise it is the diff from raw to
// b less what merely decoding raw into a and encoding it again changes (fields a newer API
// server sends, empty structs the typed form writes).
func rawDiff(raw, a, b []byte) ([]jsonpatch.JsonPatchOperation, bool) {
	typed, err := jsonpatch.CreatePatch(a, b)
	if err != nil {
		return nil, false
	}
	var doc any
	if err := json.Unmarshal(raw, &doc); err != nil {
		return nil, false
	}
	if appliesCleanly(doc, typed) {
		return typed, true
	}
	toB, err := jsonpatch.CreatePatch(raw, b)
	if err != nil {
		return nil, false
	}
	toA, err := jsonpatch.CreatePatch(raw, a)
	if err != nil {
		return nil, false
	}
	noise := map[string]bool{}
	for _, op := range toA {
		noise[op.Json()] = true
	}
	var ops []jsonpatch.JsonPatchOperation
	for _, op := range toB {
		if !noise[op.Json()] {
			ops = append(ops, op)
		}
	}
	return ops, true
}

// appliesCleanly reports whether every operation finds its place in doc (the parent of an
// add, the target of a replace or remove) and overwrites no object or array there.
func appliesCleanly(doc any, ops []jsonpatch.JsonPatchOperation) bool {
	for _, op := range ops {
		tokens := strings.Split(op.Path, "/")[1:]
		if len(tokens) == 0 {
			return false
		}
		parent, ok := lookup(doc, tokens[:len(tokens)-1])
		if !ok {
			return false
		}
		obj, isObj := parent.(map[string]any)
		if !isObj {
			return false // array positions: leave them to the full diff
		}
		target, exists := obj[unescape(tokens[len(tokens)-1])]
		switch op.Operation {
		case "add":
		case "replace", "remove":
			if !exists {
				return false
			}
		default:
			return false
		}
		switch target.(type) {
		case map[string]any, []any:
			return false
		}
	}
	return true
}

func lookup(doc any, tokens []string) (any, bool) {
	for _, t := range tokens {
		obj, ok := doc.(map[string]any)
		if !ok {
			return nil, false
		}
		if doc, ok = obj[unescape(t)]; !ok {
			return nil, false
		}
	}
	return doc, true
}

func unescape(t string) string {
	return strings.ReplaceAll(strings.ReplaceAll(t, "~1", "/"), "~0", "~")
}

// escape encodes a JSON pointer token (RFC 6901).
func escape(s string) string {
	return strings.ReplaceAll(strings.ReplaceAll(s, "~", "~0"), "/", "~1")
}

// MarshalPatch encodes ops exactly as json.Marshal does (which admission.Response.Complete
// uses), but each value once: jsonpatch.Operation's MarshalJSON encodes the operation, and
// json.Marshal then scans and compacts what it returned, which cost about a tenth of an
// admission (docs/benchmarks-webhook.md).
func MarshalPatch(ops []jsonpatch.JsonPatchOperation) ([]byte, error) {
	if ops == nil {
		return []byte("null"), nil
	}
	// Sized for a patch like the last one, so that the buffer is rarely grown.
	buf := bytes.NewBuffer(make([]byte, 0, patchSizeHint.Load()))
	enc := json.NewEncoder(buf) // escapes HTML, as json.Marshal does
	put := func(v any) error {
		if err := enc.Encode(v); err != nil {
			return err
		}
		buf.Truncate(buf.Len() - 1) // the newline Encode ends each value with
		return nil
	}
	buf.WriteByte('[')
	for i := range ops {
		op := &ops[i]
		if i > 0 {
			buf.WriteByte(',')
		}
		buf.WriteString(`{"op":`)
		if err := put(op.Operation); err != nil {
			return nil, err
		}
		buf.WriteString(`,"path":`)
		if err := put(op.Path); err != nil {
			return nil, err
		}
		// MarshalJSON writes "value":null for an add or a replace without a value, and
		// leaves out a nil value otherwise.
		if op.Value != nil || op.Operation == "add" || op.Operation == "replace" {
			buf.WriteString(`,"value":`)
			if err := put(op.Value); err != nil {
				return nil, err
			}
		}
		buf.WriteByte('}')
	}
	buf.WriteByte(']')
	patchSizeHint.Store(int64(min(buf.Len()+buf.Len()/8+64, 64<<10)))
	return buf.Bytes(), nil
}

// patchSizeHint is the capacity MarshalPatch starts with.
var patchSizeHint atomic.Int64

func init() { patchSizeHint.Store(4096) }
