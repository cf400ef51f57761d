// Command detour-cni is detour's chained CNI plugin; the container runtime runs it after the
// primary plugin for every pod sandbox. The logic lives in package cniplugin.
package main

import (
	"github.com/containernetworking/cni/pkg/skel"

	"github.com/detourmesh/detour/cniplugin"
	"github.com/detourmesh/detour/internal/version"
)

func main() {
	skel.PluginMainFuncs(cniplugin.New().Funcs(), cniplugin.VersionInfo,
		"detour-cni "+version.Version+": installs the detour redirect in injected pods' network namespaces")
}
