package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/go-logr/logr"
	"github.com/spf13/pflag"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/detourmesh/detour/internal/version"
)

// What the long-running commands (webhook, install-cni, repair) share: the logging flags and
// their set-up, the API client, and the HTTP endpoints for probes and metrics. Each takes the
// same flag names for the same things.

// logFlags are the logging flags of a long-running command.
type logFlags struct{ level, format string }

// add registers --log-level and --log-format; format is the command's default format.
func (l *logFlags) add(fl *pflag.FlagSet, format string) {
	fl.StringVar(&l.level, "log-level", "info", "debug, info, warn or error")
	fl.StringVar(&l.format, "log-format", format, "json or text")
}

// setUp returns the command's structured logger on w, and makes it the logger of client-go
// (klog) and controller-runtime too, so that every line the process writes has one format —
// unless the command runs embedded ([Embedded]): the process's loggers are its host's.
func (l logFlags) setUp(ctx context.Context, w io.Writer) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(l.level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: use debug, info, warn or error", l.level)
	}
	opts := &slog.HandlerOptions{Level: level}
	var log *slog.Logger
	switch strings.ToLower(l.format) {
	case "json":
		log = slog.New(slog.NewJSONHandler(w, opts))
	case "text":
		log = slog.New(slog.NewTextHandler(w, opts))
	default:
		return nil, fmt.Errorf("--log-format %q: use json or text", l.format)
	}
	if embeddedIn(ctx) == nil {
		bridge := logr.FromSlogHandler(log.Handler())
		ctrllog.SetLogger(bridge)
		klog.SetLogger(bridge)
	}
	return log, nil
}

// restConfig is command's API client configuration: the embedding program's ([Embedded]),
// else from --kubeconfig, else $KUBECONFIG (or ~/.kube/config), else the pod's service
// account; its user agent names command.
func restConfig(ctx context.Context, kubeconfig, command string) (*rest.Config, error) {
	if e := embeddedIn(ctx); e != nil {
		rc := rest.CopyConfig(e.API)
		rc.UserAgent = userAgent(command)
		return rc, nil
	}
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = kubeconfig
	rc, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{}).ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("configure the API client: %w (outside a pod, set --kubeconfig or $KUBECONFIG)", err)
	}
	rc.UserAgent = userAgent(command)
	return rc, nil
}

// Embedded is how a program that runs detour's commands in its own process, many at once
// (the scale harness, test/scale: a node agent per simulated node), runs each: with its own API
// client configuration instead of --kubeconfig's, and without taking over the process-wide
// loggers. Pass it with [WithEmbedded] to the command's ExecuteContext.
type Embedded struct {
	// API is the command's API client configuration; the command copies it and sets its own
	// user agent.
	API *rest.Config
}

type embeddedKey struct{}

// WithEmbedded returns ctx carrying e, for (*cobra.Command).ExecuteContext.
func WithEmbedded(ctx context.Context, e Embedded) context.Context {
	return context.WithValue(ctx, embeddedKey{}, &e)
}

func embeddedIn(ctx context.Context) *Embedded {
	if ctx == nil {
		return nil
	}
	e, _ := ctx.Value(embeddedKey{}).(*Embedded)
	return e
}

// userAgent is the user agent of command's API requests, "detour-<command>/<version>": the API
// server's audit log and metrics tell detour's parts apart by it (the node agent's install-cni
// and repair containers share one service account).
func userAgent(command string) string {
	return "detour-" + command + "/" + version.Version
}

// kubeClient is a client-go clientset from [restConfig].
func kubeClient(ctx context.Context, kubeconfig, command string) (kubernetes.Interface, error) {
	rc, err := restConfig(ctx, kubeconfig, command)
	if err != nil {
		return nil, err
	}
	return kubernetes.NewForConfig(rc)
}

// endpoint is an HTTP handler and the address it is served at.
type endpoint struct {
	addr string
	h    http.Handler
}

// serveHTTP serves each endpoint until stop is called; an endpoint with an empty address is
// not served.
func serveHTTP(log *slog.Logger, endpoints ...endpoint) (stop func(), err error) {
	var servers []*http.Server
	stop = func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		for _, srv := range servers {
			if err := srv.Shutdown(ctx); err != nil {
				log.Warn("stop the HTTP server", "addr", srv.Addr, "err", err)
			}
		}
	}
	for _, e := range endpoints {
		if e.addr == "" {
			continue
		}
		ln, err := net.Listen("tcp", e.addr)
		if err != nil {
			stop()
			return nil, fmt.Errorf("listen on %s for probes and metrics: %w (choose another address with the flag)", e.addr, err)
		}
		srv := &http.Server{Addr: ln.Addr().String(), Handler: e.h, ReadHeaderTimeout: 5 * time.Second}
		servers = append(servers, srv)
		go func() {
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				log.Error("HTTP server stopped", "addr", srv.Addr, "err", err)
			}
		}()
		log.Info("serving", "addr", srv.Addr)
	}
	return stop, nil
}
