// Package nodeagent is detour's node agent (`detour install-cni`): it installs the detour-cni
// binary, its kubeconfig and its entry in the primary CNI's conflist once that exists, keeps
// them in place while the primary rewrites its file, keeps the plugin's token fresh (requested
// for the plugin's own service account through the TokenRequest API, or a copy of the agent's),
// and marks the node ready for injected pods (removes the startup taint, sets the ready label).
//
// The conflist editor ([InsertEntry], [ConvertConf], [RemoveEntries]) is pure and fuzzed; the
// [Agent] applies it to the directory, writing atomically and only on change. See
// docs/node-agent.md.
package nodeagent
