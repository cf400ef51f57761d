#!/usr/bin/env bash
# Runs every Go fuzz target in the module for a while each (default 10s): make fuzz FUZZTIME=1m.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
fuzztime=${1:-10s}
for pkg in $(go list ./...); do
	dir=$(go list -f '{{.Dir}}' "$pkg")
	for target in $(grep -ho '^func Fuzz[A-Za-z0-9_]*' "$dir"/*_test.go 2>/dev/null | sed 's/^func //'); do
		echo "fuzz: $pkg $target ($fuzztime)"
		go test "$pkg" -run '^$' -fuzz "^$target\$" -fuzztime "$fuzztime"
	done
done
