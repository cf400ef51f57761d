#!/usr/bin/env bash
# Builds, for each Kubernetes release of the version matrix (make e2e-versions; each has its
# tools module in hack/tools/kubernetes-versions/vX.Y, written by new.sh there), the commands a
# node and its control plane run — kube-apiserver, kube-controller-manager, kube-scheduler,
# kube-proxy, kubelet — into $DETOUR_CACHE/bin as NAME-VERSION (the release's own version
# embedded), cached like hack/test-binaries.sh's. kubectl, etcd, containerd, runc and the rest
# come from hack/test-binaries.sh. A release whose go.mod names a Go newer than this machine's
# is built with that Go from the module proxy (GOTOOLCHAIN). Prints the versions it built, one
# per line. DETOUR_KUBE_VERSIONS (default: every module there) picks some, as "v1.34 v1.36".
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin=${DETOUR_CACHE:-$HOME/.cache/detour}/bin
mkdir -p "$bin"
exec 9>"$bin/../.lock-versions"
flock 9
export CGO_ENABLED=0 GOFLAGS=-mod=mod
minors=${DETOUR_KUBE_VERSIONS:-$(cd "$root/hack/tools/kubernetes-versions" && ls -d v1.* | tr '\n' ' ')}
for minor in $minors; do
	dir="$root/hack/tools/kubernetes-versions/$minor"
	version=$(awk '$1 == "require" && $2 == "k8s.io/kubernetes" { print $3 } $1 == "k8s.io/kubernetes" && $2 ~ /^v/ { print $2 }' "$dir/go.mod" | head -1)
	[ -n "$version" ] || { echo "kubernetes-versions: no k8s.io/kubernetes version in $dir/go.mod" >&2; exit 1; }
	toolchain=local
	case "$(awk '$1 == "go" { print $2; exit }' "$dir/go.mod")" in 1.2[7-9]*) toolchain=go1.27.3 ;; esac
	missing=() pkgs=()
	for name in kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubelet; do
		[ -x "$bin/$name-$version" ] || { missing+=("$name"); pkgs+=("k8s.io/kubernetes/cmd/$name"); }
	done
	if [ ${#missing[@]} -gt 0 ]; then
		echo "kubernetes-versions: building ${missing[*]} $version (cached afterwards in $bin)" >&2
		start=$SECONDS
		m=${version#v1.}
		m=${m%%.*}
		cb=k8s.io/component-base/version
		out=$(mktemp -d "$bin/.kubernetes.XXXXXX")
		(cd "$dir" && GOTOOLCHAIN=$toolchain go build -trimpath \
			-ldflags "-s -w -X $cb.gitVersion=$version -X $cb.gitMajor=1 -X $cb.gitMinor=$m -X $cb.gitTreeState=clean" \
			-o "$out/" "${pkgs[@]}") || { rm -rf "$out"; exit 1; }
		for name in "${missing[@]}"; do mv -f "$out/$name" "$bin/$name-$version"; done
		rm -rf "$out"
		echo "kubernetes-versions: built $version in $((SECONDS - start))s" >&2
	fi
	echo "$version"
done
