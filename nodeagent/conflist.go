package nodeagent

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"

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

// formatObject writes members as an indented JSON object.
func formatObject(members []member) ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, m := range members {
		if i > 0 {
			b.WriteByte(',')
		}
		key, err := json.Marshal(m.key)
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

// splitPlugins returns a conflist's members, the index of its "plugins" member and the plugins.
func splitPlugins(conflist []byte) ([]member, int, []json.RawMessage, error) {
	members, err := parseObject(conflist, "the conflist")
	if err != nil {
		return nil, 0, nil, err
	}
	idx := -1
	for i, m := range members {
		if m.key == "plugins" {
			idx = i
		}
	}
	if idx < 0 {
		return nil, 0, nil, errors.New(`the conflist has no "plugins" list`)
	}
	var plugins []json.RawMessage
	if err := json.Unmarshal(members[idx].value, &plugins); err != nil || plugins == nil {
		return nil, 0, nil, errors.New(`the conflist's "plugins" is not a list`)
	}
	for i, p := range plugins {
		if _, err := pluginType(p); err != nil {
			return nil, 0, nil, fmt.Errorf("plugin %d of the conflist is not a JSON object: %w", i, err)
		}
	}
	return members, idx, plugins, nil
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
	_, _, plugins, err := splitPlugins(conflist)
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
// type detour-cni) as its last plugin. Every other key and plugin is kept as written, in its
// order. When entry is already in place — once, identical, after another plugin — conflist is
// returned unchanged with changed false, wherever the entry is: a plugin another agent appended
// after detour's is left alone, so two agents never fight over the last place. Otherwise every
// detour entry is dropped and entry appended.
func InsertEntry(conflist, entry []byte) (out []byte, changed bool, err error) {
	if t, err := pluginType(entry); err != nil || t != PluginType {
		return nil, false, fmt.Errorf("detour's entry must be a JSON object of type %q", PluginType)
	}
	members, idx, plugins, err := splitPlugins(conflist)
	if err != nil {
		return nil, false, err
	}
	if entryInPlace(plugins, entry) {
		return conflist, false, nil
	}
	kept := make([]json.RawMessage, 0, len(plugins)+1)
	for _, p := range plugins {
		if !isEntry(p) {
			kept = append(kept, p)
		}
	}
	if len(kept) == 0 {
		return nil, false, fmt.Errorf("the conflist has no plugin besides %s: it is not a primary CNI configuration", PluginType)
	}
	var compact bytes.Buffer
	if err := json.Compact(&compact, entry); err != nil {
		return nil, false, fmt.Errorf("detour's entry: %w", err)
	}
	kept = append(kept, compact.Bytes())
	if members[idx].value, err = json.Marshal(kept); err != nil {
		return nil, false, err
	}
	out, err = formatObject(members)
	return out, err == nil, err
}

// RemoveEntries returns conflist without detour's entries; changed is false when it had none.
// It refuses to leave a list without plugins.
func RemoveEntries(conflist []byte) (out []byte, changed bool, err error) {
	members, idx, plugins, err := splitPlugins(conflist)
	if err != nil {
		return nil, false, err
	}
	var kept []json.RawMessage
	for _, p := range plugins {
		if !isEntry(p) {
			kept = append(kept, p)
		}
	}
	if len(kept) == len(plugins) {
		return conflist, false, nil
	}
	if len(kept) == 0 {
		return nil, false, fmt.Errorf("the conflist holds only %s entries; removing them would leave no plugin", PluginType)
	}
	if members[idx].value, err = json.Marshal(kept); err != nil {
		return nil, false, err
	}
	out, err = formatObject(members)
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
	name, _ := json.Marshal(net.Name)
	version, _ := json.Marshal(net.CNIVersion)
	return formatObject([]member{
		{"cniVersion", version},
		{"name", name},
		{"plugins", json.RawMessage("[" + compact.String() + "]")},
	})
}
