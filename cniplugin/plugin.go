package cniplugin

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/containernetworking/cni/pkg/skel"
	"github.com/containernetworking/cni/pkg/types"
	types100 "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/internal/fsutil"
	"github.com/detourmesh/detour/iptables"
)

// VersionInfo lists the CNI spec versions detour-cni speaks.
var VersionInfo = version.PluginSupports("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")

// Plugin implements the CNI commands. Its fields are the side effects, so tests can replace
// them; New returns the real ones.
type Plugin struct {
	Stdout io.Writer
	Stderr io.Writer
	// NewExecutor returns the iptables executor for a configuration.
	NewExecutor func(*Config) *iptables.Executor
	// NewPodGetter returns the API client for a configuration.
	NewPodGetter func(*Config) (PodGetter, error)
	// StateDir is where STATUS keeps its last outcome, so that it logs only changes (the
	// runtime calls it every few seconds); "" keeps none, and STATUS then logs only problems.
	StateDir string
}

// DefaultStateDir is the plugin's state directory on the host (a tmpfs: it starts empty after
// a reboot, and STATUS logs its first outcome again).
const DefaultStateDir = "/run/detour-cni"

// MaxLogFileSize is the size at which the plugin rotates logFile: the file is renamed to
// logFile.1 (replacing an older one) and a new one started, so the two take at most about
// twice this much.
const MaxLogFileSize = 10 << 20

// New returns the plugin with its real side effects.
func New() *Plugin {
	return &Plugin{
		Stdout: os.Stdout,
		Stderr: os.Stderr,
		NewExecutor: func(c *Config) *iptables.Executor {
			return iptables.NewExecutor(iptables.WithBackend(c.IPTablesBackend))
		},
		NewPodGetter: func(c *Config) (PodGetter, error) {
			return newAPIGetter(c.Kubeconfig, c.APITimeout)
		},
		StateDir: DefaultStateDir,
	}
}

// Funcs returns the commands for skel.PluginMainFuncs.
func (p *Plugin) Funcs() skel.CNIFuncs {
	return skel.CNIFuncs{Add: p.Add, Del: p.Del, Check: p.Check, Status: p.Status, GC: p.GC}
}

// call is one command's context: what it was asked and what it decided, for the log line.
type call struct {
	cmd      string
	args     *skel.CmdArgs
	conf     *Config
	pod      podRef
	start    time.Time
	decision string
	source   string // where the annotations came from: runtimeConfig or api
	families []iptables.Family
	warning  string // what degrades the command without failing it (STATUS, the inbound fallback)
	// inboundFallback: the kernel has no socket lookup, so every inbound connection goes to the
	// proxy although the pod asked for the listening ports only.
	inboundFallback bool
}

// podRef is the pod's identity from CNI_ARGS.
type podRef struct {
	Namespace, Name, UID string
}

func (r podRef) String() string {
	if r.Name == "" {
		return "(not a Kubernetes pod)"
	}
	return r.Namespace + "/" + r.Name
}

func parsePodRef(args string) podRef {
	var r podRef
	for kv := range strings.SplitSeq(args, ";") {
		k, v, _ := strings.Cut(kv, "=")
		switch k {
		case "K8S_POD_NAMESPACE":
			r.Namespace = v
		case "K8S_POD_NAME":
			r.Name = v
		case "K8S_POD_UID":
			r.UID = v
		}
	}
	return r
}

// run runs one command: it parses the configuration and the pod identity (begin), does the
// command's work, and logs and converts the outcome (end).
func (p *Plugin) run(cmd string, args *skel.CmdArgs, do func(*call) error) error {
	c, err := p.begin(cmd, args)
	if err == nil {
		err = do(c)
	}
	return p.end(c, err)
}

// begin parses the configuration and the pod identity of a command.
func (p *Plugin) begin(cmd string, args *skel.CmdArgs) (*call, error) {
	c := &call{cmd: cmd, args: args, start: time.Now(), pod: parsePodRef(args.Args)}
	conf, err := ParseConfig(args.StdinData)
	if err != nil {
		return c, err
	}
	c.conf = conf
	return c, nil
}

// end writes the command's one log line and turns err into the CNI error the runtime reports
// (it reaches `kubectl describe pod` through the kubelet's event).
func (p *Plugin) end(c *call, err error) error {
	level := slog.LevelInfo
	if c.conf != nil {
		level = c.conf.LogLevel
	}
	if c.cmd == "ADD" && p.StateDir != "" {
		// Counting is best effort: a state directory it cannot write must not fail the pod.
		_ = RecordAdd(p.StateDir, addResult(c.decision, err), time.Since(c.start), c.inboundFallback)
	}
	// The runtime asks for STATUS every few seconds: an outcome already logged goes to debug.
	quiet := c.cmd == "STATUS" && !p.statusChanged(c, err)
	lineLevel := slog.LevelInfo
	switch {
	case quiet:
		lineLevel = slog.LevelDebug
	case err != nil:
		lineLevel = slog.LevelError
	case c.warning != "":
		lineLevel = slog.LevelWarn
	}
	// Below the configured level nothing is written, and the log file is not even opened.
	if lineLevel >= level {
		p.logLine(c, err, level, lineLevel)
	}
	if err != nil {
		var cniErr *types.Error
		if errors.As(err, &cniErr) {
			return cniErr
		}
		return types.NewError(types.ErrInternal, err.Error(), "")
	}
	return nil
}

// logLine writes the command's one log line at lineLevel.
func (p *Plugin) logLine(c *call, err error, level, lineLevel slog.Level) {
	logger, closeLog := p.logger(c.conf, level)
	defer closeLog()
	attrs := []slog.Attr{
		slog.String("command", c.cmd),
		slog.String("pod", c.pod.String()),
		slog.String("container", c.args.ContainerID),
		slog.String("decision", c.decision),
		slog.String("duration", time.Since(c.start).Round(10*time.Microsecond).String()),
	}
	if c.source != "" {
		attrs = append(attrs, slog.String("annotations", c.source))
	}
	if len(c.families) > 0 {
		fams := make([]string, len(c.families))
		for i, f := range c.families {
			fams[i] = f.String()
		}
		attrs = append(attrs, slog.String("families", strings.Join(fams, ",")))
	}
	switch {
	case err != nil:
		attrs = append(attrs, slog.String("error", err.Error()))
	case c.warning != "":
		attrs = append(attrs, slog.String("warning", c.warning))
	}
	logger.LogAttrs(context.Background(), lineLevel, PluginType, attrs...)
}

// statusChanged reports whether this STATUS outcome differs from the last one recorded in
// StateDir, and records it. Without a usable state it counts a problem as a change and a clean
// "ready" as none, so a healthy node logs nothing and a degraded one still says why.
func (p *Plugin) statusChanged(c *call, err error) bool {
	outcome := c.decision + "\n" + c.warning
	if err != nil {
		outcome = "error: " + err.Error()
	}
	clean := err == nil && c.warning == ""
	if p.StateDir == "" {
		return !clean
	}
	if err := os.MkdirAll(p.StateDir, 0o700); err != nil {
		return !clean
	}
	wrote, werr := fsutil.WriteFileAtomic(filepath.Join(p.StateDir, "status"), []byte(outcome), 0o600)
	if werr != nil {
		return !clean
	}
	return wrote
}

// logger logs to stderr (which the runtime captures) and, when configured, to the log file.
func (p *Plugin) logger(conf *Config, level slog.Level) (*slog.Logger, func()) {
	var w io.Writer = p.Stderr
	closeLog := func() {}
	if conf != nil && conf.LogFile != "" {
		if f, err := openLogFile(conf.LogFile, MaxLogFileSize); err == nil {
			w = io.MultiWriter(p.Stderr, f)
			closeLog = func() { f.Close() }
		} else {
			fmt.Fprintf(p.Stderr, "%s: open log file %s: %v\n", PluginType, conf.LogFile, err)
		}
	}
	return slog.New(slog.NewJSONHandler(w, &slog.HandlerOptions{Level: level})), closeLog
}

// openLogFile opens path for appending. When it has reached max bytes it is first renamed to
// path.1 (replacing an older one): the plugin's log never takes more than about twice max. Of
// concurrent plugin runs, only the one holding the file's lock renames it, and only if the path
// still names the file it opened, so no run renames a file another just started.
func openLogFile(path string, max int64) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o600)
	if err != nil {
		return nil, err
	}
	st, err := f.Stat()
	if err != nil || st.Size() < max {
		return f, nil
	}
	if syscall.Flock(int(f.Fd()), syscall.LOCK_EX) == nil {
		if cur, err := os.Stat(path); err == nil && os.SameFile(cur, st) {
			_ = os.Rename(path, path+".1")
		}
		_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
	}
	f.Close()
	return os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o600)
}

// Add installs the redirect for injected pods and passes prevResult through unchanged on every
// path that succeeds. It fails closed: a pod it cannot read or whose annotations are malformed
// gets no sandbox, with a message that says what to do.
func (p *Plugin) Add(args *skel.CmdArgs) error { return p.run("ADD", args, p.add) }

func (p *Plugin) add(c *call) error {
	if err := c.conf.parsePrevResult("ADD"); err != nil {
		return types.NewError(types.ErrInvalidNetworkConfig, err.Error(), "")
	}
	rulesets, err := p.rulesFor(c)
	if err == nil && len(rulesets) > 0 {
		// A kernel without the socket lookup (xt_socket, nft_socket) refuses the inbound rule
		// that needs it: every inbound connection is redirected instead, as before that rule,
		// and the pod is recorded for the node agent to report (an Event, a metric).
		var refused error
		refused, err = p.NewExecutor(c.conf).ApplyWithInboundFallback(context.Background(), c.args.Netns, rulesets...)
		switch {
		case err != nil:
			err = redirectError(c.pod, err)
		case refused != nil:
			c.decision = "redirected"
			c.inboundFallback = true
			c.warning = fallbackWarning(refused)
			p.recordFallback(c, refused)
		default:
			c.decision = "redirected"
			p.forgetFallback(c)
		}
	}
	if err != nil {
		return err
	}
	return c.conf.PrevResult.PrintTo(p.Stdout)
}

// redirectError is the CNI error for a failed Apply: "try again later" (code 11) when another
// program held the xtables lock for longer than the tools wait, an internal error otherwise.
func redirectError(pod podRef, err error) error {
	if iptables.IsLockTimeout(err) {
		return types.NewError(types.ErrTryAgainLater, fmt.Sprintf("pod %s: install the redirect: %v; another program on the node held the xtables lock, the kubelet retries the sandbox", pod, err), "")
	}
	return fmt.Errorf("pod %s: install the redirect: %w; check that the node's iptables works (docs/troubleshooting.md)", pod, err)
}

// rulesFor decides whether the pod gets detour's rules and builds them, one ruleset per
// family; no rulesets means the pod is left alone (c.decision says why).
func (p *Plugin) rulesFor(c *call) ([]iptables.Ruleset, error) {
	switch {
	case c.pod.Name == "" || c.pod.Namespace == "":
		c.decision = "skipped: no K8S_POD_NAMESPACE/K8S_POD_NAME in CNI_ARGS"
		return nil, nil
	case slices.Contains(c.conf.ExcludeNamespaces, c.pod.Namespace):
		c.decision = "skipped: namespace excluded"
		return nil, nil
	}
	podAnnotations, err := p.annotations(c)
	if err != nil {
		return nil, err
	}
	if !annotations.IsInjected(podAnnotations) {
		c.decision = "skipped: not injected"
		return nil, nil
	}
	redirect, err := annotations.ParseRedirect(podAnnotations)
	if err != nil {
		return nil, types.NewError(types.ErrInvalidNetworkConfig, fmt.Sprintf(
			"pod %s: %v; these annotations are written by the detour webhook: recreate the pod (for example kubectl rollout restart) so the webhook writes them again, and remove any hand-written detour.dev/ values from its template",
			c.pod, err), "")
	}
	c.families = []iptables.Family{iptables.IPv4}
	if c.conf.IPv6 == IPv6Always || hasIPv6(c.conf.PrevResult) {
		c.families = append(c.families, iptables.IPv6)
	}
	rulesets, err := iptables.BuildFamilies(redirect, c.families...)
	if err != nil {
		return nil, fmt.Errorf("pod %s: %w", c.pod, err)
	}
	return rulesets, nil
}

// annotations returns the pod's annotations: from runtimeConfig when the runtime passed them,
// else from one GET of the pod.
func (p *Plugin) annotations(c *call) (map[string]string, error) {
	if c.conf.PodAnnotations != nil {
		c.source = "runtimeConfig"
		return c.conf.PodAnnotations, nil
	}
	c.source = "api"
	if c.conf.Kubeconfig == "" {
		return nil, types.NewError(types.ErrInvalidNetworkConfig, fmt.Sprintf(
			"pod %s: the runtime did not pass the pod's annotations (capability %s) and no kubeconfig is configured to read them; set \"kubeconfig\" in the %s conflist entry (detour install-cni does)",
			c.pod, PodAnnotationsCapability, PluginType), "")
	}
	getter, err := p.NewPodGetter(c.conf)
	if err != nil {
		return nil, types.NewError(types.ErrTryAgainLater, fmt.Sprintf("pod %s: %v; check the kubeconfig written by detour install-cni", c.pod, err), "")
	}
	meta, err := getter.GetPod(context.Background(), c.pod.Namespace, c.pod.Name)
	switch {
	case errors.Is(err, errPodNotFound):
		return nil, types.NewError(types.ErrTryAgainLater, fmt.Sprintf("pod %s: %v; if it was just deleted this error goes away, otherwise check that the kubeconfig points at this cluster", c.pod, err), "")
	case err != nil:
		return nil, types.NewError(types.ErrTryAgainLater, fmt.Sprintf(
			"pod %s: %v; detour-cni fails closed rather than start the pod without its redirect: check that the API server is reachable from the node and that the kubeconfig is valid — the kubelet retries the sandbox",
			c.pod, err), "")
	case c.pod.UID != "" && meta.UID != c.pod.UID:
		return nil, types.NewError(types.ErrTryAgainLater, fmt.Sprintf(
			"pod %s: the API server has UID %s but the runtime is creating a sandbox for UID %s (the pod was replaced); the kubelet retries with the current pod",
			c.pod, meta.UID, c.pod.UID), "")
	}
	return meta.Annotations, nil
}

func hasIPv6(r types.Result) bool {
	res, err := types100.NewResultFromResult(r)
	if err != nil {
		return false
	}
	for _, ip := range res.IPs {
		if ip.Address.IP.To4() == nil {
			return true
		}
	}
	return false
}

// Del removes detour's rules from the namespace if it still exists. It needs neither the pod
// nor prevResult, succeeds when the namespace or the pod is gone, and can run any number of
// times.
func (p *Plugin) Del(args *skel.CmdArgs) error { return p.run("DEL", args, p.del) }

func (p *Plugin) del(c *call) error {
	p.forgetFallback(c)
	if c.args.Netns == "" {
		c.decision = "nothing to do: no network namespace"
		return nil
	}
	if _, err := os.Stat(c.args.Netns); err != nil {
		c.decision = "nothing to do: network namespace is gone"
		return nil
	}
	if c.conf.PodAnnotations != nil && !annotations.IsInjected(c.conf.PodAnnotations) {
		c.decision = "nothing to do: not injected"
		return nil
	}
	c.families = []iptables.Family{iptables.IPv4, iptables.IPv6}
	if err := p.NewExecutor(c.conf).Remove(context.Background(), c.args.Netns, c.families...); err != nil {
		if _, statErr := os.Stat(c.args.Netns); statErr != nil {
			c.decision = "nothing to do: network namespace is gone"
			return nil // it vanished while we worked
		}
		return fmt.Errorf("pod %s: remove the redirect: %w", c.pod, err)
	}
	c.decision = "removed"
	return nil
}

// Check verifies that an injected pod's namespace holds exactly the rules ADD installed and
// fails with the first difference in words.
func (p *Plugin) Check(args *skel.CmdArgs) error { return p.run("CHECK", args, p.check) }

func (p *Plugin) check(c *call) error {
	if err := c.conf.parsePrevResult("CHECK"); err != nil {
		return types.NewError(types.ErrInvalidNetworkConfig, err.Error(), "")
	}
	rulesets, err := p.rulesFor(c)
	if err != nil || len(rulesets) == 0 {
		return err
	}
	// ADD falls back to redirecting every inbound connection where the kernel refused the
	// socket lookup: those rules, marked as the fallback, are the ones it installed. A pod a
	// newer webhook injected while the node still ran detour-cni v0.1.0 has that plugin's rules.
	how, err := p.NewExecutor(c.conf).CheckInstalled(context.Background(), c.args.Netns, rulesets...)
	switch {
	case err != nil:
		return fmt.Errorf("pod %s: the redirect is not as installed: %w; recreate the pod to reinstall it", c.pod, err)
	case how == iptables.InboundFallbackInstalled:
		c.decision = "rules match (the inbound fallback ADD installed: every inbound connection)"
	case how == iptables.V010Installed:
		c.decision = "rules match (detour-cni v0.1.0's, installed before this plugin: every inbound connection)"
	default:
		c.decision = "rules match"
	}
	return nil
}

// Status reports whether the plugin can work on this node. The runtime calls it every few
// seconds and a failure marks the whole node's network not ready, so it fails only for what
// breaks ADD for every pod — a configuration it cannot parse (begin fails) — and reports what
// breaks injected pods only (no usable iptables, a kubeconfig it cannot load, which pods whose
// annotations come from the runtime do not even need) as a warning in its log. It logs only a
// change of outcome.
func (p *Plugin) Status(args *skel.CmdArgs) error { return p.run("STATUS", args, p.status) }

func (p *Plugin) status(c *call) error {
	var warnings []string
	ex := p.NewExecutor(c.conf)
	if err := ex.Usable(iptables.IPv4); err != nil {
		warnings = append(warnings, fmt.Sprintf("injected pods cannot get their redirect (their ADD fails): %v", err))
	} else if b := ex.Backend(); b == iptables.BackendLegacy || b == iptables.BackendNFT {
		// Every injected pod gets IPv4 rules; a pod with an IPv6 address IPv6 ones too, with
		// tools of their own (nf_tables answers both families alike).
		if err := ex.Usable(iptables.IPv6); err != nil {
			warnings = append(warnings, fmt.Sprintf("injected pods with an IPv6 address cannot get their redirect (their ADD fails): %v; install the ip6tables tools on the node (Debian's iptables package has both), or set the plugin's iptablesBackend to nftables", err))
		}
	}
	if c.conf.Kubeconfig != "" {
		if _, err := p.NewPodGetter(c.conf); err != nil {
			warnings = append(warnings, fmt.Sprintf("injected pods whose annotations the runtime does not pass cannot be read (their ADD fails): %v; detour install-cni writes it — is the node agent running?", err))
		}
	}
	c.decision = "ready"
	c.warning = strings.Join(warnings, "; ")
	return nil
}

// GC has nothing to collect: detour's only state is iptables rules inside pod network
// namespaces, which go away with the namespaces. There are no files, IP allocations or host
// rules that a lost DEL could leak.
func (p *Plugin) GC(args *skel.CmdArgs) error {
	return p.run("GC", args, func(c *call) error {
		c.decision = "nothing to collect"
		return nil
	})
}
