package version

import (
	"fmt"
	"runtime/debug"
	"strings"
)

// Build is what a binary says of its own build: the commit it was built from and how.
type Build struct {
	Version string
	// Commit is the commit the binary was built from: [Commit] as the build set it, else the
	// revision Go's -buildvcs recorded (with "-dirty" for a working tree with changes, as make
	// build names it);
	// empty where the build had neither.
	Commit    string
	GoVersion string
	Platform  string // GOOS/GOARCH
	// Settings are the build's flags that decide its bytes: CGO_ENABLED, -trimpath, -ldflags,
	// GOAMD64 or GOARM64, -tags, in that order, where set.
	Settings []string
}

// settingKeys are the build settings Read keeps, in order.
var settingKeys = []string{"CGO_ENABLED", "-trimpath", "-ldflags", "GOAMD64", "GOARM64", "-tags"}

// Read returns this binary's Build from the build information Go embeds in it.
func Read() Build {
	b := Build{Version: Version, Commit: Commit}
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return b
	}
	b.GoVersion = info.GoVersion
	set := map[string]string{}
	for _, s := range info.Settings {
		set[s.Key] = s.Value
	}
	if b.Commit == "" && set["vcs.revision"] != "" {
		b.Commit = set["vcs.revision"]
		if set["vcs.modified"] == "true" {
			b.Commit += "-dirty"
		}
	}
	b.Platform = set["GOOS"] + "/" + set["GOARCH"]
	for _, k := range settingKeys {
		if v, ok := set[k]; ok {
			b.Settings = append(b.Settings, k+"="+v)
		}
	}
	return b
}

// String is b as `detour version` prints it: the version, then one line each for the commit,
// Go and the platform, and the build's settings (Go leaves -ldflags out of a -trimpath build's
// record: the version and commit are what they set).
func (b Build) String() string {
	var s strings.Builder
	fmt.Fprintf(&s, "detour %s\n", b.Version)
	commit := b.Commit
	if commit == "" {
		commit = "unknown (built without it: make build names it)"
	}
	fmt.Fprintf(&s, "commit:   %s\n", commit)
	fmt.Fprintf(&s, "go:       %s %s\n", b.GoVersion, b.Platform)
	fmt.Fprintf(&s, "build:    %s\n", strings.Join(b.Settings, " "))
	return s.String()
}
