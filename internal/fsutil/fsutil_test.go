package fsutil

import (
	"os"
	"path/filepath"
	"testing"
)

func TestWriteFileAtomic(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "f")
	for _, step := range []struct {
		data      string
		perm      os.FileMode
		wantWrote bool
	}{
		{"a", 0o600, true},  // new file
		{"a", 0o600, false}, // same content and mode: untouched
		{"a", 0o644, true},  // same content, other mode
		{"b", 0o644, true},  // other content
	} {
		wrote, err := WriteFileAtomic(path, []byte(step.data), step.perm)
		if err != nil || wrote != step.wantWrote {
			t.Fatalf("WriteFileAtomic(%q, %o) = %v, %v; want %v", step.data, step.perm, wrote, err, step.wantWrote)
		}
		st, err := os.Stat(path)
		if err != nil || st.Mode().Perm() != step.perm {
			t.Fatalf("mode after writing %q: %v, %v; want %o", step.data, st.Mode(), err, step.perm)
		}
		if got, _ := os.ReadFile(path); string(got) != step.data {
			t.Fatalf("content %q, want %q", got, step.data)
		}
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Errorf("temporary files left beside %s: %v", path, entries)
	}
}
