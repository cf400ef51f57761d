#!/usr/bin/env bash
# Writes the tools module that builds one Kubernetes release's node and control-plane commands
# (kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy, kubelet) for the version
# matrix (make e2e-versions): hack/tools/kubernetes-versions/vX.Y/go.mod requires
# k8s.io/kubernetes at the release and replaces each of its staging modules (which its own go.mod
# points at ./staging) with the release's published module, then go mod tidy pins the rest.
# Run it once per new release and commit the result; hack/test-binaries.sh builds from it.
#   hack/tools/kubernetes-versions/new.sh v1.34.4
set -euo pipefail
version=${1:?usage: new.sh vX.Y.Z}
dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
minor=$(echo "$version" | sed -E 's/^v([0-9]+\.[0-9]+)\..*/v\1/')
staging=v0.${version#v1.}
out="$dir/$minor"
mkdir -p "$out"
# The release's own go.mod; downloading it succeeds even where the release needs a newer Go
# than this one (the answer then carries an error too).
modfile=$(cd "$dir/../kubernetes" && { GOFLAGS=-mod=mod GOTOOLCHAIN=local go mod download -json "k8s.io/kubernetes@$version" || true; } | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
[ -s "$modfile" ] || { echo "new.sh: cannot download k8s.io/kubernetes@$version's go.mod" >&2; exit 1; }
gover=$(awk '$1 == "go" { print $2; exit }' "$modfile")
{
	echo "module github.com/detourmesh/detour/hack/tools/kubernetes-versions/$minor"
	echo
	echo "go $gover"
	echo
	echo "tool ("
	for c in kube-apiserver kube-controller-manager kube-proxy kube-scheduler kubelet; do
		echo "	k8s.io/kubernetes/cmd/$c"
	done
	echo ")"
	echo
	echo "require k8s.io/kubernetes $version"
	echo
	echo "replace ("
	awk -v v="$staging" '$2 == "=>" && $3 ~ /^\.\/staging\// { print "\t" $1 " => " $1 " " v }' "$modfile"
	echo ")"
} >"$out/go.mod"
toolchain=local
case "$gover" in 1.2[7-9]*) toolchain=go1.27.3 ;; esac
(cd "$out" && GOFLAGS=-mod=mod GOTOOLCHAIN=$toolchain go mod tidy -e)  # -e: a test-only dependency the proxy does not serve (1.38.0-beta.0: sigs.k8s.io/iptables-wrappers) must not stop it
echo "$out/go.mod"
