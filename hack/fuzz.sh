#!/usr/bin/env bash
# Runs every Go fuzz target in the module for a while each, one after another, and ends with a
# table: package, target, fuzz time, executions, new interesting inputs, crash (with the failing
# input's path). Exits nonzero if any target crashed or failed to run, after running them all.
#
#   hack/fuzz.sh [FUZZTIME [FUZZPARALLEL [FUZZMINIMIZETIME]]]   (make fuzz FUZZTIME=2m FUZZPARALLEL=1)
#
# FUZZTIME defaults to 10s; FUZZPARALLEL (fuzz workers, go test -parallel) defaults to Go's
# default, GOMAXPROCS; FUZZMINIMIZETIME (go test -fuzzminimizetime, per new input) to Go's, 60s.
# FUZZMATCH, in the environment, is an extended regular expression: only the targets whose
# "package target" (e.g. "webhook FuzzDeepEqual") it matches run.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
fuzztime=${1:-10s}
parallel=${2:-}
minimize=${3:-}
match=${FUZZMATCH:-}
module=$(go list -m)

parallelflag=()
if [[ -n $parallel ]]; then
	parallelflag=(-parallel "$parallel")
fi
if [[ -n $minimize ]]; then
	parallelflag+=(-fuzzminimizetime "$minimize")
fi

logdir=$(mktemp -d "${TMPDIR:-/tmp}/detour-fuzz.XXXXXX")
rows=()
failed=0
start=$(date +%s)
for pkg in $(go list ./...); do
	dir=$(go list -f '{{.Dir}}' "$pkg")
	for target in $(grep -ho '^func Fuzz[A-Za-z0-9_]*' "$dir"/*_test.go 2>/dev/null | sed 's/^func //' | sort); do
		short=${pkg#"$module"/}
		if [[ -n $match ]] && ! grep -Eq -- "$match" <<<"$short $target"; then
			continue
		fi
		log="$logdir/${short//\//_}.$target.log"
		echo "fuzz: $pkg $target ($fuzztime${parallel:+, -parallel $parallel}${minimize:+, -fuzzminimizetime $minimize})"
		go test "$pkg" -run '^$' -fuzz "^$target\$" -fuzztime "$fuzztime" "${parallelflag[@]}" 2>&1 | tee "$log"
		rc=${PIPESTATUS[0]}
		# The last progress line carries the totals:
		# "fuzz: elapsed: 2m0s, execs: 1234567 (10288/sec), new interesting: 12 (total: 80)".
		last=$(grep -E '^fuzz: elapsed: .*execs: ' "$log" | tail -n 1)
		execs=$(sed -nE 's/.*execs: ([0-9]+).*/\1/p' <<<"$last")
		newint=$(sed -nE 's/.*new interesting: ([0-9]+).*/\1/p' <<<"$last")
		total=$(sed -nE 's/.*\(total: ([0-9]+)\).*/\1/p' <<<"$last")
		input=$(sed -nE 's/.*Failing input written to (.*)$/\1/p' "$log" | tail -n 1)
		if [[ $rc -eq 0 ]]; then
			crash=0
		elif [[ -z $input ]] && tail -n 6 "$log" | grep -q '^    context deadline exceeded$'; then
			# Go's fuzz coordinator (before Go 1.27) can report the end of -fuzztime itself as a
			# failure when a worker is starved at that moment (go.dev/issue/75804): no input
			# failed, so it is no crash.
			crash="0 (\"context deadline exceeded\" at the end, no failing input: go.dev/issue/75804)"
		elif [[ -n $input ]]; then
			crash="1 (${short}/${input})"
			failed=1
		else
			crash="error (see $log)"
			failed=1
		fi
		rows+=("| \`$short\` | \`$target\` | $fuzztime | ${execs:-?} | ${newint:-?} (corpus ${total:-?}) | $crash |")
	done
done
elapsed=$(( $(date +%s) - start ))

echo
echo "fuzz summary: go test -fuzz, -fuzztime $fuzztime${parallel:+, -parallel $parallel}${minimize:+, -fuzzminimizetime $minimize}, $(go version | cut -d' ' -f3), $(date -u +%Y-%m-%dT%H:%MZ), ${elapsed}s in all; logs in $logdir"
echo
echo "| package | target | fuzz time | executions | new interesting inputs | crash |"
echo "|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
if [[ $failed -ne 0 ]]; then
	echo
	echo "fuzz: at least one target crashed or failed; a crash's input is in the package's testdata/fuzz/ and re-runs with go test -run=TARGET/NAME"
fi
exit "$failed"
