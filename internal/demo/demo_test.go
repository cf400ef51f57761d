package demo

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/detourmesh/detour/test/testenv"
)

func TestMain(m *testing.M) {
	if ChildMain() {
		return
	}
	testenv.Main(m)
}

// The demo (make demo) runs end to end and tells the story it should: the exempt init container
// reaches the network, the app is captured, the pod without exemptions fails as in seed 003.
func TestIntegrationDemo(t *testing.T) {
	testenv.Privileged(t)
	testenv.LockHost(t) // its bridge and veths are in the host's network namespace
	for _, bin := range []string{"kube-apiserver", "etcd", "bridge", "host-local"} {
		testenv.Binary(t, bin)
	}
	// Built before the demo's own three minutes start: on a cold build cache, under the load of
	// the other packages' tests, the builds alone took most of them.
	detour, detourCNI := testenv.Build(t, "cmd/detour"), testenv.DetourCNI(t)
	var out bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	err := Run(ctx, Options{
		Out:        &out,
		Detour:     detour,
		DetourCNI:  detourCNI,
		TestBinDir: testenv.BinDir(),
		Workload:   "../../testdata/workloads/demo.yaml",
	})
	t.Log(out.String())
	if err != nil {
		t.Fatalf("the demo failed: %v", err)
	}
	for _, want := range []string{
		`Warning: detour: init container "fetch" runs as root; it keeps egress through GID`,
		"node agent appended detour-cni to it",
		"the redirect is in place",
		"init container fetch (uid 0 gid 26", // its dedicated GID from the reserved range
		"directly: 200 OK",
		"was captured: the proxy's :4140 listener got it, original destination",
		"reached the proxy's inbound listener",
		"connect: connection refused",
		"detour install-cni --uninstall removed the entry",
		"every step did what it should",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the demo's story lacks %q", want)
		}
	}
}
