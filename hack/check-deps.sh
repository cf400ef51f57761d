#!/usr/bin/env bash
# The dependency direction of the repository (make lint): the product's packages — every
# package of the module but the test tree (test/...) and the tools under hack/ — never import the
# test tree, neither directly nor through another package; the test tree imports the product.
# Tests of product packages (_test.go files) may import test/testenv: go list -deps leaves them
# out. Prints each import that breaks the rule, with the package that makes it, and exits 1.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

module=$(go list -m)
mapfile -t product < <(go list ./... | grep -v -e "^$module/test/" -e "^$module/hack/")
bad=$(go list -deps -f '{{.ImportPath}}{{range .Imports}} {{.}}{{end}}' "${product[@]}" |
	awk -v test="$module/test/" '
		index($1, test) == 1 { next }
		{ for (i = 2; i <= NF; i++) if (index($i, test) == 1) print "  " $1 " imports " $i }
	')
if [ -n "$bad" ]; then
	echo "check-deps: the product imports the test tree (test/...); move what it needs out of test/, or the importer into it:" >&2
	echo "$bad" >&2
	exit 1
fi
