package framework

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/detourmesh/detour/test/testenv"
)

// Release is a detour release built from the repository's own history, as an upgrade test
// installs it: its binaries, its image (as the nodes know it after the import) and its chart.
type Release struct {
	// Version is the release's version ("v0.1.0"), Commit its commit.
	Version, Commit string
	// Repo and Tag are its image's, as the nodes know it once imported.
	Repo, Tag string
	// Image is its image, a docker-save tarball the nodes import.
	Image string
	// Chart is its chart's directory.
	Chart string
	// Bin holds its detour and detour-cni.
	Bin string
}

// PreviousRelease is the release hack/previous-release names, built from that commit: `git
// worktree add` of the commit, `make build VERSION=<version>` and `go run ./hack/image` there
// (the release's own build and image, with its own go.mod), its chart copied out; the worktree
// goes again. The result is cached by commit next to the test binaries
// ($DETOUR_CACHE/releases/<commit>), so a run builds it once per machine; a clone without the
// commit in its history cannot build it, and the error says so.
func PreviousRelease(ctx context.Context, root string) (*Release, error) {
	previous.once.Do(func() { previous.r, previous.err = buildPreviousRelease(ctx, root) })
	return previous.r, previous.err
}

var previous struct {
	once sync.Once
	r    *Release
	err  error
}

// ReleaseRepo is the repository of a release's image in the e2e (the current tree's is
// Artifacts.Repo, the same): the tag tells them apart.
const ReleaseRepo = "detour.test/detour"

func buildPreviousRelease(ctx context.Context, root string) (*Release, error) {
	version, commit, err := readPreviousRelease(filepath.Join(root, "hack", "previous-release"))
	if err != nil {
		return nil, err
	}
	r := &Release{Version: version, Commit: commit, Repo: ReleaseRepo, Tag: version}
	dir := filepath.Join(filepath.Dir(testenv.BinDir()), "releases", commit)
	r.Image, r.Chart, r.Bin = filepath.Join(dir, "image.tar"), filepath.Join(dir, "chart"), filepath.Join(dir, "bin")
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return nil, err
	}
	// One build at a time on the machine; a finished one is a directory renamed into place.
	lock, err := os.OpenFile(dir+".lock", os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return nil, err
	}
	if _, err := os.Stat(filepath.Join(dir, "done")); err == nil {
		return r, nil
	}
	start := time.Now()
	tmp, err := os.MkdirTemp(filepath.Dir(dir), ".build-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	wt := filepath.Join(tmp, "worktree")
	if out, err := gitCmd(ctx, root, "worktree", "add", "--detach", wt, commit); err != nil {
		return nil, fmt.Errorf("build the previous release %s: git worktree add %s: %w\n%s(a clone needs the history that holds the commit: git fetch --unshallow)", version, commit, err, out)
	}
	defer gitCmd(context.WithoutCancel(ctx), root, "worktree", "remove", "--force", wt)
	out := filepath.Join(tmp, "out")
	steps := [][]string{
		{"make", "-C", wt, "build", "VERSION=" + version, "BIN=" + filepath.Join(out, "bin")},
		{"go", "run", "./hack/image", "--bin", filepath.Join(out, "bin"), "--version", version,
			"--ref", r.Repo + ":" + r.Tag, "--out", filepath.Join(out, "image.tar")},
		{"cp", "-a", filepath.Join(wt, "manifests", "charts", "detour"), filepath.Join(out, "chart")},
	}
	for _, argv := range steps {
		cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
		cmd.Dir = wt
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if b, err := cmd.CombinedOutput(); err != nil {
			return nil, fmt.Errorf("build the previous release %s (%s): %s: %w\n%s", version, commit, strings.Join(argv, " "), err, b)
		}
	}
	if err := os.WriteFile(filepath.Join(out, "done"), []byte(time.Since(start).Round(time.Second).String()+"\n"), 0o644); err != nil {
		return nil, err
	}
	os.RemoveAll(dir)
	if err := os.Rename(out, dir); err != nil {
		return nil, err
	}
	return r, nil
}

// readPreviousRelease reads hack/previous-release: "version vX.Y.Z" and "commit <sha>" lines.
func readPreviousRelease(path string) (version, commit string, err error) {
	f, err := os.Open(path)
	if err != nil {
		return "", "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		key, value, _ := strings.Cut(strings.TrimSpace(sc.Text()), " ")
		switch key {
		case "version":
			version = strings.TrimSpace(value)
		case "commit":
			commit = strings.TrimSpace(value)
		}
	}
	if version == "" || len(commit) != 40 {
		return "", "", fmt.Errorf("%s names no version and full commit (version %q, commit %q)", path, version, commit)
	}
	return version, commit, sc.Err()
}

func gitCmd(ctx context.Context, dir string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, "git", args...)
	cmd.Dir = dir
	return cmd.CombinedOutput()
}

// InstallRelease installs (or upgrades, or downgrades) detour's chart to release r: its image
// is imported into every node of the cluster first, and its own chart installed with the e2e
// values naming that image and the run's proxy as r can carry it (Proxy.ForRelease), and extra
// applied over them.
func (e *Env) InstallRelease(t testing.TB, ctx context.Context, r *Release, extra string) {
	t.Helper()
	for _, n := range e.Node.Nodes() {
		if _, err := n.Run(ctx, n.Ctr("images", "import", "--snapshotter", "overlayfs", r.Image)...); err != nil {
			t.Fatalf("import %s's image into %s: %v", r.Version, n.Name, err)
		}
	}
	img := imageSet{repo: r.Repo, tag: r.Tag, refs: e.img.refs, pull: corev1.PullNever, chart: []string{r.Chart}, proxy: e.Proxy.ForRelease(r)}
	e.helmInstall(t, ctx, img, extra, true)
}
