package framework

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/detourmesh/detour/internal/nsutil"
)

// RegistryPort is where the cluster's OCI registry listens, on the control-plane node's IP.
const RegistryPort = 5000

// Registry is the cluster's OCI registry: go-containerregistry's registry, in the test
// process, holding images and charts in memory. It listens on the underlay, in the
// control-plane node's network namespace, so every node reaches it and the host does not.
// Its address is an RFC 1918 one, which containerd (with the hosts.toml every node has),
// helm (--plain-http) and go-containerregistry speak plain HTTP to.
type Registry struct {
	// Host is host:port, the registry part of its references.
	Host string
	srv  *http.Server
	dial func(ctx context.Context, network, addr string) (net.Conn, error)
	done chan error

	mu sync.Mutex
	// slow delays the blobs of these repositories (see Slow).
	slow map[string]time.Duration
}

// Slow makes the registry serve the blobs of repository repo d late, as a remote registry's
// pull of a large image would take; 0 serves them at once again.
func (r *Registry) Slow(repo string, d time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.slow[repo] = d
}

// delay holds a blob request of a slowed repository.
func (r *Registry) delay(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		repo, _, isBlob := strings.Cut(strings.TrimPrefix(req.URL.Path, "/v2/"), "/blobs/")
		if isBlob && req.Method == http.MethodGet {
			r.mu.Lock()
			d := r.slow[repo]
			r.mu.Unlock()
			select {
			case <-time.After(d):
			case <-req.Context().Done():
				return
			}
		}
		next.ServeHTTP(w, req)
	})
}

// StartRegistry starts the cluster's registry; Close stops it.
func (cp *Node) StartRegistry() (*Registry, error) {
	host := net.JoinHostPort(cp.IP.String(), fmt.Sprint(RegistryPort))
	var ln net.Listener
	err := nsutil.Do(cp.holder.netns(), func() error {
		var err error
		ln, err = net.Listen("tcp", host)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("listen for the registry on %s in %s's namespace: %w", host, cp.Name, err)
	}
	w, err := os.OpenFile(cp.logPath("registry"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		ln.Close()
		return nil, err
	}
	r := &Registry{
		Host: host,
		dial: netnsDialer{cp.holder.netns()}.DialContext,
		done: make(chan error, 1),
		slow: map[string]time.Duration{},
	}
	r.srv = &http.Server{
		Handler:           r.delay(registry.New(registry.Logger(log.New(w, "", log.LstdFlags)))),
		ReadHeaderTimeout: 10 * time.Second,
	}
	go func() {
		err := r.srv.Serve(ln)
		w.Close()
		if errors.Is(err, http.ErrServerClosed) {
			err = nil
		}
		r.done <- err
	}()
	return r, nil
}

// Close stops the registry.
func (r *Registry) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return errors.Join(r.srv.Shutdown(ctx), <-r.done)
}

// Ref is ref (e.g. detour.test/workload:1) moved to the registry: its repository and tag
// under the registry's host (10.200.0.1:5000/workload:1).
func (r *Registry) Ref(ref string) string {
	_, rest, ok := strings.Cut(ref, "/")
	if !ok {
		rest = ref
	}
	return r.Host + "/" + rest
}

// Push uploads img as ref (a reference under Host), from the test process through the
// control-plane node's namespace.
func (r *Registry) Push(ctx context.Context, ref string, img v1.Image) error {
	parsed, err := name.ParseReference(ref)
	if err != nil {
		return err
	}
	transport := &http.Transport{DialContext: r.dial}
	defer transport.CloseIdleConnections()
	if err := remote.Write(parsed, img, remote.WithContext(ctx), remote.WithTransport(transport)); err != nil {
		return fmt.Errorf("push %s: %w", ref, err)
	}
	return nil
}

// hostsTOML is the containerd registry host configuration (certs.d/HOST/hosts.toml) that
// makes a node pull from host over plain HTTP.
func hostsTOML(host string) string {
	return fmt.Sprintf("server = %q\n\n[host.%q]\n  capabilities = [\"pull\", \"resolve\"]\n", "http://"+host, "http://"+host)
}

// PushDetourCopy pushes detour's image to r as ref (under r.Host), its configuration labelled
// dev.detour.e2e.copy=label: an image of its own, whose ID is neither the imported image's nor
// another label's copy's, so that a node pulls every blob of it.
func (e *Env) PushDetourCopy(ctx context.Context, r *Registry, ref, label string) error {
	tag, err := name.NewTag(e.Artifacts.Repo + ":" + e.Artifacts.Tag)
	if err != nil {
		return err
	}
	img, err := tarball.ImageFromPath(filepath.Join(e.Artifacts.dir, "detour.tar"), &tag)
	if err != nil {
		return fmt.Errorf("read detour's image: %w", err)
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return err
	}
	cfg = cfg.DeepCopy()
	cfg.Config.Labels = map[string]string{"dev.detour.e2e.copy": label}
	if img, err = mutate.ConfigFile(img, cfg); err != nil {
		return err
	}
	return r.Push(ctx, ref, img)
}
