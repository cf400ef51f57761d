// Package clustercheck is `detour check --cluster`: it reads an installed cluster through the
// API server — the webhook's configuration, Service, certificate and Deployment, the node
// agent's DaemonSet, the nodes' startup taint and ready label, opted-in namespaces, injected
// pods whose validator failed and the repair controller's Events — and reports one [Result]
// per check, with the fix and a link to the documentation when something is wrong.
package clustercheck
