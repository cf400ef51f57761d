// Package repair is detour's repair controller (`detour repair`): on its own node it finds
// injected pods whose validator found no redirect (exit code [validator.ExitNoRedirect]) —
// pods whose sandbox was created before detour's CNI config was in place — and has them
// recreated: a controller-owned pod is deleted (its controller makes a new one, which gets the
// redirect), a bare pod gets an Event and the [RecreateAnnotation] telling people to recreate
// it. Actions are rate-limited, deduplicated, reported as Events and Prometheus metrics.
package repair
