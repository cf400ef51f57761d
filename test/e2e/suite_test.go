package e2e

import (
	"context"
	"os"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/detourmesh/detour/test/e2e/framework"
)

// The e2e suite shares one node between its stories, in the order a cluster lives them: a new
// node joins tainted, detour is installed, workloads run, the node breaks and is repaired,
// detour is uninstalled and installed again from install.yaml. TestMain stops the node.
//
// go test runs a package's tests in the order of their files (by name) and declarations. The
// tests that start nodes of their own (TestE2ECluster, TestE2EFlannel, the harness's
// TestIntegrationNode* tests) and TestConformance, which registers the shared node without
// the startup taint, are in files that sort before this one, so they run before TestE2E starts
// the shared node: two nodes take the same addresses (framework.OwnEnv fails when the shared
// one runs already). A new test with a node of its own goes in such a file too.

// TestMain serves as a node's namespace holder when asked, runs the tests, and stops the
// shared node (framework.Run).
func TestMain(m *testing.M) { os.Exit(framework.Run(m)) }

// TestE2E runs the user stories on the real node, in the order a cluster lives them. Each
// story is a subtest, a function of the file of its area; a later one relies on what the
// earlier ones installed.
func TestE2E(t *testing.T) {
	e := framework.SetUp(t)
	ctx, cancel := framework.Context(t, e.Node, 35*time.Minute)
	defer cancel()
	runStories(t, ctx, e, []story{
		{"seed000/pods-wait-for-the-agent", seed000Startup},
		{"seed003/demo-container-mode", seed003Demo},
		{"seed003/image-users-keep-egress", seed003ImageUsers},
		{"seed003/native-sidecar-job", seed003NativeJob},
		{"validator/in-the-proxys-start", validatorInTheProxysStart},
		{"validator/debug-container-captured", validatorDebugContainer},
		{"validator/init-container-where-image-volumes-are-not-possible", validatorWhereImageVolumesAreNotPossible},
		{"validator/hook-gate-fails-closed", validatorHookGateFailsClosed},
		{"validator/slow-proxy-behind-the-hook", validatorSlowProxy},
		{"haproxy/smoke", haproxySmoke},
		{"podsecurity/restricted-namespace", podSecurityRestricted},
		{"inbound/probes-meet-the-app", inboundProbesMeetTheApp},
		{"inbound/every-backend", inboundEveryBackend},
		{"seed003/user-namespaces", seed003UserNamespaces},
		{"seed002/no-nsenter-on-the-runtime-path", seed002NoNsenter},
		{"runtime/annotations-from-the-runtime", runtimeAnnotations},
		{"kubectl/warnings", kubectlWarnings},
		{"badinput/kubectl-apply", badInput},
		{"check/cluster-healthy", checkClusterHealthy},
		{"node/agent-follows-the-node", agentFollowsTheNode},
		{"monitoring/alerts-fire-and-resolve", alertsFireAndResolve},
		{"seed000/repair-after-the-node-broke", seed000Repair},
		{"seed000/jobs-complete-after-the-node-broke", seed000Jobs},
		{"dropin/survives-the-primary-rewriting-its-conflist", dropInSurvivesRewrites},
		{"cluster", clusterSmoke},
		{"services/cluster-ip-and-dns", servicesAndDNS},
		{"mesh-wide/every-namespace", meshWide},
		{"conformance/smoke", conformanceSmoke},
		{"uninstall/helm", uninstallHelm},
		{"install/manifest", installManifest},
		{"upgrade/from-the-previous-release", upgradeSmoke},
	})
}

// story is one user story on the real node, a function of the file of its area.
type story struct {
	name string
	run  func(*testing.T, context.Context, *framework.Env)
}

// runStories runs stories in order, each a subtest; it stops after a failed one once ctx has
// ended (what follows would only wait out its time).
func runStories(t *testing.T, ctx context.Context, e *framework.Env, stories []story) {
	for _, s := range stories {
		if !t.Run(s.name, func(t *testing.T) { s.run(t, ctx, e) }) && ctx.Err() != nil {
			return
		}
	}
}

// TestSoak is the reliability soak of issue 14 (docs/reliability.md): on the real node, with
// detour installed from its chart (two webhook replicas), Deployments scaled up and down in
// waves of 20 pods, Jobs and a few bare pods, while faults hit the node at seeded random
// moments — the node agent's pod deleted, containerd, the kubelet and kube-apiserver restarted,
// a webhook replica deleted, the webhook's serving certificate rotated, the primary CNI
// rewriting its conflist, a node reboot. Every injected pod that goes Ready is proven captured
// by a real inbound connection; the test fails when one ran its app without the redirect
// while its validator passed, when repair deleted a bare pod, when a pod admitted uninjected
// is not reported by `detour check --cluster`, or when anything of a deleted pod stays on the
// node. It prints a table of every figure at the end.
//
// It is declared here, after TestE2E, because go test runs a package's tests in the order of
// their files and declarations: the stories begin on a node that still carries its startup
// taint, which the soak's node agent removes.
//
// SOAK_DURATION (default 2m: the short form that `make e2e` runs) sets its length, split in
// two phases: the webhook's failurePolicy Fail, then Ignore; `make soak` runs 10m. SOAK_SEED
// replays a fault schedule.
func TestSoak(t *testing.T) {
	e := framework.SetUp(t)
	cfg := soakConfigFromEnv(t)
	// Beyond the duration: the faults' recovery, each phase's settling (up to 10 minutes),
	// the checks at the end. On a machine shared with other runs all of them stretch.
	ctx, cancel := framework.Context(t, e.Node, cfg.duration+50*time.Minute)
	defer cancel()
	// After TestE2E, `kubectl delete -f install.yaml` may still be deleting detour's namespace.
	framework.WaitFor(t, ctx, "namespace "+framework.DetourNamespace+" to finish terminating", 3*time.Minute, func() (bool, error) {
		ns, err := e.Node.Client.CoreV1().Namespaces().Get(ctx, framework.DetourNamespace, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		if err != nil {
			return false, err
		}
		return ns.DeletionTimestamp == nil, framework.Seen("namespace %s: %s since %s", ns.Name, ns.Status.Phase, ns.DeletionTimestamp)
	})
	values, config := "webhook: {replicas: 2}\n", e.DropInPath()
	if cfg.configMode == "chained-entry" {
		values += "nodeAgent: {cniConfigMode: chained-entry}\n"
		config = e.Node.PrimaryConfigPath()
	}
	e.InstallDetour(t, ctx, values)
	e.SetAgent(t, ctx, true)
	e.WaitDetourConfigs(t, ctx, "detour's configuration to be in place, once", config)
	if cfg.configMode == "chained-entry" {
		// What follows the soak (a later test, or TestSoak again) expects the default.
		defer e.InstallDetour(t, ctx, "")
	}

	s := newSoak(t, e, cfg)
	if err := s.run(ctx); err != nil {
		// A fault that failed: what follows would wait on a node that cannot recover.
		s.mu.Lock()
		s.logFaults()
		s.mu.Unlock()
		t.Fatal(err)
	}
	s.finish(ctx)
}
