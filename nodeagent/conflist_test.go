package nodeagent

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"
)

const testEntry = `{"type":"detour-cni","name":"detour-cni","kubeconfig":"/etc/cni/net.d/detour-cni.kubeconfig","apiTimeout":"5s","iptablesBackend":"auto","logLevel":"info","excludeNamespaces":["kube-system"],"capabilities":{"io.kubernetes.cri.pod-annotations":true}}`

const calico = `{
  "name": "k8s-pod-network",
  "cniVersion": "0.3.1",
  "plugins": [
    {"type": "calico", "log_level": "info", "datastore_type": "kubernetes", "ipam": {"type": "calico-ipam"}, "policy": {"type": "k8s"}},
    {"type": "bandwidth", "capabilities": {"bandwidth": true}},
    {"type": "portmap", "snat": true, "capabilities": {"portMappings": true}}
  ],
  "x-vendor": {"keep": ["me", 1, null]}
}`

// plugins returns the conflist's plugins, compacted, failing the test if it is not valid.
func plugins(t testing.TB, conflist []byte) []string {
	t.Helper()
	var list struct {
		Plugins []json.RawMessage `json:"plugins"`
	}
	if err := json.Unmarshal(conflist, &list); err != nil {
		t.Fatalf("conflist is not valid JSON: %v\n%s", err, conflist)
	}
	var out []string
	for _, p := range list.Plugins {
		var b bytes.Buffer
		if err := json.Compact(&b, p); err != nil {
			t.Fatal(err)
		}
		out = append(out, b.String())
	}
	return out
}

func compact(t testing.TB, s string) string {
	t.Helper()
	var b bytes.Buffer
	if err := json.Compact(&b, []byte(s)); err != nil {
		t.Fatal(err)
	}
	return b.String()
}

func TestInsertEntryAppendsAndPreserves(t *testing.T) {
	out, changed, err := InsertEntry([]byte(calico), []byte(testEntry))
	if err != nil || !changed {
		t.Fatalf("InsertEntry = changed %v, %v", changed, err)
	}
	got := plugins(t, out)
	before := plugins(t, []byte(calico))
	if len(got) != 4 || strings.Join(got[:3], "\n") != strings.Join(before, "\n") || got[3] != compact(t, testEntry) {
		t.Errorf("plugins after insert:\n%s", strings.Join(got, "\n"))
	}
	// Every other key is kept, in its order.
	var keys []string
	for _, m := range mustParse(t, out) {
		keys = append(keys, m.key)
	}
	if strings.Join(keys, ",") != "name,cniVersion,plugins,x-vendor" {
		t.Errorf("keys %v, want the original order", keys)
	}
	if !strings.Contains(string(out), `"keep": [`) {
		t.Errorf("x-vendor lost:\n%s", out)
	}
	list, err := libcni.ConfListFromBytes(out)
	if err != nil || len(list.Plugins) != 4 || list.Plugins[3].Network.Type != PluginType || list.Name != "k8s-pod-network" {
		t.Errorf("libcni reads the result as %+v, %v", list, err)
	}

	// Again: already in place, nothing changes, byte for byte.
	again, changed, err := InsertEntry(out, []byte(testEntry))
	if err != nil || changed || !bytes.Equal(again, out) {
		t.Errorf("second InsertEntry = changed %v, %v", changed, err)
	}
}

// Issue 15.12: the primary's file changes only by detour's entry — other installers compare it,
// operators diff it: no re-indentation, no HTML escaping, separators kept.
func TestEditKeepsTheFilesBytes(t *testing.T) {
	entry := compact(t, testEntry)
	for _, tc := range []struct{ name, in, inserted, removed string }{
		{"indented", calico, strings.Replace(calico, "true}}\n  ]", "true}},\n    "+entry+"\n  ]", 1), calico},
		{"compact, HTML characters", `{"name":"a&b","plugins":[{"type":"bridge","<x>":"&000"}],"cniVersion":"1.0.0"}`,
			`{"name":"a&b","plugins":[{"type":"bridge","<x>":"&000"}, ` + entry + `],"cniVersion":"1.0.0"}`,
			`{"name":"a&b","plugins":[{"type":"bridge","<x>":"&000"}],"cniVersion":"1.0.0"}`},
		{"stale entry in the middle", "{\"name\":\"n\",\"plugins\":[\n {\"type\":\"a\"},\n {\"type\":\"detour-cni\"},\n {\"type\":\"b\"}\n]}\n",
			"{\"name\":\"n\",\"plugins\":[\n {\"type\":\"a\"},\n {\"type\":\"b\"},\n " + entry + "\n]}\n",
			"{\"name\":\"n\",\"plugins\":[\n {\"type\":\"a\"},\n {\"type\":\"b\"}\n]}\n"},
		{"stale entry first", `{"name":"n","plugins":[{"type":"detour-cni"}, {"type":"a"}]}`,
			`{"name":"n","plugins":[{"type":"a"}, ` + entry + `]}`, `{"name":"n","plugins":[{"type":"a"}]}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, changed, err := InsertEntry([]byte(tc.in), []byte(testEntry))
			if err != nil || !changed || string(out) != tc.inserted {
				t.Fatalf("InsertEntry = %v, %v:\n%s\nwant\n%s", changed, err, out, tc.inserted)
			}
			back, _, err := RemoveEntries(out)
			if err != nil || string(back) != tc.removed {
				t.Fatalf("RemoveEntries = %v:\n%s\nwant\n%s", err, back, tc.removed)
			}
		})
	}
}

func mustParse(t testing.TB, b []byte) []member {
	t.Helper()
	m, err := parseObject(b, "test")
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func TestInsertEntryCases(t *testing.T) {
	entry := compact(t, testEntry)
	old := `{"type":"detour-cni","name":"detour-cni","logLevel":"debug"}`
	for _, tc := range []struct {
		name    string
		in      string
		changed bool
		want    []string // plugin types in order
		err     string
	}{
		{"appended", `{"name":"n","cniVersion":"1.0.0","plugins":[{"type":"bridge"}]}`, true, []string{"bridge", "detour-cni"}, ""},
		{"already last", `{"name":"n","plugins":[{"type":"bridge"},` + entry + `]}`, false, []string{"bridge", "detour-cni"}, ""},
		{"same entry, formatted otherwise", `{"name":"n","plugins":[{"type":"bridge"},` + testEntry + `]}`, false, []string{"bridge", "detour-cni"}, ""},
		{"another agent appended after us", `{"name":"n","plugins":[{"type":"bridge"},` + entry + `,{"type":"other-mesh"}]}`, false, []string{"bridge", "detour-cni", "other-mesh"}, ""},
		{"twice", `{"name":"n","plugins":[{"type":"bridge"},` + entry + `,` + entry + `]}`, true, []string{"bridge", "detour-cni"}, ""},
		{"outdated entry", `{"name":"n","plugins":[{"type":"bridge"},` + old + `,{"type":"portmap"}]}`, true, []string{"bridge", "portmap", "detour-cni"}, ""},
		{"entry first", `{"name":"n","plugins":[` + entry + `,{"type":"bridge"}]}`, true, []string{"bridge", "detour-cni"}, ""},
		{"only detour", `{"name":"n","plugins":[` + entry + `]}`, false, nil, "no plugin besides detour-cni"},
		{"no plugins key", `{"name":"n","cniVersion":"1.1.0"}`, false, nil, `no "plugins" list`},
		{"plugins not a list", `{"name":"n","plugins":{"type":"bridge"}}`, false, nil, `"plugins" is not a list`},
		{"plugins null", `{"name":"n","plugins":null}`, false, nil, `"plugins" is not a list`},
		{"empty plugins", `{"name":"n","plugins":[]}`, false, nil, "no plugin besides"},
		{"plugin not an object", `{"name":"n","plugins":[1]}`, false, nil, "plugin 0 of the conflist is not a JSON object"},
		{"duplicate key", `{"name":"n","plugins":[{"type":"a"}],"plugins":[{"type":"b"}]}`, false, nil, `the key "plugins" twice`},
		{"not an object", `[1,2]`, false, nil, "not a JSON object"},
		{"truncated", `{"name":"n","plugins":[{"type":"bridge"}`, false, nil, "not valid JSON"},
		{"trailing data", `{"name":"n","plugins":[{"type":"bridge"}]} {}`, false, nil, "not valid JSON"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, changed, err := InsertEntry([]byte(tc.in), []byte(testEntry))
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("InsertEntry error %v, want one containing %q", err, tc.err)
				}
				return
			}
			if err != nil || changed != tc.changed {
				t.Fatalf("InsertEntry = changed %v, %v; want changed %v", changed, err, tc.changed)
			}
			var types []string
			for _, p := range plugins(t, out) {
				typ, _ := pluginType(json.RawMessage(p))
				types = append(types, typ)
			}
			if strings.Join(types, ",") != strings.Join(tc.want, ",") {
				t.Errorf("plugin types %v, want %v", types, tc.want)
			}
			if ok, _ := EntryInPlace(out, []byte(testEntry)); !ok {
				t.Errorf("EntryInPlace is false after InsertEntry:\n%s", out)
			}
		})
	}
}

func TestRemoveEntries(t *testing.T) {
	with, _, err := InsertEntry([]byte(calico), []byte(testEntry))
	if err != nil {
		t.Fatal(err)
	}
	out, changed, err := RemoveEntries(with)
	if err != nil || !changed {
		t.Fatalf("RemoveEntries = %v, %v", changed, err)
	}
	if got, want := plugins(t, out), plugins(t, []byte(calico)); strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("plugins after removal:\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if _, changed, err := RemoveEntries([]byte(calico)); changed || err != nil {
		t.Errorf("RemoveEntries without an entry = %v, %v", changed, err)
	}
	if _, _, err := RemoveEntries([]byte(`{"name":"n","plugins":[` + testEntry + `]}`)); err == nil {
		t.Error("RemoveEntries emptied a list")
	}
}

func TestConvertConf(t *testing.T) {
	conf := `{"cniVersion":"0.4.0","name":"kindnet","type":"ptp","ipMasq":false,"ipam":{"type":"host-local","ranges":[[{"subnet":"10.244.0.0/24"}]]},"mtu":1500}`
	out, err := ConvertConf([]byte(conf))
	if err != nil {
		t.Fatal(err)
	}
	// What libcni makes of the .conf when the runtime loads it is what the conflist holds.
	single, err := libcni.ConfFromBytes([]byte(conf))
	if err != nil {
		t.Fatal(err)
	}
	want, err := libcni.ConfListFromConf(single)
	if err != nil {
		t.Fatal(err)
	}
	got, err := libcni.ConfListFromBytes(out)
	if err != nil {
		t.Fatalf("libcni cannot read the converted list: %v\n%s", err, out)
	}
	if got.Name != want.Name || got.CNIVersion != want.CNIVersion || len(got.Plugins) != 1 || !sameJSON(got.Plugins[0].Bytes, want.Plugins[0].Bytes) {
		t.Errorf("converted %+v, libcni converts to %+v", got, want)
	}
	if p := plugins(t, out); len(p) != 1 || p[0] != compact(t, conf) {
		t.Errorf("the plugin is not the .conf as written: %v", p)
	}

	for in, wantErr := range map[string]string{
		`{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"bridge"}]}`: `no "type"`,
		`{"cniVersion":"1.0.0","type":"bridge"}`:                          `no "name"`,
		`{"name":"n","type":"bridge","name":"m"}`:                         "twice",
		`not json`: "not valid JSON",
	} {
		if _, err := ConvertConf([]byte(in)); err == nil || !strings.Contains(err.Error(), wantErr) {
			t.Errorf("ConvertConf(%s) error %v, want %q", in, err, wantErr)
		}
	}
}

// FuzzInsertEntry: whatever the file holds, the editor never panics, never writes invalid JSON,
// never drops or changes another plugin, and leaves exactly one entry after the others.
func FuzzInsertEntry(f *testing.F) {
	f.Add([]byte(calico))
	f.Add([]byte(`{"name":"n","plugins":[{"type":"bridge"},` + testEntry + `,` + testEntry + `]}`))
	f.Add([]byte(`{"name":"n","plugins":[{"type":"detour-cni"},{"TYPE":"bridge"}]}`))
	f.Add([]byte(`{"name":"n","plugins":[{"type":"bridge","type":"detour-cni"}]}`))
	f.Add([]byte(`{"plugins":[{"type":"a\u0000b"}],"name":"\ud800"}`))
	f.Add([]byte(`{"cniVersion":"0.3.1","name":"n","type":"bridge"}`))
	f.Fuzz(func(t *testing.T, in []byte) {
		out, changed, err := InsertEntry(in, []byte(testEntry))
		if err != nil {
			return
		}
		if !json.Valid(out) {
			t.Fatalf("invalid JSON written:\n%s", out)
		}
		inPlugins, outPlugins := plugins(t, in), plugins(t, out)
		var others []string
		for _, p := range inPlugins {
			if !isEntry(json.RawMessage(p)) {
				others = append(others, p)
			}
		}
		var outOthers []string
		entries := 0
		for _, p := range outPlugins {
			if isEntry(json.RawMessage(p)) {
				entries++
			} else {
				outOthers = append(outOthers, p)
			}
		}
		if strings.Join(others, "\n") != strings.Join(outOthers, "\n") {
			t.Fatalf("other plugins changed:\n%s\nbecame\n%s", strings.Join(others, "\n"), strings.Join(outOthers, "\n"))
		}
		if ok, err := EntryInPlace(out, []byte(testEntry)); !ok || entries != 1 {
			t.Fatalf("entry not in place once (%d entries, %v):\n%s", entries, err, out)
		}
		if changed && !isEntry(json.RawMessage(outPlugins[len(outPlugins)-1])) {
			t.Fatalf("a changed list does not end with detour's entry:\n%s", out)
		}
		if _, err := libcni.ConfListFromBytes(in); err == nil {
			if _, err := libcni.ConfListFromBytes(out); err != nil {
				t.Fatalf("libcni read the input but not the output: %v\n%s", err, out)
			}
		}
		// Outside the plugins list the file is kept byte for byte.
		if list, _, err := pluginSpans(in); err == nil {
			outList, _, err := pluginSpans(out)
			if err != nil || !bytes.Equal(in[:list.start], out[:outList.start]) || !bytes.Equal(in[list.end:], out[outList.end:]) {
				t.Fatalf("bytes outside the plugins list changed (%v):\n%s\nbecame\n%s", err, in, out)
			}
		}
		// Removing the entry again gives back the other plugins.
		back, _, err := RemoveEntries(out)
		if err != nil || strings.Join(plugins(t, back), "\n") != strings.Join(others, "\n") {
			t.Fatalf("RemoveEntries after InsertEntry = %v:\n%s", err, back)
		}
	})
}

// FuzzConvertConf: a converted .conf is valid JSON whose only plugin is the file as written.
func FuzzConvertConf(f *testing.F) {
	f.Add([]byte(`{"cniVersion":"0.4.0","name":"kindnet","type":"ptp","ipam":{"type":"host-local"}}`))
	f.Add([]byte(`{"name":"n","type":"bridge","cniVersion":1}`))
	f.Fuzz(func(t *testing.T, in []byte) {
		out, err := ConvertConf(in)
		if err != nil {
			return
		}
		p := plugins(t, out)
		if len(p) != 1 || p[0] != compact(t, string(in)) {
			t.Fatalf("converted plugins %v, want the input", p)
		}
		if _, _, err := InsertEntry(out, []byte(testEntry)); err != nil {
			t.Fatalf("cannot insert into a converted conf: %v\n%s", err, out)
		}
	})
}

// BenchmarkInsertEntry is the cost of one check of a primary that already holds the entry (what
// every resync and file event does) and of one insertion.
func BenchmarkInsertEntry(b *testing.B) {
	with, _, err := InsertEntry([]byte(calico), []byte(testEntry))
	if err != nil {
		b.Fatal(err)
	}
	b.Run("in-place", func(b *testing.B) {
		for b.Loop() {
			if _, changed, err := InsertEntry(with, []byte(testEntry)); err != nil || changed {
				b.Fatal(changed, err)
			}
		}
	})
	b.Run("insert", func(b *testing.B) {
		for b.Loop() {
			if _, changed, err := InsertEntry([]byte(calico), []byte(testEntry)); err != nil || !changed {
				b.Fatal(changed, err)
			}
		}
	})
}
