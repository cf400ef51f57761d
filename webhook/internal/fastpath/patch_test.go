package fastpath

import (
	"bytes"
	"encoding/json"
	"reflect"
	"testing"

	jsonpatch "github.com/evanphx/json-patch/v5"
	gomodjsonpatch "gomodules.xyz/jsonpatch/v2"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	sigsjson "sigs.k8s.io/json"
)

// fieldOps, applied to the JSON of a (as the API server sent it, with a field this version does
// not know), gives b, and keeps the unknown field.
func TestFieldOps(t *testing.T) {
	base := func() corev1.Container {
		return corev1.Container{Name: "c", Image: "i:1", WorkingDir: "/w",
			SecurityContext: &corev1.SecurityContext{RunAsUser: ptr(int64(0)), Privileged: ptr(false)}}
	}
	for _, tc := range []struct {
		name     string
		change   func(*corev1.Container)
		fallback bool // fieldOps must decline
	}{
		{"set runAsGroup", func(c *corev1.Container) { c.SecurityContext.RunAsGroup = ptr(int64(2600)) }, false},
		{"change runAsUser", func(c *corev1.Container) { c.SecurityContext.RunAsUser = ptr(int64(7)) }, false},
		{"clear a pointer field", func(c *corev1.Container) { c.SecurityContext.Privileged = nil }, false},
		{"drop the security context", func(c *corev1.Container) { c.SecurityContext = nil }, false},
		{"change the image", func(c *corev1.Container) { c.Image = "i:2" }, false},
		{"clear workingDir", func(c *corev1.Container) { c.WorkingDir = "" }, false},
		{"set restartPolicy", func(c *corev1.Container) { c.RestartPolicy = ptr(corev1.ContainerRestartPolicyAlways) }, false},
		{"add capabilities", func(c *corev1.Container) {
			c.SecurityContext.Capabilities = &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}}
		}, false},
		{"add env (a slice)", func(c *corev1.Container) { c.Env = []corev1.EnvVar{{Name: "A", Value: "1"}} }, true},
		{"change resources (a struct value)", func(c *corev1.Container) { c.Resources.Claims = []corev1.ResourceClaim{{Name: "x"}} }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := base(), base()
			tc.change(&b)
			ops, ok := fieldOps("", reflect.ValueOf(&a).Elem(), reflect.ValueOf(&b).Elem(), 0)
			if ok == tc.fallback {
				t.Fatalf("fieldOps ok = %v, want %v", ok, !tc.fallback)
			}
			if !ok {
				return
			}
			raw, _ := json.Marshal(&a)
			var m map[string]any
			_ = json.Unmarshal(raw, &m)
			m["futureField"] = "kept"
			delete(m, "resources") // the API server may leave out what the typed form writes
			raw, _ = json.Marshal(m)
			p, err := json.Marshal(ops)
			if err != nil {
				t.Fatal(err)
			}
			patch, err := jsonpatch.DecodePatch(p)
			if err != nil {
				t.Fatal(err)
			}
			out, err := patch.Apply(raw)
			if err != nil {
				t.Fatalf("apply %s to %s: %v", p, raw, err)
			}
			var got corev1.Container
			if err := sigsjson.UnmarshalCaseSensitivePreserveInts(out, &got); err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, b) {
				t.Errorf("patched %s with %s:\ngot  %+v\nwant %+v", raw, p, got, b)
			}
			var kept map[string]any
			_ = json.Unmarshal(out, &kept)
			if kept["futureField"] != "kept" {
				t.Errorf("the unknown field was lost: %s", out)
			}
		})
	}
}

// MarshalPatch writes what json.Marshal writes, byte for byte.
func TestMarshalPatch(t *testing.T) {
	c := testContainer("api", 1000)
	c.Resources.Limits[corev1.ResourceCPU] = resource.MustParse("1.5")
	var nilPtr *int64
	for _, ops := range [][]gomodjsonpatch.JsonPatchOperation{
		nil,
		{},
		{gomodjsonpatch.NewOperation("add", "/spec/containers/0", c)},
		{
			gomodjsonpatch.NewOperation("add", "/metadata/annotations/a~1b", `<&> "quoted" `+"\u2028 \xff tab\t"),
			gomodjsonpatch.NewOperation("remove", "/spec/x", nil),
			gomodjsonpatch.NewOperation("replace", "/spec/y", nil),
			gomodjsonpatch.NewOperation("add", "/spec/z", nil),
			gomodjsonpatch.NewOperation("test", "/spec/z", nil),
			gomodjsonpatch.NewOperation("add", "/spec/p", nilPtr),
			gomodjsonpatch.NewOperation("add", "/spec/q", ptr(int64(2600))),
			gomodjsonpatch.NewOperation("add", "/metadata/annotations", map[string]string{"z": "1", "a": "<b>"}),
			gomodjsonpatch.NewOperation("add", "/spec/list", []corev1.Container{c, {Name: "x"}}),
			gomodjsonpatch.NewOperation("add", "/spec/f", 1.5e300),
		},
	} {
		want, err := json.Marshal(ops)
		if err != nil {
			t.Fatal(err)
		}
		got, err := MarshalPatch(ops)
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("MarshalPatch = %s, %v\njson.Marshal = %s", got, err, want)
		}
	}
	if _, err := MarshalPatch([]gomodjsonpatch.JsonPatchOperation{gomodjsonpatch.NewOperation("add", "/f", func() {})}); err == nil {
		t.Error("MarshalPatch encoded a function")
	}
}

func FuzzMarshalPatch(f *testing.F) {
	f.Add("add", "/metadata/annotations/x", "v<>&\u2028")
	f.Add("remove", "/a~1b", "")
	f.Fuzz(func(t *testing.T, op, path, value string) {
		ops := []gomodjsonpatch.JsonPatchOperation{gomodjsonpatch.NewOperation(op, path, value), gomodjsonpatch.NewOperation(op, path, nil)}
		want, _ := json.Marshal(ops)
		if got, _ := MarshalPatch(ops); !bytes.Equal(got, want) {
			t.Fatalf("MarshalPatch = %s\njson.Marshal = %s", got, want)
		}
	})
}
