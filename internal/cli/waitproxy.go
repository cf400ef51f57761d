package cli

import (
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/detourmesh/detour/validator"
)

// newWaitProxyCommand returns `detour wait-proxy`, the proxy's postStart hook where the webhook's
// proxy.startGate is hook.
func newWaitProxyCommand() *cobra.Command {
	var (
		probe          string
		headers        []string
		timeout        time.Duration
		attemptTimeout time.Duration
		checkPort      uint16
	)
	cmd := &cobra.Command{
		Use:   "wait-proxy --probe=URL [flags]",
		Short: "Wait until the proxy answers its startup probe (the proxy's postStart hook: the start gate)",
		Long: `wait-proxy is the postStart hook the detour webhook gives the proxy when the redirect check runs at
the proxy's start and proxy.startGate is hook. The kubelet starts the pod's next container only once
the hook has returned, so the hook holds the pod back until the proxy answers what its startup probe
would have asked, on the pod's own addresses: a TCP connection (tcp://:PORT), or a GET answered 200-399
(http://:PORT/PATH, https://:PORT/PATH). The proxy starts only after the check passed, so an answer
also proves the redirect is in place.

With --check-port it also joins the check (an abstract unix socket of the pod's network namespace):
when the check fails it exits 1 at once with the check's message, which the kubelet shows as the
hook's error; when it goes away before the check decided (the kubelet that ran it restarted, or the
pod is being deleted), the check ends too, and the next kubelet starts the proxy again with its hook.
The proxy keeps its startup probe beside the hook: the kubelet starts the pod's next container once
both have passed.

It exits 0 once the proxy answers; 1 when the check failed, or --timeout passed first (the kubelet then
stops the proxy, records FailedPostStartHook and starts it again); 2 on bad flags. See docs/webhook.md.`,
		Example: `  # What the webhook injects for a startup probe tcpSocket 4191, period 1s, failureThreshold 30:
  /.detour/opt/detour/bin/detour wait-proxy --probe=tcp://:4191 --timeout=30s --attempt-timeout=1s --check-port=4142

  # An httpGet startup probe with a header:
  detour wait-proxy --probe=http://:15021/healthz/ready --header='X-Probe: start' --timeout=600s`,
		Args: usageArgs(cobra.NoArgs),
		RunE: func(cmd *cobra.Command, _ []string) error {
			t, err := validator.ParseTarget(probe)
			if err != nil {
				return &ExitError{Code: validator.ExitUsage, Err: err}
			}
			if len(headers) > 0 && t.Scheme == "tcp" {
				return &ExitError{Code: validator.ExitUsage, Err: fmt.Errorf("--header: a tcp probe sends no headers")}
			}
			for _, h := range headers {
				k, v, ok := strings.Cut(h, ":")
				if !ok || strings.TrimSpace(k) == "" {
					return &ExitError{Code: validator.ExitUsage, Err: fmt.Errorf("--header %q: write it as 'Name: value'", h)}
				}
				if t.Header == nil {
					t.Header = http.Header{}
				}
				t.Header.Add(strings.TrimSpace(k), strings.TrimSpace(v))
			}
			if timeout <= 0 || attemptTimeout <= 0 {
				return &ExitError{Code: validator.ExitUsage, Err: fmt.Errorf("--timeout and --attempt-timeout must be positive durations, such as 30s and 1s")}
			}
			res, err := validator.NewWaiter(validator.WaitConfig{Target: t, Timeout: timeout, AttemptTimeout: attemptTimeout, CheckPort: checkPort}).Wait(cmd.Context())
			if err != nil {
				return &ExitError{Code: validator.ExitFailure, Err: err}
			}
			fmt.Fprintln(cmd.OutOrStdout(), res)
			return nil
		},
	}
	cmd.SetFlagErrorFunc(func(_ *cobra.Command, err error) error {
		return &ExitError{Code: validator.ExitUsage, Err: err}
	})
	fl := cmd.Flags()
	fl.StringVar(&probe, "probe", "", "what to ask: tcp://:PORT, http://:PORT/PATH or https://:PORT/PATH (the proxy's startup probe)")
	fl.StringArrayVar(&headers, "header", nil, "an extra header of the GET, 'Name: value' (repeatable; the startup probe's httpHeaders)")
	fl.DurationVar(&timeout, "timeout", 0, "bound of the whole wait: the startup probe's budget (initialDelaySeconds + periodSeconds × failureThreshold)")
	fl.DurationVar(&attemptTimeout, "attempt-timeout", time.Second, "bound of one attempt: the startup probe's timeoutSeconds")
	fl.Uint16Var(&checkPort, "check-port", 0, "the port of the redirect check at the proxy's start (detour.dev/validator-check-port): join the check, fail at once with its message when it fails, and end it when this wait goes away first; 0 for none")
	cmd.MarkFlagRequired("probe")
	cmd.MarkFlagRequired("timeout")
	return cmd
}
