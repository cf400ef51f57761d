// Package validator proves, from inside a pod, that detour's redirect is in place: it listens on
// the proxy's outbound port, connects to a sentinel address outside the pod, and passes only if
// the connection comes back to its own listener with the random token it serves.
//
// `detour validate` runs it as the first init container of every injected pod. Its exit codes
// ([ExitOK], [ExitNoRedirect], [ExitPortInUse], [ExitUsage], [ExitFailure]) are a contract: the
// repair controller recreates pods whose validator exited with [ExitNoRedirect]. See
// docs/validator.md.
package validator
