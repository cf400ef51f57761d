package nodeagent

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"
	"slices"

	"github.com/detourmesh/detour/cniplugin"
)

// PluginType is the "type" that identifies detour's entry in a conflist, and the name of the
// plugin binary in the CNI bin dir.
const PluginType = cniplugin.PluginType

// member is one key of a JSON object with its value as written.
type member struct {
	key   string
	value json.RawMessage
}

// parseObject parses a JSON object keeping its members in order and their values as written.
// Duplicate keys are rejected: readers disagree about which one counts.
func parseObject(data []byte, what string) ([]member, error) {
	if !json.Valid(data) {
		return nil, fmt.Errorf("%s is not valid JSON", what)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, fmt.Errorf("%s is not a JSON object", what)
	}
	var members []member
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", what, err)
		}
		key, ok := tok.(string)
		if !ok {
			return nil, fmt.Errorf("read %s: unexpected %v", what, tok)
		}
		var value json.RawMessage
		if err := dec.Decode(&value); err != nil {
			return nil, fmt.Errorf("read %s key %q: %w", what, key, err)
		}
		if seen[key] {
			return nil, fmt.Errorf("%s has the key %q twice", what, key)
		}
		seen[key] = true
		members = append(members, member{key, value})
	}
	if _, err := dec.Token(); err != nil {
		return nil, fmt.Errorf("read %s: %w", what, err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, fmt.Errorf("%s has data after its JSON object", what)
	}
	return members, nil
}

// marshal encodes v as JSON without HTML escaping: a key or value written "&", "<" or ">" stays
// so (encoding/json's Marshal would write \u0026...). Equivalent JSON, but people diff these files.
func marshal(v any) ([]byte, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(b.Bytes(), []byte("\n")), nil
}

// formatObject writes members as an indented JSON object.
func formatObject(members []member) ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, m := range members {
		if i > 0 {
			b.WriteByte(',')
		}
		key, err := marshal(m.key)
		if err != nil {
			return nil, err
		}
		b.Write(key)
		b.WriteByte(':')
		b.Write(m.value)
	}
	b.WriteByte('}')
	var out bytes.Buffer
	if err := json.Indent(&out, b.Bytes(), "", "  "); err != nil {
		return nil, fmt.Errorf("format the configuration: %w", err)
	}
	out.WriteByte('\n')
	return out.Bytes(), nil
}

// pluginType returns a plugin's "type" the way libcni reads it (encoding/json into a struct).
func pluginType(plugin json.RawMessage) (string, error) {
	var p struct {
		Type string `json:"type"`
	}
	if err := json.Unmarshal(plugin, &p); err != nil {
		return "", err
	}
	return p.Type, nil
}

// span is the byte range [start, end) of a JSON value in a document.
type span struct{ start, end int }

// pluginSpans returns where a conflist that splitPlugins accepted holds its "plugins" list and
// each plugin, so that an edit can keep every other byte of the file as it was.
func pluginSpans(conflist []byte) (list span, plugins []span, err error) {
	next := func(dec *json.Decoder, base int) (span, error) {
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return span{}, err
		}
		end := base + int(dec.InputOffset())
		return span{end - len(v), end}, nil
	}
	dec := json.NewDecoder(bytes.NewReader(conflist))
	if _, err := dec.Token(); err != nil {
		return list, nil, err
	}
	found := false
	for dec.More() {
		key, err := dec.Token()
		if err != nil {
			return list, nil, err
		}
		v, err := next(dec, 0)
		if err != nil {
			return list, nil, err
		}
		if key == "plugins" {
			list, found = v, true
		}
	}
	if !found {
		return list, nil, errors.New(`the conflist has no "plugins" list`)
	}
	dec = json.NewDecoder(bytes.NewReader(conflist[list.start:list.end]))
	if _, err := dec.Token(); err != nil {
		return list, nil, err
	}
	for dec.More() {
		p, err := next(dec, list.start)
		if err != nil {
			return list, nil, err
		}
		plugins = append(plugins, p)
	}
	return list, plugins, nil
}

// editPlugins returns conflist with the plugins for which drop is true removed and, when entry
// is not nil, entry appended. Every other byte stays as it was: the other plugins, the other
// keys, the indentation and the separators, so that the file changes only by detour's entry.
func editPlugins(conflist []byte, drop func(json.RawMessage) bool, entry []byte) ([]byte, error) {
	list, plugins, err := pluginSpans(conflist)
	if err != nil {
		return nil, err
	}
	var b bytes.Buffer
	b.Write(conflist[:list.start+1]) // up to and with "["
	sep := []byte(", ")
	switch n := len(plugins); {
	case n > 1:
		sep = conflist[plugins[n-2].end:plugins[n-1].start] // as the file separates its plugins
	case n == 1 && plugins[0].start > list.start+1:
		// One plugin: put the entry on a line of its own when the plugin has one.
		sep = append([]byte(","), conflist[list.start+1:plugins[0].start]...)
	}
	tail := conflist[list.end-1 : list.end] // "]", and before it what followed the last plugin
	if n := len(plugins); n > 0 {
		b.Write(conflist[list.start+1 : plugins[0].start]) // what preceded the first plugin
		tail = conflist[plugins[n-1].end:list.end]
	}
	kept := 0
	for i, p := range plugins {
		if drop(json.RawMessage(conflist[p.start:p.end])) {
			continue
		}
		if kept > 0 {
			if i > 0 && !drop(json.RawMessage(conflist[plugins[i-1].start:plugins[i-1].end])) {
				b.Write(conflist[plugins[i-1].end:p.start]) // the separator the file had here
			} else {
				b.Write(sep)
			}
		}
		b.Write(conflist[p.start:p.end])
		kept++
	}
	if entry != nil {
		if kept > 0 {
			b.Write(sep)
		}
		b.Write(entry)
	}
	b.Write(tail)
	b.Write(conflist[list.end:])
	return b.Bytes(), nil
}

// splitPlugins returns a conflist's plugins, each checked to be a JSON object.
func splitPlugins(conflist []byte) ([]json.RawMessage, error) {
	members, err := parseObject(conflist, "the conflist")
	if err != nil {
		return nil, err
	}
	idx := -1
	for i, m := range members {
		if m.key == "plugins" {
			idx = i
		}
	}
	if idx < 0 {
		return nil, errors.New(`the conflist has no "plugins" list`)
	}
	var plugins []json.RawMessage
	if err := json.Unmarshal(members[idx].value, &plugins); err != nil || plugins == nil {
		return nil, errors.New(`the conflist's "plugins" is not a list`)
	}
	for i, p := range plugins {
		if _, err := pluginType(p); err != nil {
			return nil, fmt.Errorf("plugin %d of the conflist is not a JSON object: %w", i, err)
		}
	}
	return plugins, nil
}

// isEntry reports whether plugin is one of detour's entries.
func isEntry(plugin json.RawMessage) bool {
	t, _ := pluginType(plugin)
	return t == PluginType
}

// sameJSON reports whether a and b hold the same JSON value, whatever their formatting.
func sameJSON(a, b []byte) bool {
	var va, vb any
	if json.Unmarshal(a, &va) != nil || json.Unmarshal(b, &vb) != nil {
		return false
	}
	return reflect.DeepEqual(va, vb)
}

// EntryInPlace reports whether conflist holds entry exactly once, after at least one other
// plugin (a chained plugin needs a previous result), and no other detour entry.
func EntryInPlace(conflist, entry []byte) (bool, error) {
	plugins, err := splitPlugins(conflist)
	if err != nil {
		return false, err
	}
	return entryInPlace(plugins, entry), nil
}

func entryInPlace(plugins []json.RawMessage, entry []byte) bool {
	found := -1
	for i, p := range plugins {
		if isEntry(p) {
			if found >= 0 || !sameJSON(p, entry) {
				return false
			}
			found = i
		}
	}
	return found > 0
}

// InsertEntry returns conflist with entry (detour's plugin configuration, a JSON object of
// type detour-cni) as its last plugin. Every other byte is kept as written: the other keys and
// plugins, in their order, and the file's formatting. When entry is already in place — once, identical, after another plugin — conflist is
// returned unchanged with changed false, wherever the entry is: a plugin another agent appended
// after detour's is left alone, so two agents never fight over the last place. Otherwise every
// detour entry is dropped and entry appended.
func InsertEntry(conflist, entry []byte) (out []byte, changed bool, err error) {
	if t, err := pluginType(entry); err != nil || t != PluginType {
		return nil, false, fmt.Errorf("detour's entry must be a JSON object of type %q", PluginType)
	}
	plugins, err := splitPlugins(conflist)
	if err != nil {
		return nil, false, err
	}
	if entryInPlace(plugins, entry) {
		return conflist, false, nil
	}
	if !slices.ContainsFunc(plugins, func(p json.RawMessage) bool { return !isEntry(p) }) {
		return nil, false, fmt.Errorf("the conflist has no plugin besides %s: it is not a primary CNI configuration", PluginType)
	}
	var compact bytes.Buffer
	if err := json.Compact(&compact, entry); err != nil {
		return nil, false, fmt.Errorf("detour's entry: %w", err)
	}
	out, err = editPlugins(conflist, isEntry, compact.Bytes())
	return out, err == nil, err
}

// RemoveEntries returns conflist without detour's entries, every other byte as it was; changed
// is false when it had none. It refuses to leave a list without plugins.
func RemoveEntries(conflist []byte) (out []byte, changed bool, err error) {
	plugins, err := splitPlugins(conflist)
	if err != nil {
		return nil, false, err
	}
	entries := 0
	for _, p := range plugins {
		if isEntry(p) {
			entries++
		}
	}
	switch entries {
	case 0:
		return conflist, false, nil
	case len(plugins):
		return nil, false, fmt.Errorf("the conflist holds only %s entries; removing them would leave no plugin", PluginType)
	}
	out, err = editPlugins(conflist, isEntry, nil)
	return out, err == nil, err
}

// ConvertConf turns a single-plugin network configuration (a .conf or .json file) into the
// equivalent conflist, exactly as libcni's ConfListFromConf does when the runtime loads it: the
// list takes the network's name and cniVersion, and its only plugin is the file's object as
// written, every key included.
func ConvertConf(conf []byte) ([]byte, error) {
	if _, err := parseObject(conf, "the network configuration"); err != nil {
		return nil, err
	}
	var net struct {
		CNIVersion string `json:"cniVersion"`
		Name       string `json:"name"`
		Type       string `json:"type"`
	}
	if err := json.Unmarshal(conf, &net); err != nil {
		return nil, fmt.Errorf("read the network configuration: %w", err)
	}
	switch {
	case net.Type == "":
		return nil, errors.New(`the network configuration has no "type": a .conf file holds one plugin (a list belongs in a .conflist file)`)
	case net.Name == "":
		return nil, errors.New(`the network configuration has no "name"`)
	}
	var compact bytes.Buffer
	if err := json.Compact(&compact, conf); err != nil {
		return nil, err
	}
	name, _ := marshal(net.Name)
	version, _ := marshal(net.CNIVersion)
	return formatObject([]member{
		{"cniVersion", version},
		{"name", name},
		{"plugins", json.RawMessage("[" + compact.String() + "]")},
	})
}

// hasEntry reports whether a conflist holds any detour entry.
func hasEntry(conflist []byte) bool {
	plugins, err := splitPlugins(conflist)
	if err != nil {
		return false
	}
	for _, p := range plugins {
		if isEntry(p) {
			return true
		}
	}
	return false
}
