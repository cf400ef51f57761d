# detour — see README.md. `make demo` runs the local end-to-end demo, `make test` every test;
# both do their own set-up (Debian packages, the kube-apiserver/etcd/CNI plugin builds).

# Semantic versions: the file VERSION holds the release being made (the chart's version, and
# its appVersion with a v, the image's tag); a build from the working tree is that release's
# -dev.<commit> unless VERSION=vX.Y.Z is given (a release build). hack/previous-release names
# the release before it; CHANGELOG.md lists them. COMMIT is the full hash `detour version`
# prints (with -dirty for a working tree with changes; empty outside a git checkout).
VERSION ?= v$(shell cat VERSION)-dev.$(shell git describe --always --dirty 2>/dev/null || echo unknown)
COMMIT ?= $(shell c=$$(git rev-parse HEAD 2>/dev/null) && { git diff --quiet HEAD && echo $$c || echo $$c-dirty; })
LDFLAGS := -s -w -X github.com/detourmesh/detour/internal/version.Version=$(VERSION) -X github.com/detourmesh/detour/internal/version.Commit=$(COMMIT)
GOFLAGS_BUILD := -trimpath -ldflags "$(LDFLAGS)"
export CGO_ENABLED ?= 0
BIN := bin

.PHONY: all build reproducible test e2e e2e-cluster e2e-upgrade e2e-versions e2e-haproxy e2e-dualstack scale soak conformance conformance-haproxy netpol-cilium lint fuzz bench bench-iptables bench-cni bench-webhook bench-e2e bench-datapath test-binaries demo image manifests clean

all: build

build:
	go build $(GOFLAGS_BUILD) -o $(BIN)/detour ./cmd/detour
	go build $(GOFLAGS_BUILD) -o $(BIN)/detour-cni ./cmd/detour-cni

# Two builds of this commit give the same binaries and image digest (CI runs it): the second
# build compiles every package again from an empty build cache.
reproducible:
	bash hack/reproducible.sh

# Every test, privileged ones included when run as root (CI sets DETOUR_REQUIRE_PRIVILEGED=1,
# which makes them required).
test:
	bash hack/test.sh

# The real node alone (test/e2e, also part of `make test`): etcd, kube-apiserver, the
# scheduler, the controller manager, containerd, runc and the kubelet from their Go modules,
# detour installed from its own image and chart, the user stories on real pods.
e2e:
	bash hack/test.sh ./test/e2e/...

# The cluster stories in full (issue 22; not in CI, for its time on a fresh machine): the
# bridge cluster's three-node stories (per-node scoping, rewrites on every node, drain, seed
# 000's scale-out, removal), the flannel cluster's, and the Cilium cluster's smoke (issue 35),
# each cluster its own; `make e2e` runs the bridge cluster's cross-node smoke. It builds flannel
# and Cilium besides the other test binaries, and installs clang 19 for cilium-agent.
e2e-cluster:
	DETOUR_BINARIES=cluster DETOUR_HOST_DEPS=cluster GO_TEST_TIMEOUT=$${GO_TEST_TIMEOUT:-60m} bash hack/test.sh -tags cluster -run 'TestE2ECluster|TestE2EFlannel|TestE2ECilium' ./test/e2e

# The upgrade story in full (issue 34; not in CI, whose make e2e runs its first step): the
# previous release (hack/previous-release, built from its commit in a git worktree, cached by
# commit) installed on a node of its own, then upgraded in place to the working tree with the
# chart's defaults, again with failurePolicy Fail, and rolled back with helm rollback, while
# meshed pods serve and an injected pod is created every second; the table of figures at the end.
e2e-upgrade:
	GO_TEST_TIMEOUT=$${GO_TEST_TIMEOUT:-45m} bash hack/test.sh -tags upgrade -run TestE2EUpgrade ./test/e2e

# The versions users run (issue 34; not in CI): a node and its control plane at each Kubernetes
# release of hack/tools/kubernetes-versions and the default one (1.34 to 1.37), built by
# hack/kubernetes-versions.sh (cached), each running the core stories, and a kubelet replaced
# in place from 1.34 to 1.37 and back; docs/operations.md has the support matrix.
# DETOUR_E2E_KUBE_VERSIONS picks some ("v1.34.4 v1.37.2").
e2e-versions:
	bash hack/kubernetes-versions.sh >/dev/null
	GO_TEST_TIMEOUT=$${GO_TEST_TIMEOUT:-90m} bash hack/test.sh -tags versions -run TestE2EVersions ./test/e2e

# The reliability soak on the real node (docs/reliability.md): Deployments in waves of 20 pods,
# Jobs and bare pods while faults hit the node (agent deleted, containerd, kubelet and
# kube-apiserver restarted, webhook replica deleted, certificate rotated, conflist rewritten,
# reboot), then the table of figures. `make e2e` runs its 2-minute short form; SOAK_SEED replays
# a fault schedule.
SOAK_DURATION ?= 10m
# The scale harness (docs/scale.md; CI runs its 20-node smoke, TestIntegrationScaleSmoke): the
# real API server, KWOK simulating 10, 100, 300 and 1,000 nodes, detour's node agent on each
# (in this process), the API server's audit log read for each part's requests per node; the
# table goes to bin/scale/report.md. SCALE_NODES and SCALE_STEADY change the sizes and the
# steady state's length.
SCALE_NODES ?= 10,100,300,1000
SCALE_STEADY ?= 2m
scale:
	DETOUR_TEST_BIN=$$(bash hack/test-binaries.sh | tail -n 1) go run ./hack/scale --nodes=$(SCALE_NODES) --steady=$(SCALE_STEADY) --report=bin/scale/report.md

soak:
	SOAK_DURATION=$(SOAK_DURATION) GO_TEST_TIMEOUT=$${GO_TEST_TIMEOUT:-2h} bash hack/test.sh -run TestSoak ./test/e2e

# Kubernetes' own network tests (docs/conformance.md): the [sig-network] conformance tests and
# the Services, DNS, endpoints and connectivity tests of e2e.test v1.37.2 on a two-node cluster,
# once without detour and once with detour injecting every pod; the table of both runs goes to
# bin/conformance/report.md. `make e2e` runs a smoke of five of them.
conformance:
	GO_TEST_TIMEOUT=$${GO_TEST_TIMEOUT:-4h} bash hack/test.sh -tags conformance -run TestConformance ./test/e2e

# The core stories with HAProxy as every meshed pod's proxy (issue 43; CI runs a smoke in
# make test): the HAProxy test image and configuration, with the volumes, env and start gate it
# needs from the webhook (test/e2e/framework/proxy.go). conformance-haproxy runs Kubernetes'
# sig-network selection with HAProxy in every pod.
e2e-haproxy:
	DETOUR_E2E_PROXY=haproxy GO_TEST_TIMEOUT=$${GO_TEST_TIMEOUT:-45m} bash hack/test.sh -tags haproxy -run TestE2EHAProxy ./test/e2e

conformance-haproxy:
	DETOUR_E2E_PROXY=haproxy GO_TEST_TIMEOUT=$${GO_TEST_TIMEOUT:-4h} bash hack/test.sh -tags conformance -run TestConformance ./test/e2e

# The stories of issue 44 on a node of their own whose pods and Services are IPv6 only, on an
# IPv4-only one turned dual-stack while it runs, then on one with IPv4 and IPv6 (dual stack;
# test/e2e/dualstack*_test.go): every family captured both ways, a Service of every family,
# the socket lookup over IPv6, a pod that lost one family's redirect never Ready (at the
# proxy's start and in the init container) and repaired, and core stories of TestE2E.
# `make test` (CI) runs the dual-stack capture smoke.
e2e-dualstack:
	GO_TEST_TIMEOUT=$${GO_TEST_TIMEOUT:-60m} bash hack/test.sh -tags dualstack -run 'TestE2EDualStack|TestE2EIPv6Only|TestE2EIPv4ToDualStack' ./test/e2e

# Kubernetes' NetworkPolicy tests on Cilium with every pod meshed (docs/conformance.md; not in
# CI): the [sig-network] Netpol tests of e2e.test v1.37.2 on a two-node Cilium cluster, once
# without detour and once with detour injecting every pod, each failure read against what the
# proxies carried, relabelled servers watched for 90 s, then make e2e's conformance smoke with
# every pod meshed; the table goes to bin/netpol-cilium/report.md. Builds Cilium like
# e2e-cluster.
netpol-cilium:
	DETOUR_BINARIES=cluster DETOUR_HOST_DEPS=cluster GO_TEST_TIMEOUT=$${GO_TEST_TIMEOUT:-4h} bash hack/test.sh -tags conformance -run TestNetpolCilium ./test/e2e

test-binaries:
	bash hack/test-binaries.sh

# gofmt, go vet (with the e2e's build tags too), and the dependency direction: the product
# never imports the test tree (hack/check-deps.sh).
lint:
	@unformatted=$$(gofmt -l $$(git ls-files '*.go')); \
	if [ -n "$$unformatted" ]; then echo "gofmt would change: $$unformatted"; exit 1; fi
	go vet ./...
	go vet -tags conformance,cluster,upgrade,versions,haproxy,dualstack ./test/e2e/...
	bash hack/check-deps.sh

# A run of every fuzz target (FUZZTIME each, FUZZPARALLEL workers: empty means GOMAXPROCS;
# FUZZMINIMIZETIME per new input: empty means Go's 60s; FUZZMATCH selects "package target"s),
# ending with a table (docs/fuzzing.md).
FUZZTIME ?= 10s
FUZZPARALLEL ?=
FUZZMINIMIZETIME ?=
FUZZMATCH ?=
fuzz:
	FUZZMATCH='$(FUZZMATCH)' bash hack/fuzz.sh $(FUZZTIME) '$(FUZZPARALLEL)' $(FUZZMINIMIZETIME)

bench: bench-iptables bench-cni bench-webhook bench-e2e bench-datapath

bench-iptables:
	bash hack/host-deps.sh
	go test ./iptables -run '^$$' -bench Build -count 1
	go test ./iptables -run '^$$' -bench Apply -benchtime 30x -count 1
	go test ./iptables -run '^$$' -bench NatTableExists -count 1
	go test ./iptables -run '^$$' -bench CheckNFTables -count 1
	go test ./iptables -run '^$$' -bench InboundConnection -benchtime 3000x -count 3

# The data path through HAProxy, five ways side by side in one run (no mesh, HAProxy dialled
# directly, detour's nftables and iptables-legacy rules, Linkerd's rules), and one NAT rule
# without a proxy (what a redirect costs the kernel), outbound and inbound:
# a table of connection set-up p50/p99, connections per second at 1 and 16 clients and bulk
# MiB/s (docs/benchmarks.md). DATAPATH_ROUNDS rounds of DATAPATH_CONNS connections per row.
bench-datapath:
	bash hack/host-deps.sh
	go test ./test/images -run '^$$' -bench DataPath -benchtime 1x -count 1 -timeout 2h

clean:
	rm -rf $(BIN)

# detour-cni through libcni after the reference bridge plugin: ADD/CHECK/DEL latency with and
# without detour-cni, one sandbox at a time and four at a time (BENCH_N rounds per scenario).
BENCH_N ?= 30
bench-cni:
	bash hack/host-deps.sh
	DETOUR_TEST_BIN=$$(bash hack/test-binaries.sh | tail -n 1) \
		go test ./cniplugin -run '^$$' -bench 'BenchmarkStart|BenchmarkStatus|BenchmarkChain|BenchmarkRecordAdd' -benchtime $(BENCH_N)x -count 1

# The container image, without a Docker engine (internal/image, go-containerregistry): the
# binaries of `make build` as $(IMAGE), written to $(IMAGE_TAR) for `docker load -i` or
# `ctr -n k8s.io images import`; `make image-push` pushes it with the credentials of
# `docker login`. `make docker-image` builds the same image from the Dockerfile with Docker.
IMAGE ?= ghcr.io/detourmesh/detour:$(VERSION)
IMAGE_TAR ?= $(BIN)/detour-image.tar
.PHONY: image-push docker-image
image: build
	go run ./hack/image --bin $(BIN) --version $(VERSION) --ref $(IMAGE) --out $(IMAGE_TAR)

image-push: build
	go run ./hack/image --bin $(BIN) --version $(VERSION) --ref $(IMAGE) --push

docker-image:
	docker build --build-arg VERSION=$(VERSION) -t $(IMAGE) .

# The injection webhook (docs/benchmarks-webhook.md): the mutation and admission benchmarks,
# then hack/webhook-load against `detour webhook` running on a local API server: throughput at
# concurrency 16 and latency at 500 admissions/s, over TLS, with the webhook's peak RSS.
bench-webhook: build
	DETOUR_TEST_BIN=$$(bash hack/test-binaries.sh | tail -n 1) && export DETOUR_TEST_BIN && \
	go test ./webhook -run '^$$' -bench . -benchtime 3000x -count 1 && \
	go run ./hack/webhook-load --detour=$(BIN)/detour --concurrency 16 --rate 500 --duration 20s

# Pod start latency on the real node, with detour and without (DETOUR_E2E_BENCH_PODS each,
# default 30): p50 and p99 from creation to Ready.
bench-e2e:
	bash hack/host-deps.sh
	DETOUR_TEST_BIN=$$(bash hack/test-binaries.sh | tail -n 1) PATH="$$PATH:/usr/sbin:/sbin" \
		go test ./test/e2e -run '^$$' -bench 'PodStartLatency|NodeJoin|CrossNode' -benchtime 1x -count 1 -timeout 60m

# The local end-to-end demo (the README's first command): builds everything, starts a local
# kube-apiserver + etcd, the webhook, the node agent and the plugin, and narrates each step.
# As root it plays a node in network namespaces; without root it runs the API half.
demo: build
	bash hack/host-deps.sh
	DETOUR_TEST_BIN=$$(DETOUR_BINARIES=control-plane bash hack/test-binaries.sh | tail -n 1) go run ./cmd/detour-demo

# Regenerate manifests/install.yaml from the chart (a test fails when they drift apart).
manifests:
	DETOUR_TEST_BIN=$$(bash hack/test-binaries.sh | tail -n 1) go test ./manifests -run TestInstallYAMLMatchesChart -update -count 1
