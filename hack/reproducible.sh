#!/usr/bin/env bash
# Two builds of this commit give the same bytes (make reproducible; CI): make build twice — the
# second from an empty Go build cache, so that every package is compiled again — then detour's
# image from each (hack/image). Fails unless the binaries and the image digests are identical.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
make -s build BIN="$tmp/a"
start=$SECONDS
GOCACHE="$tmp/gocache" make -s build BIN="$tmp/b"
cold=$((SECONDS - start))
sums=()
for f in detour detour-cni; do
	a=$(sha256sum <"$tmp/a/$f" | cut -d' ' -f1)
	b=$(sha256sum <"$tmp/b/$f" | cut -d' ' -f1)
	if [ "$a" != "$b" ]; then
		echo "reproducible: $f differs between two builds of this commit (sha256 $a, $b): compare them with 'go version -m' and diffoscope" >&2
		exit 1
	fi
	sums+=("$f sha256:$a")
done
version=$("$tmp/a/detour" --version | awk '{print $3}')
digest() { go run ./hack/image --bin "$1" --version "$version" --out "$1.tar" | grep -o 'sha256:[0-9a-f]*' | head -n 1; }
da=$(digest "$tmp/a")
db=$(digest "$tmp/b")
if [ -z "$da" ] || [ "$da" != "$db" ]; then
	echo "reproducible: detour's image differs between two builds of this commit ($da, $db)" >&2
	exit 1
fi
echo "reproducible: $version: ${sums[0]}, ${sums[1]} and the image $da are the same in two builds (the second compiled from an empty build cache in ${cold}s)"
