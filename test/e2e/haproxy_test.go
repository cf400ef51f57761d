//go:build haproxy

package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/detourmesh/detour/test/e2e/framework"
)

// TestE2EHAProxy runs the core stories with HAProxy, a production proxy, as the proxy of every
// meshed pod (make e2e-haproxy, issue 43): the HAProxy image with its own configuration, the
// volumes, downward-API env and start gate it needs from the webhook (framework.HAProxy). The
// stories are TestE2E's, which read the proxy through framework.Proxy; then what HAProxy itself
// needs: its volumes and env in place, and its end on SIGTERM; last, the upgrade from the
// previous release with HAProxy in every meshed pod.
func TestE2EHAProxy(t *testing.T) {
	e := framework.SetUp(t)
	if e.Proxy != framework.HAProxy {
		t.Fatalf("the run's proxy is %s: run it with DETOUR_E2E_PROXY=haproxy (make e2e-haproxy)", e.Proxy.Name)
	}
	ctx, cancel := framework.Context(t, e.Node, 30*time.Minute)
	defer cancel()
	runStories(t, ctx, e, []story{
		{"seed000/pods-wait-for-the-agent", seed000Startup},
		{"seed003/demo-container-mode", seed003Demo},
		{"seed003/image-users-keep-egress", seed003ImageUsers},
		{"seed003/native-sidecar-job", seed003NativeJob},
		{"validator/in-the-proxys-start", validatorInTheProxysStart},
		{"haproxy/what-it-needs-mounted", func(t *testing.T, ctx context.Context, e *framework.Env) {
			haproxyHasWhatItNeeds(t, ctx, e, "fold", "web")
		}},
		{"haproxy/ends-on-sigterm", haproxyEndsOnSIGTERM},
		{"inbound/probes-meet-the-app", inboundProbesMeetTheApp},
		{"seed000/repair-after-the-node-broke", seed000Repair},
		{"seed000/jobs-complete-after-the-node-broke", seed000Jobs},
		// The previous release (v0.1.0) cannot mount volumes: its pods run HAProxy with the
		// image's unmounted configuration (framework.Proxy.ForRelease), the upgraded release's
		// with the volumes.
		{"upgrade/from-the-previous-release", upgradeSmoke},
	})
}
