// Package webhook is detour's admission webhook server: it serves the pod mutation of package
// inject at [MutatePath] over TLS ([Run]), with metrics, health and readiness. The typed
// patch and the AdmissionReview fast path behind [Handler] live in webhook/internal/fastpath,
// the self-managed certificates in webhook/certs.
package webhook
