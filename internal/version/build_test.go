package version

import (
	"runtime"
	"strings"
	"testing"
)

func TestRead(t *testing.T) {
	defer func(v, c string) { Version, Commit = v, c }(Version, Commit)
	Version, Commit = "v9.8.7", "0123456789abcdef0123456789abcdef01234567-dirty"
	b := Read()
	if b.Version != Version || b.Commit != Commit {
		t.Errorf("Read() = %+v, want the version and commit the build set", b)
	}
	if b.Platform != runtime.GOOS+"/"+runtime.GOARCH || b.GoVersion != runtime.Version() {
		t.Errorf("Read() = %+v, want %s/%s and %s", b, runtime.GOOS, runtime.GOARCH, runtime.Version())
	}
	if !strings.HasPrefix(strings.Join(b.Settings, " "), "CGO_ENABLED=") {
		t.Errorf("settings %q, want CGO_ENABLED first", b.Settings)
	}
}

func TestBuildString(t *testing.T) {
	b := Build{Version: "v0.2.0", Commit: "abc", GoVersion: "go1.26.8", Platform: "linux/arm64", Settings: []string{"CGO_ENABLED=0", "-trimpath=true"}}
	want := "detour v0.2.0\ncommit:   abc\ngo:       go1.26.8 linux/arm64\nbuild:    CGO_ENABLED=0 -trimpath=true\n"
	if got := b.String(); got != want {
		t.Errorf("String() =\n%s\nwant\n%s", got, want)
	}
	b.Commit = ""
	if got := b.String(); !strings.Contains(got, "commit:   unknown") {
		t.Errorf("String() without a commit =\n%s", got)
	}
}
