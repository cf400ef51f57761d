//go:build versions

package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/detourmesh/detour/test/e2e/framework"
	"github.com/detourmesh/detour/test/testenv"
)

// TestE2EVersions is the support matrix (issue 34; `make e2e-versions`, build tag versions): for
// each Kubernetes release users run — those of hack/tools/kubernetes-versions, built by
// hack/kubernetes-versions.sh, and the default one — a node and its control plane of that
// release (kube-apiserver, controller manager, scheduler, kubelet, kube-proxy; kubectl, etcd,
// containerd 2.4, runc and CoreDNS the default ones) run the core stories, each on a cluster of
// its own; then a kubelet is replaced in place under detour, from the oldest release to the
// default one and back (kubeletInPlace). DETOUR_E2E_KUBE_VERSIONS ("v1.34.4 v1.37.2") picks
// releases. It prints the matrix: release, stories, result, time.
//
// Its clusters are its own: go test runs it before TestE2E starts the shared node (the order of
// their files), never beside it.
func TestE2EVersions(t *testing.T) {
	versions := matrixVersions(t)
	t.Logf("releases: %v", versions)
	type row struct {
		version, result string
		passed, ran     int
		took            time.Duration
	}
	var rows []row
	stories := []story{
		{"seed000/pods-wait-for-the-agent", seed000Startup},
		{"seed003/demo-container-mode", seed003Demo},
		{"seed003/image-users-keep-egress", seed003ImageUsers},
		{"seed003/native-sidecar-job", seed003NativeJob},
		{"validator/where-auto-puts-it", versionsValidatorMode},
		{"validator/debug-container-captured", validatorDebugContainer},
		{"dropin/survives-the-primary-rewriting-its-conflist", dropInOnThisRelease},
		{"node/registered-again", nodeRegisteredAgain},
		{"seed000/repair-after-the-node-broke", seed000Repair},
	}
	for _, v := range versions {
		start := time.Now()
		r := row{version: v}
		t.Run(v, func(t *testing.T) {
			e := framework.OwnEnv(t, framework.Options{Kubernetes: v, Taints: []string{framework.StartupTaint + ":NoSchedule"}})
			ctx, cancel := framework.Context(t, e.Node, 25*time.Minute)
			defer cancel()
			for _, s := range stories {
				r.ran++
				if t.Run(s.name, func(t *testing.T) { s.run(t, ctx, e) }) {
					r.passed++
				} else if ctx.Err() != nil {
					return
				}
			}
		})
		r.took = time.Since(start)
		rows = append(rows, r)
	}
	if len(versions) > 1 {
		from, to := versions[0], versions[len(versions)-1]
		start := time.Now()
		r := row{version: "kubelet " + from + " → " + to + " → " + from + " in place, control plane " + to, ran: 1}
		t.Run("kubelet-in-place/"+from+"-"+to, func(t *testing.T) {
			e := framework.OwnEnv(t, framework.Options{Kubernetes: to, Kubelet: from, Taints: []string{framework.StartupTaint + ":NoSchedule"}})
			ctx, cancel := framework.Context(t, e.Node, 25*time.Minute)
			defer cancel()
			if t.Run("upgrade-and-downgrade", func(t *testing.T) { kubeletInPlace(t, ctx, e, from, to) }) {
				r.passed++
			}
		})
		r.took = time.Since(start)
		rows = append(rows, r)
	}
	t.Logf("support matrix, %s:", time.Now().UTC().Format(time.DateOnly))
	t.Logf("| Kubernetes | stories passed | result | time |")
	t.Logf("|---|---|---|---|")
	for _, r := range rows {
		r.result = "passed"
		if r.passed != r.ran {
			r.result = "FAILED"
		}
		t.Logf("| %s | %d of %d | %s | %s |", r.version, r.passed, r.ran, r.result, r.took.Round(time.Second))
	}
}

// matrixVersions are the releases of the matrix, oldest first: DETOUR_E2E_KUBE_VERSIONS, or each
// tools module's k8s.io/kubernetes version and the default binaries' release.
func matrixVersions(t *testing.T) []string {
	if v := strings.Fields(os.Getenv("DETOUR_E2E_KUBE_VERSIONS")); len(v) > 0 {
		return v
	}
	root, err := os.Getwd() // test/e2e
	if err != nil {
		t.Fatal(err)
	}
	mods, err := filepath.Glob(filepath.Join(root, "..", "..", "hack", "tools", "kubernetes-versions", "v1.*", "go.mod"))
	if err != nil || len(mods) == 0 {
		t.Fatalf("no tools module in hack/tools/kubernetes-versions (%v)", err)
	}
	var versions []string
	for _, m := range mods {
		for line := range strings.Lines(framework.ReadFile(m)) {
			f := strings.Fields(strings.TrimPrefix(strings.TrimSpace(line), "require "))
			if len(f) >= 2 && f[0] == "k8s.io/kubernetes" {
				versions = append(versions, f[1])
				break
			}
		}
	}
	def, err := framework.DefaultKubernetes(testenv.BinDir())
	if err != nil {
		t.Fatal(err)
	}
	return append(versions, def)
}
