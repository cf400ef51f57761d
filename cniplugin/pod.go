package cniplugin

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"time"

	"github.com/detourmesh/detour/internal/ctxtime"
)

// PodMeta is what the plugin needs of a pod from the API server.
type PodMeta struct {
	UID         string
	Annotations map[string]string
}

// PodGetter reads one pod's metadata from the API server.
type PodGetter interface {
	GetPod(ctx context.Context, namespace, name string) (PodMeta, error)
}

// maxAttempts bounds the GETs of one ADD or CHECK; the API timeout bounds their total time.
const maxAttempts = 5

// apiGetter GETs pods with net/http and decodes only their metadata. The plugin runs for every
// pod on the node, so it stays away from client-go: its REST client, clientcmd and typed
// clients cost about 7 ms of every plugin start, and even its transport package (klog, HTTP/2,
// feature gates) 1.6 ms (docs/benchmarks.md). A kubeconfig's TLS settings and token are all a
// single GET needs.
type apiGetter struct {
	client  *http.Client
	host    *url.URL
	token   string
	timeout time.Duration
	source  string // the kubeconfig path, for messages
}

// newAPIGetter loads the kubeconfig at path and the files it refers to.
func newAPIGetter(path string, timeout time.Duration) (*apiGetter, error) {
	a, err := loadKubeconfig(path)
	if err != nil {
		return nil, fmt.Errorf("load kubeconfig %s: %w", path, err)
	}
	tlsConfig, token, err := a.credentials()
	if err != nil {
		return nil, fmt.Errorf("kubeconfig %s: %w", path, err)
	}
	host, err := url.Parse(a.Server)
	if err != nil || host.Host == "" {
		return nil, fmt.Errorf("kubeconfig %s: server %q is not a URL", path, a.Server)
	}
	proxy := http.ProxyFromEnvironment
	if a.ProxyURL != "" {
		u, err := url.Parse(a.ProxyURL)
		if err != nil || u.Host == "" {
			return nil, fmt.Errorf("kubeconfig %s: proxy-url %q is not a URL", path, a.ProxyURL)
		}
		proxy = http.ProxyURL(u)
	}
	transport := &http.Transport{Proxy: proxy, TLSClientConfig: tlsConfig}
	return &apiGetter{client: &http.Client{Transport: transport, Timeout: timeout}, host: host, token: token, timeout: timeout, source: path}, nil
}

// GetPod GETs the pod, retrying connection failures and server errors with backoff until
// maxAttempts or the timeout; a definite answer (found, not found, forbidden) ends it at once.
func (g *apiGetter) GetPod(ctx context.Context, namespace, name string) (PodMeta, error) {
	ctx, cancel := context.WithTimeout(ctx, g.timeout)
	defer cancel()
	u := *g.host
	u.Path = u.JoinPath("api/v1/namespaces", namespace, "pods", name).Path

	backoff := 50 * time.Millisecond
	for attempt := 1; ; attempt++ {
		meta, retry, err := g.get(ctx, u.String())
		// A server whose certificate does not verify will not verify on the next attempt.
		var verify *tls.CertificateVerificationError
		if errors.As(err, &verify) {
			return PodMeta{}, &apiError{server: g.host.String(), kubeconfig: g.source, attempts: attempt, timeout: g.timeout,
				err: fmt.Errorf("%w (check the kubeconfig's certificate-authority and tls-server-name)", err)}
		}
		if err == nil || !retry {
			return meta, err
		}
		if attempt == maxAttempts || ctxtime.Sleep(ctx, backoff) != nil {
			return PodMeta{}, &apiError{server: g.host.String(), kubeconfig: g.source, attempts: attempt, timeout: g.timeout, err: err}
		}
		backoff *= 2
	}
}

// get does one GET; retry says whether another attempt may get a different answer.
func (g *apiGetter) get(ctx context.Context, u string) (meta PodMeta, retry bool, err error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return meta, false, err
	}
	// Ask for metadata only: smaller to send and to decode.
	req.Header.Set("Accept", "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json")
	if g.token != "" {
		req.Header.Set("Authorization", "Bearer "+g.token)
	}
	resp, err := g.client.Do(req)
	if err != nil {
		return meta, true, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if err != nil {
		return meta, true, fmt.Errorf("read the response: %w", err)
	}
	switch {
	case resp.StatusCode == http.StatusOK:
		var obj struct {
			Metadata struct {
				UID         string            `json:"uid"`
				Annotations map[string]string `json:"annotations"`
			} `json:"metadata"`
		}
		if err := json.Unmarshal(body, &obj); err != nil {
			return meta, false, fmt.Errorf("decode the pod: %w", err)
		}
		return PodMeta{UID: obj.Metadata.UID, Annotations: obj.Metadata.Annotations}, false, nil
	case resp.StatusCode == http.StatusNotFound:
		return meta, false, errPodNotFound
	case resp.StatusCode == http.StatusUnauthorized || resp.StatusCode == http.StatusForbidden:
		return meta, false, fmt.Errorf("the API server refused the plugin's credentials (%s): %s; check the token and RBAC of the kubeconfig (it needs get on pods)", resp.Status, status(body))
	case resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode >= 500:
		return meta, true, fmt.Errorf("%s: %s", resp.Status, status(body))
	default:
		return meta, false, fmt.Errorf("%s: %s", resp.Status, status(body))
	}
}

// status extracts the message of a metav1.Status response body.
func status(body []byte) string {
	var s struct {
		Message string `json:"message"`
	}
	if json.Unmarshal(body, &s) == nil && s.Message != "" {
		return s.Message
	}
	if len(body) > 200 {
		body = body[:200]
	}
	return string(body)
}

var errPodNotFound = errors.New("the pod does not exist in the API server")

// apiError is a GET that never got an answer.
type apiError struct {
	server, kubeconfig string
	attempts           int
	timeout            time.Duration
	err                error
}

func (e *apiError) Error() string {
	attempts := fmt.Sprintf("%d attempts", e.attempts)
	if e.attempts == 1 {
		attempts = "1 attempt"
	}
	return fmt.Sprintf("could not read the pod from the API server at %s (kubeconfig %s) in %s within %s: %v",
		e.server, e.kubeconfig, attempts, e.timeout, e.err)
}

func (e *apiError) Unwrap() error { return e.err }
