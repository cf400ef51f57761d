#!/usr/bin/env bash
# The test command behind `make test`: installs what the tests need (iptables and iproute2 via
# hack/host-deps.sh, the kube-apiserver, etcd, CNI plugin and real-node binaries via
# hack/test-binaries.sh), then runs every test. With DETOUR_REQUIRE_PRIVILEGED=1 (CI) the
# machine is checked first for what the real node needs (hack/preflight: one line per missing
# thing, before half an hour of builds), a privileged test that cannot run fails instead of
# skipping, and any skipped test fails the run. GO_TEST_TIMEOUT (default 45m) is go test's
# -timeout (make soak raises it).
#
# It ends with the report of hack/testreport: one line per package, the skipped tests and why,
# and on failure each failing test's own output and the first failure's message; the full log
# is in $DETOUR_TEST_LOG (default bin/test.log).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash hack/host-deps.sh
if [ "${DETOUR_REQUIRE_PRIVILEGED:-}" = 1 ]; then
	go run ./hack/preflight
fi
DETOUR_TEST_BIN=$(bash hack/test-binaries.sh | tail -n 1)
export DETOUR_TEST_BIN PATH="$PATH:/usr/sbin:/sbin"

log=${DETOUR_TEST_LOG:-bin/test.log}
mkdir -p "$(dirname "$log")"
report=$(mktemp -d)
trap 'rm -rf "$report"' EXIT
go build -o "$report/testreport" ./hack/testreport
noskips=()
[ "${DETOUR_REQUIRE_PRIVILEGED:-}" = 1 ] && noskips=(-no-skips)
start=$SECONDS
status=0
go test -json -count=1 -timeout "${GO_TEST_TIMEOUT:-45m}" "${@:-./...}" 2>&1 |
	"$report/testreport" -log "$log" "${noskips[@]}" || status=$?
echo "test: go test took $((SECONDS - start))s; the full log is $log"
exit "$status"
