module github.com/detourmesh/detour/hack/tools/prometheus-operator

go 1.26.0

// Only the module's CustomResourceDefinitions (example/prometheus-operator-crd) are used: the
// chart tests validate the ServiceMonitor, PodMonitor and PrometheusRule against them.
require github.com/prometheus-operator/prometheus-operator v0.85.0
