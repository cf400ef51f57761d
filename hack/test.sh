#!/usr/bin/env bash
# The test command behind `make test`: installs what the tests need (iptables and iproute2 via
# hack/host-deps.sh, the kube-apiserver, etcd and CNI plugin binaries via hack/test-binaries.sh),
# then runs every test. With DETOUR_REQUIRE_PRIVILEGED=1 (CI) a privileged test that cannot run
# fails instead of skipping, and any skipped test fails the run. GO_TEST_TIMEOUT (default 45m) is
# go test's -timeout (make soak raises it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash hack/host-deps.sh
DETOUR_TEST_BIN=$(bash hack/test-binaries.sh | tail -n 1)
export DETOUR_TEST_BIN PATH="$PATH:/usr/sbin:/sbin"

log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
go test -count=1 -timeout "${GO_TEST_TIMEOUT:-45m}" -v "${@:-./...}" >"$log" 2>&1 || status=$?
# Show failures and the package summary, not every passing line.
grep -E '^(--- FAIL|FAIL|ok|panic|\s+--- FAIL|.*_test\.go:[0-9]+:)' "$log" || true
if [ "$status" -ne 0 ]; then
	echo "tests failed; the full log follows" >&2
	cat "$log" >&2
	exit "$status"
fi
skipped=$(grep -E -A1 -- '--- SKIP' "$log" || true)
if [ -n "$skipped" ]; then
	echo "skipped tests:"
	echo "$skipped"
	if [ "${DETOUR_REQUIRE_PRIVILEGED:-}" = 1 ]; then
		echo "test: tests were skipped while DETOUR_REQUIRE_PRIVILEGED=1; every test must run here" >&2
		exit 1
	fi
fi
echo "test: all tests passed ($(grep -c -- '--- PASS' "$log") passed, $(grep -c -- '--- SKIP' "$log" || true) skipped)"
