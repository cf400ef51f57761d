package image

import (
	"archive/tar"
	"context"
	"errors"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// layerEntry is what a test reads of one entry of an image's layer.
type layerEntry struct {
	typ      byte
	mode     int64
	uid, gid int
	data     string
	modTime  int64
}

// layerEntries reads the image's single layer.
func layerEntries(t *testing.T, img v1.Image) (names []string, entries map[string]layerEntry) {
	t.Helper()
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	if len(layers) != 1 {
		t.Fatalf("image has %d layers, want 1", len(layers))
	}
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	entries = map[string]layerEntry{}
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, h.Name)
		entries[h.Name] = layerEntry{typ: h.Typeflag, mode: h.Mode, uid: h.Uid, gid: h.Gid, data: string(b), modTime: h.ModTime.Unix()}
	}
	return names, entries
}

func TestBuild(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "prog")
	if err := os.WriteFile(bin, []byte("#!binary"), 0o750); err != nil {
		t.Fatal(err)
	}
	spec := Spec{
		Ref: "example.test/prog:1",
		Files: []File{
			{Path: "/usr/bin/prog", Source: bin},
			{Path: "/etc/app.conf", Data: []byte("a=b\n"), UID: 1500, GID: 1501},
			{Path: "/var/run/app", Dir: true, Mode: 0o1777},
			{Path: "/opt/tool", Source: bin, Mode: 0o4755},
			{Path: "/empty", Data: []byte{}},
		},
		User:       "1500:1501",
		Entrypoint: []string{"/usr/bin/prog"},
		Cmd:        []string{"serve"},
		Env:        []string{"PATH=/usr/bin", "A=b"},
		WorkingDir: "/var/run/app",
		Labels:     map[string]string{"k": "v"},
		Arch:       "arm64",
	}
	img, err := Build(spec)
	if err != nil {
		t.Fatal(err)
	}

	names, entries := layerEntries(t, img)
	wantNames := []string{"empty", "etc/", "etc/app.conf", "opt/", "opt/tool", "usr/", "usr/bin/", "usr/bin/prog", "var/", "var/run/", "var/run/app/"}
	if !reflect.DeepEqual(names, wantNames) {
		t.Errorf("layer entries %q, want %q (sorted, parents added)", names, wantNames)
	}
	want := map[string]layerEntry{
		"empty":        {typ: tar.TypeReg, mode: 0o644},
		"etc/":         {typ: tar.TypeDir, mode: 0o755},
		"etc/app.conf": {typ: tar.TypeReg, mode: 0o644, uid: 1500, gid: 1501, data: "a=b\n"},
		"opt/":         {typ: tar.TypeDir, mode: 0o755},
		"opt/tool":     {typ: tar.TypeReg, mode: 0o4755, data: "#!binary"},
		"usr/":         {typ: tar.TypeDir, mode: 0o755},
		"usr/bin/":     {typ: tar.TypeDir, mode: 0o755},
		"usr/bin/prog": {typ: tar.TypeReg, mode: 0o750, data: "#!binary"}, // the source's mode
		"var/":         {typ: tar.TypeDir, mode: 0o755},
		"var/run/":     {typ: tar.TypeDir, mode: 0o755},
		"var/run/app/": {typ: tar.TypeDir, mode: 0o1777},
	}
	if !reflect.DeepEqual(entries, want) {
		t.Errorf("layer entries\n%+v\nwant\n%+v", entries, want)
	}

	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if cf.OS != "linux" || cf.Architecture != "arm64" {
		t.Errorf("platform %s/%s, want linux/arm64", cf.OS, cf.Architecture)
	}
	if cf.Created.Unix() != 0 {
		t.Errorf("created %v, want the epoch", cf.Created)
	}
	wantConfig := v1.Config{
		User:       "1500:1501",
		Entrypoint: []string{"/usr/bin/prog"},
		Cmd:        []string{"serve"},
		Env:        []string{"PATH=/usr/bin", "A=b"},
		WorkingDir: "/var/run/app",
		Labels:     map[string]string{"k": "v"},
	}
	if !reflect.DeepEqual(cf.Config, wantConfig) {
		t.Errorf("config %+v, want %+v", cf.Config, wantConfig)
	}
	if len(cf.RootFS.DiffIDs) != 1 || len(cf.History) != 1 {
		t.Errorf("rootfs %+v history %+v, want one layer", cf.RootFS, cf.History)
	}

	// Deterministic: the same spec gives the same digest, even after the source's mtime moves.
	if err := os.Chtimes(bin, entriesTime, entriesTime); err != nil {
		t.Fatal(err)
	}
	again, err := Build(spec)
	if err != nil {
		t.Fatal(err)
	}
	d1, _ := img.Digest()
	d2, _ := again.Digest()
	if d1 != d2 {
		t.Errorf("two builds of one spec: digests %s and %s", d1, d2)
	}
}

var entriesTime = epoch.AddDate(30, 0, 0)

func TestBuildDefaultArch(t *testing.T) {
	img, err := Build(Spec{Files: []File{{Path: "/a", Data: []byte("a")}}})
	if err != nil {
		t.Fatal(err)
	}
	cf, _ := img.ConfigFile()
	if cf.Architecture == "" || cf.OS != "linux" {
		t.Errorf("platform %s/%s, want linux/GOARCH", cf.OS, cf.Architecture)
	}
}

func TestBuildErrors(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "missing")
	for _, tc := range []struct {
		name  string
		files []File
		want  string
	}{
		{"relative", []File{{Path: "etc/x", Data: []byte{}}}, `("etc/x"): path must be absolute`},
		{"unclean", []File{{Path: "/etc/../x", Data: []byte{}}}, "path must be absolute and clean"},
		{"root", []File{{Path: "/", Dir: true}}, "not /"},
		{"no content", []File{{Path: "/x"}}, "a file needs Source or Data"},
		{"both", []File{{Path: "/x", Source: "/etc/hostname", Data: []byte("x")}}, "keep one"},
		{"dir content", []File{{Path: "/x", Dir: true, Data: []byte("x")}}, "a directory has no content"},
		{"missing source", []File{{Path: "/x", Source: missing}}, missing},
		{"mode", []File{{Path: "/x", Data: []byte{}, Mode: 0o100644}}, "bits beyond permissions"},
		{"twice", []File{{Path: "/x", Data: []byte{}}, {Path: "/x", Dir: true}}, `"/x" is listed twice`},
		{"file parent", []File{{Path: "/x", Data: []byte{}}, {Path: "/x/y", Data: []byte{}}}, "/x is a parent of /x/y"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Build(Spec{Files: tc.files})
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Build: %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

func TestWriteTarball(t *testing.T) {
	a, err := Build(Spec{Files: []File{{Path: "/a", Data: []byte("a")}}, Entrypoint: []string{"/a"}})
	if err != nil {
		t.Fatal(err)
	}
	b, err := Build(Spec{Files: []File{{Path: "/b", Data: []byte("b")}}, User: "1500"})
	if err != nil {
		t.Fatal(err)
	}
	imgs := map[string]v1.Image{
		"example.test/a:1":      a,
		"example.test/a:latest": a,
		"ghcr.io/x/b:v1.2.3":    b,
	}
	out := filepath.Join(t.TempDir(), "sub", "images.tar")
	if err := WriteTarball(out, imgs); err != nil {
		t.Fatal(err)
	}
	for ref, img := range imgs {
		tag, err := name.NewTag(ref)
		if err != nil {
			t.Fatal(err)
		}
		got, err := tarball.ImageFromPath(out, &tag)
		if err != nil {
			t.Fatalf("read %s back: %v", ref, err)
		}
		gd, err := got.ConfigName()
		if err != nil {
			t.Fatal(err)
		}
		wd, _ := img.ConfigName()
		if gd != wd {
			t.Errorf("%s: config %s, want %s", ref, gd, wd)
		}
		// The layers read back whole: their digests verify.
		if _, entries := layerEntries(t, got); len(entries) != 1 {
			t.Errorf("%s: layer entries %v", ref, entries)
		}
	}

	// manifest.json, which docker load and ctr import read, tags every image.
	manifest, err := tarball.LoadManifest(func() (io.ReadCloser, error) { return os.Open(out) })
	if err != nil {
		t.Fatal(err)
	}
	var tags [][]string
	for _, d := range manifest {
		tags = append(tags, d.RepoTags)
	}
	wantTags := [][]string{{"example.test/a:1", "example.test/a:latest"}, {"ghcr.io/x/b:v1.2.3"}}
	if len(tags) == 2 && len(tags[0]) == 2 && tags[0][0] > tags[0][1] {
		tags[0][0], tags[0][1] = tags[0][1], tags[0][0]
	}
	if !reflect.DeepEqual(tags, wantTags) {
		t.Errorf("manifest.json RepoTags %q, want %q", tags, wantTags)
	}
	// Two configs, two layers, the manifest: nothing written twice.
	if files := tarballFiles(t, out); len(files) != 5 {
		t.Errorf("tarball files %q, want 2 configs, 2 layers and manifest.json", files)
	}
	// No temporary file is left next to it.
	left, _ := filepath.Glob(filepath.Join(filepath.Dir(out), ".tmp-*"))
	if len(left) != 0 {
		t.Errorf("temporary files left: %q", left)
	}
}

func TestWriteTarballErrors(t *testing.T) {
	img, err := Build(Spec{Files: []File{{Path: "/a", Data: []byte("a")}}})
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "x.tar")
	if err := WriteTarball(out, nil); err == nil || !strings.Contains(err.Error(), "no images") {
		t.Errorf("no images: %v", err)
	}
	if err := WriteTarball(out, map[string]v1.Image{"Bad Ref": img}); err == nil || !strings.Contains(err.Error(), `reference "Bad Ref"`) {
		t.Errorf("bad reference: %v", err)
	}
	if _, err := os.Stat(out); !os.IsNotExist(err) {
		t.Errorf("a failed write left %s: %v", out, err)
	}
}

func TestDetourSpec(t *testing.T) {
	bin := t.TempDir()
	for _, b := range []string{"detour", "detour-cni"} {
		if err := os.WriteFile(filepath.Join(bin, b), []byte(b+" binary"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	spec := DetourSpec(bin, "v1.2.3")
	if spec.Ref != "ghcr.io/detourmesh/detour:v1.2.3" {
		t.Errorf("ref %s", spec.Ref)
	}
	img, err := Build(spec)
	if err != nil {
		t.Fatal(err)
	}
	_, entries := layerEntries(t, img)
	for p, want := range map[string]layerEntry{
		"opt/detour/bin/detour":     {typ: tar.TypeReg, mode: 0o755, data: "detour binary"},
		"opt/detour/bin/detour-cni": {typ: tar.TypeReg, mode: 0o755, data: "detour-cni binary"},
		"etc/passwd":                {typ: tar.TypeReg, mode: 0o644, data: string(etcPasswd)},
		"etc/group":                 {typ: tar.TypeReg, mode: 0o644, data: string(etcGroup)},
	} {
		if entries[p] != want {
			t.Errorf("%s: %+v, want %+v", p, entries[p], want)
		}
	}
	for _, line := range []string{"root:x:0:0:", "nonroot:x:65532:65532:"} {
		if !strings.Contains(string(etcPasswd), "\n"+line) && !strings.HasPrefix(string(etcPasswd), line) {
			t.Errorf("/etc/passwd has no %q line", line)
		}
	}
	cf, _ := img.ConfigFile()
	if cf.Config.User != "65532:65532" || !reflect.DeepEqual(cf.Config.Entrypoint, []string{"/opt/detour/bin/detour"}) ||
		!reflect.DeepEqual(cf.Config.Env, []string{"PATH=/opt/detour/bin:/usr/local/bin:/usr/bin:/bin"}) {
		t.Errorf("config %+v", cf.Config)
	}
	if cf.Config.Labels["org.opencontainers.image.version"] != "v1.2.3" {
		t.Errorf("labels %v", cf.Config.Labels)
	}

	// Without `make build`, the error names the binary and what to do.
	_, err = Build(DetourSpec(filepath.Join(bin, "nothing"), "v1"))
	if err == nil || !strings.Contains(err.Error(), "/opt/detour/bin/detour") || !strings.Contains(err.Error(), "build it first") {
		t.Errorf("Build without binaries: %v", err)
	}
}

// Push goes through the registry API: an in-process registry (go-containerregistry's own)
// gets the image, and pulling it back gives the same digest.
func TestPush(t *testing.T) {
	t.Setenv("DOCKER_CONFIG", t.TempDir()) // no credentials: anonymous, as the test registry wants
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(srv.Close)
	img, err := Build(Spec{Files: []File{{Path: "/a", Data: []byte("a")}}, User: "1500"})
	if err != nil {
		t.Fatal(err)
	}
	ref := strings.TrimPrefix(srv.URL, "http://") + "/detour:v1.2.3"
	if err := Push(context.Background(), ref, img); err != nil {
		t.Fatal(err)
	}
	r, err := name.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	got, err := remote.Image(r)
	if err != nil {
		t.Fatal(err)
	}
	gd, _ := got.Digest()
	wd, _ := img.Digest()
	if gd != wd {
		t.Errorf("pulled %s, pushed %s", gd, wd)
	}

	if err := Push(context.Background(), "Not A Ref", img); err == nil || !strings.Contains(err.Error(), `reference "Not A Ref"`) {
		t.Errorf("bad reference: %v", err)
	}
	srv.Close()
	if err := Push(context.Background(), ref, img); err == nil || !strings.Contains(err.Error(), "docker login") {
		t.Errorf("registry gone: %v", err)
	}
}

func TestCheckDetourVersion(t *testing.T) {
	bin := t.TempDir()
	script := "#!/bin/sh\necho 'detour version v1.2.3'\n"
	if err := os.WriteFile(filepath.Join(bin, "detour"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := CheckDetourVersion(ctx, bin, "v1.2.3"); err != nil {
		t.Error(err)
	}
	if err := CheckDetourVersion(ctx, bin, "v2"); err == nil || !strings.Contains(err.Error(), `version "v1.2.3", not "v2": rebuild it with make build VERSION=v2`) {
		t.Errorf("other version: %v", err)
	}
	if err := CheckDetourVersion(ctx, t.TempDir(), "v2"); err == nil || !strings.Contains(err.Error(), "run make build first") {
		t.Errorf("no binary: %v", err)
	}
}

// TestBuildWithBase: a root filesystem from a tar file lies below the spec's own layer, and
// two images on the same base share its layer in a tarball.
func TestBuildWithBase(t *testing.T) {
	dir := t.TempDir()
	rootfs := filepath.Join(dir, "rootfs.tar")
	f, err := os.Create(rootfs)
	if err != nil {
		t.Fatal(err)
	}
	tw := tar.NewWriter(f)
	for _, e := range []struct{ name, data string }{{"bin/sh", "#!shell"}, {"etc/passwd", "root:x:0:0::/:/bin/sh\n"}} {
		if err := tw.WriteHeader(&tar.Header{Name: e.name, Mode: 0o755, Size: int64(len(e.data)), Typeflag: tar.TypeReg}); err != nil {
			t.Fatal(err)
		}
		tw.Write([]byte(e.data))
	}
	if err := errors.Join(tw.Close(), f.Close()); err != nil {
		t.Fatal(err)
	}
	base, err := LayerFromTar(rootfs)
	if err != nil {
		t.Fatal(err)
	}
	imgs := map[string]v1.Image{}
	for _, app := range []string{"a", "b"} {
		img, err := Build(Spec{Base: []v1.Layer{base}, Files: []File{{Path: "/" + app, Data: []byte(app)}}, Entrypoint: []string{"/" + app}})
		if err != nil {
			t.Fatal(err)
		}
		imgs["example.test/"+app+":1"] = img
	}
	img := imgs["example.test/a:1"]
	layers, err := img.Layers()
	if err != nil || len(layers) != 2 {
		t.Fatalf("layers %d (%v), want the base and the spec's", len(layers), err)
	}
	want, _ := base.DiffID()
	if got, _ := layers[0].DiffID(); got != want {
		t.Errorf("lowest layer %s, want the base %s", got, want)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if len(cf.History) != 2 || cf.History[0].CreatedBy != baseCreatedBy || cf.History[1].CreatedBy != createdBy {
		t.Errorf("history %+v, want the base's entry then the spec's", cf.History)
	}
	out := filepath.Join(dir, "images.tar")
	if err := WriteTarball(out, imgs); err != nil {
		t.Fatal(err)
	}
	// Two configs, the shared base once, each image's own layer, the manifest.
	if files := tarballFiles(t, out); len(files) != 6 {
		t.Errorf("tarball files %q, want 2 configs, 3 layers and manifest.json", files)
	}
}

// tarballFiles lists the names in the tarball at path, in order.
func tarballFiles(t *testing.T, path string) []string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var files []string
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return files
		}
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, h.Name)
	}
}
