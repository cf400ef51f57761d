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
// (klog) and controller-runtime too, so that every line the process writes has one format.
func (l logFlags) setUp(w io.Writer) (*slog.Logger, error) {
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
	bridge := logr.FromSlogHandler(log.Handler())
	ctrllog.SetLogger(bridge)
	klog.SetLogger(bridge)
	return log, nil
}

// restConfig is command's API client configuration: from --kubeconfig, else $KUBECONFIG
// (or ~/.kube/config), else the pod's service account; its user agent names command.
func restConfig(kubeconfig, command string) (*rest.Config, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = kubeconfig
	rc, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{}).ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("configure the API client: %w (outside a pod, set --kubeconfig or $KUBECONFIG)", err)
	}
	rc.UserAgent = userAgent(command)
	return rc, nil
}

// userAgent is the user agent of command's API requests, "detour-<command>/<version>": the API
// server's audit log and metrics tell detour's parts apart by it (the node agent's install-cni
// and repair containers share one service account).
func userAgent(command string) string {
	return "detour-" + command + "/" + version.Version
}

// kubeClient is a client-go clientset from [restConfig].
func kubeClient(kubeconfig, command string) (kubernetes.Interface, error) {
	rc, err := restConfig(kubeconfig, command)
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
