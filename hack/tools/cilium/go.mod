module github.com/detourmesh/detour/hack/tools/cilium

go 1.26.8

// Pins the Cilium that hack/test-binaries.sh builds (make e2e-cluster). It builds cilium-agent
// and cilium-cni from the unpacked module, with the module's own go.mod (and so its replace of
// sigs.k8s.io/controller-tools, which a build as a dependency would ignore), copied and given
// the replaces below (-modfile).
require github.com/cilium/cilium v1.20.2

// Cilium v1.20.2 pins gobgp at a commit the module proxy refuses ("403 Forbidden: This module
// version is not available", 2026-12-05); v4.7.0 is the release tagged the same day, after it.
replace github.com/osrg/gobgp/v4 v4.6.1-0.20260630022313-d6dee8360046 => github.com/osrg/gobgp/v4 v4.7.0
