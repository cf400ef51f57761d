package nodeagent

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	authenticationv1 "k8s.io/api/authentication/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// DefaultTokenRefreshFraction is the part of a plugin token's lifetime after which the agent
// requests the next one: at 80%, a 1h token is renewed 12 minutes before it expires, leaving
// room for several retries.
const DefaultTokenRefreshFraction = 0.8

// Bounds of the backoff between failed token requests.
const (
	tokenRetryMin = time.Second
	tokenRetryMax = time.Minute
	// tokenRequestTimeout bounds one TokenRequest call.
	tokenRequestTimeout = 15 * time.Second
)

// pluginTokens holds the plugin's token, requested for its own service account through the
// TokenRequest API (default API audience), and decides when to request the next: at a
// fraction of the token's lifetime, and after a failure with exponential backoff. It is used
// by the reconcile only, from one goroutine.
type pluginTokens struct {
	client          kubernetes.Interface
	namespace, name string
	ttl             time.Duration
	fraction        float64
	now             func() time.Time
	log             *slog.Logger
	// failures counts failed requests (detour_node_plugin_token_refresh_failures_total).
	failures prometheus.Counter

	token     []byte
	expires   time.Time // the token's expirationTimestamp, as the API server returned it
	refreshAt time.Time
	retryAt   time.Time // no request before it, after a failure
	backoff   time.Duration
	lastErr   error
}

// account is the service account as people write it, for messages.
func (p *pluginTokens) account() string { return p.namespace + "/" + p.name }

// rbacHint says what the agent's service account needs to request the plugin's token.
func (p *pluginTokens) rbacHint() string {
	return fmt.Sprintf("the agent's service account needs create on serviceaccounts/token in namespace %s with resourceNames [%s]; see docs/node-agent.md", p.namespace, p.name)
}

// tokenExpiredError reports that the plugin's token expired and could not be renewed. The
// agent keeps its configuration in place (the plugin reads most pods' annotations from the
// runtime and needs no token for them) but is not ready.
type tokenExpiredError struct{ err error }

func (e *tokenExpiredError) Error() string { return e.err.Error() }
func (e *tokenExpiredError) Unwrap() error { return e.err }

// get returns the token the plugin should use now and its expiry. It requests a new one when
// there is none or the current one is due for refresh, unless a failed request asks to wait:
// then a still-valid token stays in use and a failure is logged; with no valid token it
// returns the error (a *tokenExpiredError once a token it had expired).
func (p *pluginTokens) get(ctx context.Context) ([]byte, time.Time, error) {
	now := p.now()
	if p.token != nil && now.Before(p.refreshAt) {
		return p.token, p.expires, nil
	}
	if now.Before(p.retryAt) {
		return p.current(now)
	}
	if err := p.request(ctx, now); err != nil {
		if ctx.Err() != nil {
			return nil, time.Time{}, err
		}
		if p.failures != nil {
			p.failures.Inc()
		}
		if p.backoff == 0 {
			p.backoff = tokenRetryMin
		} else {
			p.backoff = min(2*p.backoff, tokenRetryMax)
		}
		p.retryAt = now.Add(p.backoff)
		p.lastErr = err
		if p.token != nil && now.Before(p.expires) {
			p.log.Warn("could not renew the plugin's token; the current one stays in use until it expires",
				"serviceAccount", p.account(), "expires", p.expires.Format(time.RFC3339), "retryIn", p.backoff, "err", err)
		}
		return p.current(now)
	}
	p.backoff, p.retryAt, p.lastErr = 0, time.Time{}, nil
	p.log.Info("requested a token for the plugin", "serviceAccount", p.account(),
		"expires", p.expires.Format(time.RFC3339), "refreshAt", p.refreshAt.Format(time.RFC3339))
	return p.token, p.expires, nil
}

// current is the answer while a request failed: the token it holds while that is valid,
// else the last error.
func (p *pluginTokens) current(now time.Time) ([]byte, time.Time, error) {
	switch {
	case p.token != nil && now.Before(p.expires):
		return p.token, p.expires, nil
	case p.token != nil:
		return p.token, p.expires, &tokenExpiredError{fmt.Errorf("the plugin's token for service account %s expired at %s and could not be renewed (retrying in %s): %w",
			p.account(), p.expires.Format(time.RFC3339), p.retryAt.Sub(now).Round(time.Second), p.lastErr)}
	default:
		return nil, time.Time{}, fmt.Errorf("%w (retrying in %s)", p.lastErr, p.retryAt.Sub(now).Round(time.Second))
	}
}

// request asks the API server for a new token and keeps it.
func (p *pluginTokens) request(ctx context.Context, now time.Time) error {
	seconds := int64(p.ttl / time.Second)
	ctx, cancel := context.WithTimeout(ctx, tokenRequestTimeout)
	defer cancel()
	tr, err := p.client.CoreV1().ServiceAccounts(p.namespace).CreateToken(ctx, p.name, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &seconds},
	}, metav1.CreateOptions{})
	switch {
	case apierrors.IsForbidden(err):
		return fmt.Errorf("request a token for service account %s: %w (%s)", p.account(), err, p.rbacHint())
	case apierrors.IsNotFound(err):
		return fmt.Errorf("request a token for service account %s: %w (create the service account, or fix --plugin-service-account and --plugin-service-account-namespace)", p.account(), err)
	case err != nil:
		return fmt.Errorf("request a token for service account %s: %w", p.account(), err)
	case tr.Status.Token == "":
		return fmt.Errorf("request a token for service account %s: the API server returned no token", p.account())
	}
	expires := tr.Status.ExpirationTimestamp.Time
	if !expires.After(now) {
		return fmt.Errorf("request a token for service account %s: it expires at %s, which is not after this node's time %s: check the node's clock",
			p.account(), expires.Format(time.RFC3339), now.Format(time.RFC3339))
	}
	p.token, p.expires = []byte(tr.Status.Token), expires
	p.refreshAt = now.Add(time.Duration(p.fraction * float64(expires.Sub(now))))
	return nil
}

// next is when the agent must reconcile for the token's sake (refresh, retry or expiry), and
// false when nothing is scheduled (no token was asked for yet).
func (p *pluginTokens) next() (time.Time, bool) {
	switch {
	case !p.retryAt.IsZero() && p.token != nil && p.expires.After(p.now()):
		return minTime(p.retryAt, p.expires), true
	case !p.retryAt.IsZero():
		return p.retryAt, true
	case p.token != nil:
		return p.refreshAt, true
	}
	return time.Time{}, false
}

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}
