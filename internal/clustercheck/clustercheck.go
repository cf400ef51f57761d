package clustercheck

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"time"

	"k8s.io/client-go/kubernetes"

	"github.com/detourmesh/detour/inject"
	"github.com/detourmesh/detour/webhook"
)

// Status is the outcome of one check.
type Status string

const (
	// OK: nothing to do.
	OK Status = "ok"
	// Warning: detour works, but something deserves a look (a rollout in progress, recent
	// repairs, a check that could not look).
	Warning Status = "warning"
	// Error: something is broken; the command exits non-zero.
	Error Status = "error"
)

// Symbol is the status as the text output prints it.
func (s Status) Symbol() string {
	switch s {
	case OK:
		return "✓"
	case Warning:
		return "‼"
	}
	return "✗"
}

// Result is one check's outcome: a one-line message and, unless it is OK, what to do and where
// the documentation says more.
type Result struct {
	// Name is the check's stable identifier (docs/troubleshooting.md has a section per name).
	Name    string `json:"name"`
	Status  Status `json:"status"`
	Message string `json:"message"`
	Fix     string `json:"fix,omitempty"`
	Docs    string `json:"docs,omitempty"`
	// Objects are all the objects the result is about, as namespace/name, where the message
	// names only the first few (uninjected-pods: every pod it found).
	Objects []string `json:"objects,omitempty"`
}

// Report is every check's result, in the order they ran.
type Report struct {
	Results  []Result `json:"results"`
	Errors   int      `json:"errors"`
	Warnings int      `json:"warnings"`
}

func (r *Report) add(res Result) {
	if res.Status != OK && res.Docs == "" {
		res.Docs = DocsURL + "#check-cluster-" + res.Name
	}
	switch res.Status {
	case Error:
		r.Errors++
	case Warning:
		r.Warnings++
	}
	r.Results = append(r.Results, res)
}

// Result returns the result of the check called name, and whether that check ran.
func (r Report) Result(name string) (Result, bool) {
	for _, res := range r.Results {
		if res.Name == name {
			return res, true
		}
	}
	return Result{}, false
}

// Failed reports whether any check found an error.
func (r Report) Failed() bool { return r.Errors > 0 }

// WriteText prints one line per check (✓, ‼ or ✗ and the message), the fix and the link
// indented under each one that is not OK, and a summary line.
func (r Report) WriteText(w io.Writer) error {
	var b strings.Builder
	for _, res := range r.Results {
		fmt.Fprintf(&b, "%s %s\n", res.Status.Symbol(), res.Message)
		if res.Status != OK {
			if res.Fix != "" {
				fmt.Fprintf(&b, "    fix: %s\n", res.Fix)
			}
			fmt.Fprintf(&b, "    see: %s\n", res.Docs)
		}
	}
	fmt.Fprintf(&b, "\n%d checks: %d ✓, %d ‼, %d ✗\n", len(r.Results), len(r.Results)-r.Warnings-r.Errors, r.Warnings, r.Errors)
	_, err := io.WriteString(w, b.String())
	return err
}

// WriteJSON prints the report as one JSON object.
func (r Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// Checker runs the checks against one cluster.
type Checker struct {
	client    kubernetes.Interface
	namespace string
	since     time.Duration
	host      string
	dial      DialFunc
	probe     bool
	now       func() time.Time
	// gate reads whether the API server keeps image volumes (default: its /metrics).
	gate func(context.Context) (inject.Gate, string)
}

// Option configures a Checker.
type Option func(*Checker)

// WithNamespace sets detour's namespace (default [DefaultNamespace]).
func WithNamespace(ns string) Option { return func(c *Checker) { c.namespace = ns } }

// WithSince sets how far back the repair controller's Events count (default one hour).
func WithSince(d time.Duration) Option { return func(c *Checker) { c.since = d } }

// WithHost names the API server in the messages (the kubeconfig's server).
func WithHost(host string) Option { return func(c *Checker) { c.host = host } }

// WithDialer sets how the check reaches a webhook pod to see the certificate it serves
// (default: none, and the certificate check warns that it could not look).
func WithDialer(d DialFunc) Option { return func(c *Checker) { c.dial = d } }

// WithAdmissionProbe turns the webhook-admission check (a pod created with dryRun=All) on or
// off (default on).
func WithAdmissionProbe(on bool) Option { return func(c *Checker) { c.probe = on } }

// WithImageVolumeGate sets how the check reads whether the API server keeps image volumes
// (default: its /metrics, as the webhook reads them).
func WithImageVolumeGate(gate func(context.Context) (inject.Gate, string)) Option {
	return func(c *Checker) { c.gate = gate }
}

// WithClock sets the clock (tests).
func WithClock(now func() time.Time) Option { return func(c *Checker) { c.now = now } }

// New returns a Checker that reads the cluster through client.
func New(client kubernetes.Interface, opts ...Option) *Checker {
	c := &Checker{client: client, namespace: DefaultNamespace, since: time.Hour, probe: true, now: time.Now}
	c.gate = func(ctx context.Context) (inject.Gate, string) { return webhook.APIServerGate(ctx, client) }
	for _, o := range opts {
		o(c)
	}
	return c
}

// CheckNames are the names of the checks, in the order they run; docs/troubleshooting.md has a
// section "check-cluster: NAME" for each.
var CheckNames = []string{
	"kubernetes-api", "detour-namespace", "webhook-config", "webhook-endpoints", "webhook-certificate",
	"webhook-admission", "webhook-deployment", "node-agent", "startup-taint", "ready-label", "primary-cni", "opted-in-namespaces",
	"uninjected-pods", "validator-mode", "validator", "repair", "version-skew",
}

// Run runs every check. When the API server cannot be reached, or detour's namespace is not
// there, it stops: every other check would fail the same way.
func (c *Checker) Run(ctx context.Context) Report {
	var r Report
	r.add(c.checkAPI(ctx))
	if r.Failed() {
		return r
	}
	nsResult := c.checkNamespace(ctx)
	if nsResult.Status == Error {
		r.add(nsResult)
		return r
	}
	s := c.load(ctx)
	if res, installed := c.checkInstalled(ctx, s); !installed {
		r.add(res)
		return r
	}
	r.add(nsResult)
	wh, ref, res := c.checkWebhookConfig(ctx)
	r.add(res)
	eps, res := c.checkWebhookEndpoints(ctx, ref)
	r.add(res)
	if ref != nil {
		r.add(c.checkWebhookCertificate(ctx, ref, eps))
	}
	if wh != nil && c.probe {
		r.add(c.checkAdmission(ctx, wh, s))
	}
	r.add(c.checkWebhookDeployment(s))
	r.add(c.checkNodeAgent(s))
	r.add(c.checkStartupTaint(s))
	r.add(c.checkReadyLabel(s))
	r.add(c.checkPrimaryCNI(ctx, s))
	r.add(c.checkNamespaces(s))
	r.add(c.checkUninjected(s))
	r.add(c.checkValidatorMode(ctx, s))
	r.add(c.checkValidators(s))
	r.add(c.checkRepair(ctx))
	r.add(c.checkVersionSkew(s))
	return r
}
