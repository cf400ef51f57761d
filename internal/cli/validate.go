package cli

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/detourmesh/detour/validator"
)

// newValidateCommand returns `detour validate`, the injected validator init container.
func newValidateCommand() *cobra.Command {
	f := validator.DefaultFlags()
	var hookWait time.Duration
	cmd := &cobra.Command{
		Use:   "validate [flags] [-- COMMAND [ARG...]]",
		Short: "Prove that this pod's outbound traffic is redirected to the proxy port (init container, or the proxy's start)",
		Long: `validate runs as the first init container of every pod the detour webhook injects. It listens
on the proxy's outbound port, connects to a sentinel address outside the pod, and succeeds only if the
connection comes back to its own listener — proof that the detour CNI plugin installed the redirect.

With a command after --, it runs at the start of the proxy container instead (validator.mode
image-volume): once the check passed it execs the command, which then is the same process, with its
own signals, exit code and output; when the check fails the command never starts.

Exit codes: 0 redirect in place; 42 no redirect (the detour repair controller recreates such pods);
43 another process holds the port; 2 bad flags; 1 the check could not run. See docs/validator.md.`,
		Example: `  # What the webhook injects (proxy outbound port 4140):
  detour validate --port=4140

  # Check IPv6 too, with a 3 second bound:
  detour validate --port=4140 --ipv6=always --timeout=3s

  # At the start of the proxy container: check, then become the proxy:
  /.detour/opt/detour/bin/detour validate --port=4140 -- /usr/bin/proxy --config /etc/proxy.yaml`,
		Args: usageArgs(func(cmd *cobra.Command, args []string) error {
			if len(args) > 0 && cmd.ArgsLenAtDash() != 0 {
				return fmt.Errorf("unexpected argument %q: the command to start after the check goes after --", args[0])
			}
			return nil
		}),
		RunE: func(cmd *cobra.Command, args []string) error {
			if m, ok := validator.DeprecatedIPv6[f.IPv6]; ok {
				fmt.Fprintf(cmd.ErrOrStderr(), "--ipv6=%s is deprecated, use --ipv6=%s\n", f.IPv6, m)
			}
			cfg, err := f.Parse()
			if err != nil {
				return &ExitError{Code: validator.Code(err), Err: err}
			}
			ctx := cmd.Context()
			var gate *validator.GateServer
			if len(args) > 0 {
				// At the proxy's start: the start gate's hook, where there is one, joins the
				// check and learns its verdict (validator/gatesocket.go).
				var gerr error
				if gate, ctx, gerr = validator.ListenGate(ctx, uint16(cfg.Port)); gerr != nil {
					fmt.Fprintf(cmd.ErrOrStderr(), "detour validate: %v; a start gate hook only waits for the proxy\n", gerr)
				}
			}
			res, err := validator.New(cfg).Run(ctx)
			if err != nil {
				if abort, ok := validator.Aborted(ctx); ok {
					err = abort
				}
				if gate.Verdict(err, hookWait) {
					fmt.Fprintf(cmd.ErrOrStderr(), "detour validate: the kubelet did not stop the container within %s of the start gate's hook learning that the check failed; exiting on its own\n", validator.StopWait)
				}
				return &ExitError{Code: validator.Code(err), Err: err}
			}
			gate.Verdict(nil, 0)
			fmt.Fprintln(cmd.OutOrStdout(), res)
			if len(args) == 0 {
				return nil
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s%s\n", validator.StartedMarker, args[0])
			err = validator.Exec(args) // returns only when it could not start the command
			return &ExitError{Code: validator.Code(err), Err: err}
		},
	}
	cmd.SetFlagErrorFunc(func(_ *cobra.Command, err error) error {
		return &ExitError{Code: validator.ExitUsage, Err: err}
	})
	fl := cmd.Flags()
	fl.IntVar(&f.Port, "port", f.Port, "where the redirect sends the check's connections and the check listens: the proxy's outbound port, or the check port at the proxy's start (detour.dev/validator-check-port)")
	fl.IntVar(&f.FallbackPort, "fallback-port", f.FallbackPort, "at the proxy's start: the proxy's outbound port, checked again when the connection to --port is refused (a node whose detour-cni predates the check port redirects there); 0 for none")
	fl.StringVar(&f.Sentinel, "sentinel", f.Sentinel, "IPv4 address:port outside the pod to connect to (a documentation address no network routes)")
	fl.StringVar(&f.Sentinel6, "sentinel6", f.Sentinel6, "IPv6 [address]:port outside the pod to connect to")
	fl.DurationVar(&f.Timeout, "timeout", f.Timeout, "bound of the whole check")
	fl.DurationVar(&hookWait, "hook-wait", 0, "at the proxy's start with detour's postStart hook as the start gate (detour wait-proxy): after a failed check, wait up to this long for the hook to join and take the check's message, which the kubelet then shows as the hook's error; 0 tells only a hook that has joined")
	fl.StringVar(&f.IPv6, "ipv6", f.IPv6, `check IPv6 too: "auto" (when the pod has a global IPv6 address), "always" or "never" ("on" and "off" are deprecated)`)
	return cmd
}

// usageArgs makes an argument check's error a usage error (exit code 2).
func usageArgs(check cobra.PositionalArgs) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if err := check(cmd, args); err != nil {
			return &ExitError{Code: validator.ExitUsage, Err: err}
		}
		return nil
	}
}
