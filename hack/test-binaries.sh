#!/usr/bin/env bash
# Builds the binaries the integration tests, the real-node tests and the demo run — the
# Kubernetes components (kube-apiserver, kube-controller-manager, kube-scheduler, kubelet,
# kube-proxy, kubectl), etcd, containerd (with ctr and the runc shim), runc, the reference CNI
# plugins, helm, CoreDNS, KWOK (with its stages), flannel (flanneld and its CNI plugin), and Prometheus' server and
# promtool (with the Prometheus Operator's CRDs) — each from its own Go module (pinned in hack/tools/*/go.mod) — and Kubernetes' own
# network tests (e2e.test, ginkgo, agnhost, and a Debian userland for their images), and
# caches them by version under $DETOUR_CACHE (default ~/.cache/detour). A cached binary is
# reused. A cold build of all of them took 30 minutes on 2 cores before kube-proxy, CoreDNS and
# Kubernetes' tests were added, an estimated 36 since (the Kubernetes commands in one go build,
# then e2e.test; the rest beside them).
#
# With DETOUR_BINARIES=control-plane (make demo) only kube-apiserver, etcd, the CNI plugins and
# helm are built; flannel and Cilium (cilium-agent, cilium-cni and cilium-dbg, with the
# datapath's sources and the CRDs) only with DETOUR_BINARIES=cluster (make e2e-cluster).
# Cilium's cold build took 828 s on 2 cores beside other builds (load 10 to 45; 2026-12-05).
#
# Prints the directory that holds the binaries (the last line of output), which the Makefile
# exports as DETOUR_TEST_BIN.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${DETOUR_CACHE:-$HOME/.cache/detour}

# module_version MODFILE MODULE prints the version MODFILE requires of MODULE.
module_version() {
	awk -v m="$2" '$1 == m && $2 ~ /^v/ { print $2; exit } $1 == "require" && $2 == m { print $3; exit }' "$1"
}

api=$(module_version "$root/go.mod" k8s.io/api)
kube=$(module_version "$root/hack/tools/kubernetes/go.mod" k8s.io/kubernetes)
etcd=$(module_version "$root/hack/tools/etcd/go.mod" go.etcd.io/etcd/server/v3)
plugins=$(module_version "$root/hack/tools/cni-plugins/go.mod" github.com/containernetworking/plugins)
helm=$(module_version "$root/hack/tools/helm/go.mod" helm.sh/helm/v3)
containerd=$(module_version "$root/hack/tools/containerd/go.mod" github.com/containerd/containerd/v2)
runc=$(module_version "$root/hack/tools/runc/go.mod" github.com/opencontainers/runc)
prometheus=$(module_version "$root/hack/tools/prometheus/go.mod" github.com/prometheus/prometheus)
operator=$(module_version "$root/hack/tools/prometheus-operator/go.mod" github.com/prometheus-operator/prometheus-operator)
coredns=$(module_version "$root/hack/tools/coredns/go.mod" github.com/coredns/coredns)
flannel=$(module_version "$root/hack/tools/flannel/go.mod" github.com/flannel-io/flannel)
flannelcni=$(module_version "$root/hack/tools/flannel-cni/go.mod" github.com/containernetworking/plugins)
cilium=$(module_version "$root/hack/tools/cilium/go.mod" github.com/cilium/cilium)
kwok=$(module_version "$root/hack/tools/kwok/go.mod" sigs.k8s.io/kwok)
for v in api kube etcd plugins helm containerd runc prometheus operator coredns; do
	[ -n "${!v}" ] || { echo "test-binaries: cannot read the $v version from the go.mod files" >&2; exit 1; }
done
# k8s.io/api v0.X.Y goes with Kubernetes v1.X.Y.
if [ "v1.${api#v0.}" != "$kube" ]; then
	echo "test-binaries: go.mod has k8s.io/api $api but hack/tools/kubernetes builds $kube;" \
		"set k8s.io/kubernetes to v1.${api#v0.} there (and its replaces to $api)" >&2
	exit 1
fi

bin="$cache/bin"
mkdir -p "$bin"
# One build at a time per cache: concurrent test runs (several checkouts, CI) wait for each other
# instead of writing the same binary twice.
exec 9>"$cache/.lock"
flock 9
export CGO_ENABLED=0 GOFLAGS=-mod=mod

# build NAME VERSION TOOLDIR PACKAGE [LDFLAGS] builds PACKAGE from the tools module in TOOLDIR
# into $bin/NAME-VERSION unless it is already there, then links $bin/NAME to it. $TAGS and
# $CGO_ENABLED, when set, go to that one build.
build() {
	local name=$1 version=$2 dir=$3 pkg=$4 ldflags=${5:-}
	local out="$bin/$name-$version"
	if [ ! -x "$out" ]; then
		echo "test-binaries: building $name $version from $pkg (cached afterwards in $bin)" >&2
		local start=$SECONDS
		(cd "$root/hack/tools/$dir" && go build -trimpath -tags "${TAGS:-}" -ldflags "-s -w $ldflags" -o "$out.tmp" "$pkg")
		mv -f "$out.tmp" "$out"
		echo "test-binaries: built $name in $((SECONDS - start))s" >&2
	fi
	ln -sfn "$name-$version" "$bin/$name"
}

# module_files NAME VERSION TOOLDIR MODULE FILE... copies FILEs (paths, or globs in quotes,
# inside MODULE's source as the tools module in TOOLDIR pins it) into $bin/NAME-VERSION unless it
# is there already, then links $bin/NAME to it.
module_files() {
	local name=$1 version=$2 dir=$3 module=$4
	shift 4
	local out="$bin/$name-$version"
	if [ ! -d "$out" ]; then
		local src
		src=$(cd "$root/hack/tools/$dir" && go mod download -json "$module" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
		[ -n "$src" ] || { echo "test-binaries: cannot download $module $version" >&2; exit 1; }
		rm -rf "$out.tmp"
		mkdir -p "$out.tmp"
		local f
		for f in "$@"; do
			cp $src/$f "$out.tmp/"
		done
		chmod -R u+w "$out.tmp"
		mv "$out.tmp" "$out"
	fi
	ln -sfn "$name-$version" "$bin/$name"
}

# build_kubernetes NAME... builds the Kubernetes commands NAME of version $kube that are not
# cached yet in one go build: they share most of their packages, and go links one while it
# compiles another's.
build_kubernetes() {
	local missing=() pkgs=() name
	for name in "$@"; do
		[ -x "$bin/$name-$kube" ] || { missing+=("$name"); pkgs+=("k8s.io/kubernetes/cmd/$name"); }
	done
	if [ ${#missing[@]} -gt 0 ]; then
		echo "test-binaries: building ${missing[*]} $kube from k8s.io/kubernetes (cached afterwards in $bin)" >&2
		local start=$SECONDS out
		out=$(mktemp -d "$bin/.kubernetes.XXXXXX")
		(cd "$root/hack/tools/kubernetes" && go build -trimpath -ldflags "-s -w $kubeversion" -o "$out/" "${pkgs[@]}") ||
			{ rm -rf "$out"; return 1; }
		for name in "${missing[@]}"; do mv -f "$out/$name" "$bin/$name-$kube"; done
		rm -rf "$out"
		echo "test-binaries: built ${missing[*]} in $((SECONDS - start))s" >&2
	fi
	for name in "$@"; do ln -sfn "$name-$kube" "$bin/$name"; done
}

# build_e2e_test builds Kubernetes' end-to-end tests (test/e2e, the binary the project's
# conformance run drives) with the commands' flags, so that it reuses their compiled packages.
build_e2e_test() {
	local out="$bin/e2e.test-$kube"
	if [ ! -x "$out" ]; then
		echo "test-binaries: building e2e.test $kube from k8s.io/kubernetes/test/e2e (cached afterwards in $bin)" >&2
		local start=$SECONDS
		(cd "$root/hack/tools/kubernetes" && go test -c -vet=off -trimpath -ldflags "-s -w $kubeversion" -o "$out.tmp" k8s.io/kubernetes/test/e2e)
		mv -f "$out.tmp" "$out"
		echo "test-binaries: built e2e.test in $((SECONDS - start))s" >&2
	fi
	ln -sfn "e2e.test-$kube" "$bin/e2e.test"
}

# build_rootfs writes the test images' userland: Debian bookworm (minbase) with the tools
# Kubernetes' network tests run inside their pods (sh, curl, nc, dig, nslookup, wget, getent),
# nginx, iptables (flanneld's rules, in the flannel image), and what the agnhost image adds around its binary (the user and group the tests expect,
# /uploads, /agnhost-2, porter's certificate). No container registry is reachable from the
# machines this runs on, so the images are built here (test/e2e/upstream). Needs root
# (mmdebstrap's root mode); cached by the inputs' hash.
build_rootfs() {
	local pkgs=curl,netcat-openbsd,bind9-dnsutils,iproute2,wget,socat,nginx-light,iptables
	local key out dir
	key=$(printf '%s\n' "$kube" "$(declare -f build_rootfs)" | sha256sum | cut -c1-12)
	out="$bin/debian-rootfs-$key.tar"
	if [ ! -s "$out" ]; then
		if [ "$(id -u)" -ne 0 ]; then
			echo "test-binaries: not root: the test images' userland is not built (the real-node tests it serves need root too)" >&2
			return 0
		fi
		echo "test-binaries: building the test images' Debian userland with mmdebstrap (cached afterwards in $bin)" >&2
		local start=$SECONDS
		dir=$(cd "$root/hack/tools/kubernetes" && go mod download -json k8s.io/kubernetes | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
		[ -n "$dir" ] || { echo "test-binaries: cannot download k8s.io/kubernetes $kube" >&2; return 1; }
		mmdebstrap --quiet --variant=minbase --format=tar --include="$pkgs" \
			--dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
			--dpkgopt='path-exclude=/usr/share/locale/*' \
			--customize-hook='chroot "$1" groupadd -g 50000 group-defined-in-image' \
			--customize-hook='chroot "$1" useradd -u 1000 -G group-defined-in-image user-defined-in-image' \
			--customize-hook='mkdir "$1/uploads" && ln -s agnhost "$1/agnhost-2"' \
			--customize-hook="copy-in $dir/test/images/agnhost/porter/localhost.crt $dir/test/images/agnhost/porter/localhost.key /" \
			bookworm "$out.tmp" >&2
		mv -f "$out.tmp" "$out"
		echo "test-binaries: built the userland in $((SECONDS - start))s" >&2
	fi
	ln -sfn "debian-rootfs-$key.tar" "$bin/debian-rootfs.tar"
}

# cilium_go_build builds Cilium's commands $3... of version $cilium into the directory $2, from
# the unpacked module $1 with a copy of the module's go.mod (-modfile) that takes the replaces
# of hack/tools/cilium/go.mod. The version string is what Cilium's Makefile writes: version,
# revision, author date ($CILIUM_TIME).
cilium_go_build() {
	local dir=$1 to=$2 mod r
	shift 2
	mod=$(mktemp -d)
	cp "$dir/go.mod" "$mod/cilium.mod"
	cp "$dir/go.sum" "$mod/cilium.sum"
	chmod u+w "$mod/cilium.mod" "$mod/cilium.sum"
	for r in $(cd "$root/hack/tools/cilium" && go mod edit -json | jq -r '.Replace[]? | "\(.Old.Path)@\(.Old.Version)=\(.New.Path)@\(.New.Version)"'); do
		(cd "$dir" && go mod edit -modfile="$mod/cilium.mod" -replace="$r")
	done
	(cd "$dir" && go build -modfile="$mod/cilium.mod" -trimpath -tags osusergo -o "$to/" \
		-ldflags "-s -w -X 'github.com/cilium/cilium/pkg/version.ciliumVersion=${cilium#v} $cilium $CILIUM_TIME'" "$@")
	local status=$?
	rm -rf "$mod"
	return $status
}

# build_cilium builds cilium-agent, cilium-cni and cilium-dbg of version $cilium into the
# directory $bin/cilium-$cilium, with what the agent reads at run time beside them: the
# datapath's C sources (bpf/, which the agent compiles with clang at start, as
# /var/lib/cilium/bpf in Cilium's image) and the CRDs (crds/, which Cilium's operator would
# install). Cilium's Helm chart (chart/, install/kubernetes/cilium of the module) and cilium-dbg
# (make netpol-cilium reads policy verdicts with it) go beside them too, also into a directory
# built before they were added: the e2e renders the agent's ConfigMap and RBAC from the chart.
build_cilium() {
	local out="$bin/cilium-$cilium" info dir
	if [ ! -d "$out/chart" ] || [ ! -x "$out/cilium-dbg" ]; then # (or no $out at all)
		info=$(cd "$root/hack/tools/cilium" && go mod download -json github.com/cilium/cilium) ||
			{ echo "test-binaries: cannot download github.com/cilium/cilium $cilium" >&2; return 1; }
		dir=$(jq -r .Dir <<<"$info")
		CILIUM_TIME=$(jq -r .Time "$(jq -r .Info <<<"$info")")
	fi
	if [ -d "$out" ] && [ ! -d "$out/chart" ]; then
		local tmp
		tmp=$(mktemp -d "$out/.chart.XXXXXX")
		cp -r "$dir/install/kubernetes/cilium/." "$tmp/"
		chmod -R u+w "$tmp"
		chmod 755 "$tmp"
		mv "$tmp" "$out/chart"
	fi
	if [ -d "$out" ] && [ ! -x "$out/cilium-dbg" ]; then
		echo "test-binaries: building cilium-dbg $cilium into $out" >&2
		local tmp
		tmp=$(mktemp -d "$out/.dbg.XXXXXX")
		cilium_go_build "$dir" "$tmp" ./cilium-dbg || { rm -rf "$tmp"; return 1; }
		mv "$tmp/cilium-dbg" "$out/cilium-dbg"
		rmdir "$tmp"
	fi
	if [ ! -d "$out" ]; then
		echo "test-binaries: building cilium-agent, cilium-cni and cilium-dbg $cilium from github.com/cilium/cilium (cached afterwards in $bin)" >&2
		local start=$SECONDS tmp
		tmp=$(mktemp -d "$bin/.cilium.XXXXXX")
		cilium_go_build "$dir" "$tmp" ./daemon ./plugins/cilium-cni ./cilium-dbg || { rm -rf "$tmp"; return 1; }
		mv "$tmp/daemon" "$tmp/cilium-agent"
		cp -r "$dir/bpf" "$tmp/bpf"
		cp -r "$dir/install/kubernetes/cilium" "$tmp/chart"
		mkdir "$tmp/crds"
		cp "$dir"/pkg/k8s/apis/cilium.io/client/crds/v2/*.yaml "$dir"/pkg/k8s/apis/cilium.io/client/crds/v2alpha1/*.yaml "$tmp/crds/"
		chmod -R u+w "$tmp"
		chmod 755 "$tmp"
		mv "$tmp" "$out"
		echo "test-binaries: built cilium-agent, cilium-cni and cilium-dbg in $((SECONDS - start))s" >&2
	fi
	ln -sfn "cilium-$cilium" "$bin/cilium"
}

minor=${kube#v1.}
minor=${minor%%.*}
cb=k8s.io/component-base/version
kubeversion="-X $cb.gitVersion=$kube -X $cb.gitMajor=1 -X $cb.gitMinor=$minor -X $cb.gitTreeState=clean"
kubernetes=(kube-apiserver)
if [ "${DETOUR_BINARIES:-all}" != control-plane ]; then
	# The real node (test/e2e): the rest of Kubernetes, containerd and runc.
	kubernetes+=(kubelet kube-scheduler kube-controller-manager kube-proxy kubectl)
fi

# Two lanes at once: Kubernetes, the longest build, and everything else. On 2 cores this
# overlaps one lane's module downloads and links with the other's compiling.
start=$SECONDS
(
	build_kubernetes "${kubernetes[@]}"
	if [ "${DETOUR_BINARIES:-all}" != control-plane ]; then
		build_e2e_test
		agnhost=$(cat "$(cd "$root/hack/tools/kubernetes" && go list -f '{{.Dir}}' k8s.io/kubernetes/test/images/agnhost)/VERSION")
		build agnhost "$kube" kubernetes k8s.io/kubernetes/test/images/agnhost "-X main.Version=$agnhost"
		# Runs e2e.test's tests in parallel processes (make conformance).
		build ginkgo "$(module_version "$root/hack/tools/kubernetes/go.mod" github.com/onsi/ginkgo/v2)" kubernetes github.com/onsi/ginkgo/v2/ginkgo
	fi
) &
lane=$!
# If the other lane fails, the Kubernetes build still ends (and is cached) before the script.
trap 'wait' EXIT
build etcd "$etcd" etcd go.etcd.io/etcd/server/v3
for p in main/bridge main/loopback ipam/host-local meta/portmap; do
	build "${p#*/}" "$plugins" cni-plugins "github.com/containernetworking/plugins/plugins/$p"
done
build helm "$helm" helm helm.sh/helm/v3/cmd/helm "-X helm.sh/helm/v3/internal/version.version=$helm"
if [ "${DETOUR_BINARIES:-all}" != control-plane ]; then
	ctrd=github.com/containerd/containerd/v2
	for c in containerd ctr containerd-shim-runc-v2; do
		TAGS=no_btrfs build "$c" "$containerd" containerd "$ctrd/cmd/$c" "-X $ctrd/version.Version=$containerd"
	done
	# runc needs cgo for seccomp (libseccomp-dev, from hack/host-deps.sh): the kubelet asks for
	# the RuntimeDefault profile on every sandbox, and a runc without seccomp fails them all.
	CGO_ENABLED=1 TAGS="seccomp urfave_cli_no_docs" build runc "$runc" runc github.com/opencontainers/runc \
		"-X main.version=${runc#v} -X main.gitCommit=$runc"
	# promtool tests the alert rules (manifests); the Prometheus server scrapes the real node and
	# evaluates them (test/e2e). Both have only the Kubernetes service discovery compiled in
	# (no cloud SDKs), with the same tags, so the second reuses the first's packages: 333 s for
	# both instead of 506 s without the tags (2 cores, modules downloaded, 2026-12-04).
	pv="-X github.com/prometheus/common/version.Version=${prometheus#v}"
	for cmd in promtool prometheus; do
		TAGS="remove_all_sd enable_kubernetes_sd" build "$cmd" "$prometheus" prometheus "github.com/prometheus/prometheus/cmd/$cmd" "$pv"
	done
	# The cluster's DNS (test/e2e): CoreDNS with the plugins hack/tools/coredns/main.go names.
	build coredns "$coredns" coredns . "-X github.com/coredns/coredns/coremain.GitCommit=$coredns"
	if [ "${DETOUR_BINARIES:-all}" = cluster ]; then
		# Flannel, the primary CNI of the flannel cluster (test/e2e/framework/flannel.go, make
		# e2e-cluster): flanneld, whose udp backend needs cgo (static, so that it runs on any
		# userland), and its CNI plugin, from containernetworking/plugins v0.9.1, where it lived
		# before it moved to flannel-io/cni-plugin (a module the proxy here refuses).
		CGO_ENABLED=1 TAGS="netgo osusergo" build flanneld "$flannel" flannel github.com/flannel-io/flannel \
			"-extldflags -static -X github.com/flannel-io/flannel/pkg/version.Version=$flannel"
		build flannel "$flannelcni" flannel-cni github.com/containernetworking/plugins/plugins/meta/flannel
		# Cilium, the primary CNI of the Cilium cluster (test/e2e/framework/cilium.go, issue 35).
		build_cilium
	fi
	build_rootfs
	# KWOK, the simulated nodes of the scale harness (test/scale, make scale), with the stages it
	# plays (in the module's kustomize/stage, which kwokctl compiles in and kwok does not): a node
	# made Ready and kept alive with its Lease, a pod made Running, completed and deleted.
	build kwok "$kwok" kwok sigs.k8s.io/kwok/cmd/kwok "-X sigs.k8s.io/kwok/pkg/consts.Version=$kwok"
	module_files kwok-stages "$kwok" kwok sigs.k8s.io/kwok \
		kustomize/stage/node/fast/node-initialize.yaml kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
		kustomize/stage/pod/fast/pod-ready.yaml kustomize/stage/pod/fast/pod-complete.yaml kustomize/stage/pod/fast/pod-delete.yaml
	# The Prometheus Operator's CRDs, which the chart tests validate the chart's monitors against.
	module_files prometheus-operator-crds "$operator" prometheus-operator github.com/prometheus-operator/prometheus-operator \
		'example/prometheus-operator-crd/*.yaml'
fi
wait "$lane" || { echo "test-binaries: building Kubernetes failed" >&2; exit 1; }
if [ $((SECONDS - start)) -gt 5 ]; then
	echo "test-binaries: all built in $((SECONDS - start))s" >&2
fi
echo "$bin"
