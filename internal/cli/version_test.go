package cli

import (
	"strings"
	"testing"

	"github.com/detourmesh/detour/internal/version"
)

func TestVersionCommand(t *testing.T) {
	defer func(c string) { version.Commit = c }(version.Commit)
	version.Commit = "0123456789abcdef0123456789abcdef01234567"
	out, _, err := run(t, "", "version")
	if err != nil || !strings.HasPrefix(out, "detour "+version.Version+"\ncommit:   "+version.Commit+"\ngo:       go") || !strings.Contains(out, "\nbuild:    CGO_ENABLED=") {
		t.Errorf("detour version = %q, %v; want the version, the commit, Go and the build's settings", out, err)
	}
	if _, _, err := run(t, "", "version", "extra"); err == nil {
		t.Error("detour version extra: no error")
	}
}
