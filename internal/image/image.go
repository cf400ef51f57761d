package image

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"fmt"
	"io"
	"os"
	"path"
	"runtime"
	"sort"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// File is one entry of an image's filesystem.
type File struct {
	// Path is the absolute, clean path in the image ("/opt/detour/bin/detour").
	Path string
	// Source is a host file whose content is copied; Data is the content itself. A regular
	// file has exactly one of them (Data: []byte{} for an empty file); a directory neither.
	Source string
	Data   []byte
	Dir    bool
	// Mode holds the permission bits (setuid, setgid and sticky included). Zero means 0755
	// for a directory, the host file's permissions for Source and 0644 for Data.
	Mode     int64
	UID, GID int
}

// Spec describes an image: its files (one layer) and its config.
type Spec struct {
	// Ref is where the image goes, e.g. ghcr.io/detourmesh/detour:v1.2.3. Build does not use
	// it; callers pass it to WriteTarball or Push.
	Ref   string
	Files []File
	// User, Entrypoint, Cmd, Env, WorkingDir and Labels are the image config's fields of the
	// same names.
	User                 string
	Entrypoint, Cmd, Env []string
	WorkingDir           string
	Labels               map[string]string
	// Arch is the image's architecture (GOARCH spelling); empty means runtime.GOARCH. The
	// operating system is always linux.
	Arch string
	// Base are the layers below the one of Files, lowest first (a distribution's root
	// filesystem: LayerFromTar).
	Base []v1.Layer
}

// epoch is the time of every layer entry and of the image's creation, so that the same spec
// always gives the same image digest (as SOURCE_DATE_EPOCH=0 does for reproducible builds).
var epoch = time.Unix(0, 0).UTC()

// createdBy is the history entry of the layer Build makes; baseCreatedBy of a base layer.
const (
	createdBy     = "detour internal/image: one layer of the spec's files"
	baseCreatedBy = "detour internal/image: a base layer"
)

// LayerFromTar is a base layer (Spec.Base) from an uncompressed tar file, e.g. a root
// filesystem. It is compressed once, when first needed (fastest gzip: the layer is big).
func LayerFromTar(path string) (v1.Layer, error) {
	l, err := tarball.LayerFromFile(path, tarball.WithCompressedCaching, tarball.WithCompressionLevel(gzip.BestSpeed))
	if err != nil {
		return nil, fmt.Errorf("image layer from %s: %w", path, err)
	}
	return l, nil
}

// Build makes the image spec describes: spec.Base's layers, then one layer holding spec.Files
// (parent directories added as root 0755, entries in path order, every time fixed), and a
// config from spec's fields. The same spec and file contents always give the same digest.
func Build(spec Spec) (v1.Image, error) {
	arch := spec.Arch
	if arch == "" {
		arch = runtime.GOARCH
	}
	layerTar, err := layerTar(spec.Files)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	}, tarball.WithCompressedCaching)
	if err != nil {
		return nil, fmt.Errorf("image layer: %w", err)
	}
	var adds []mutate.Addendum
	for _, l := range spec.Base {
		adds = append(adds, mutate.Addendum{Layer: l, History: v1.History{Created: v1.Time{Time: epoch}, CreatedBy: baseCreatedBy}})
	}
	adds = append(adds, mutate.Addendum{Layer: layer, History: v1.History{Created: v1.Time{Time: epoch}, CreatedBy: createdBy}})
	img, err := mutate.Append(empty.Image, adds...)
	if err != nil {
		return nil, fmt.Errorf("append image layer: %w", err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, fmt.Errorf("image config: %w", err)
	}
	cf = cf.DeepCopy()
	cf.Architecture = arch
	cf.OS = "linux"
	cf.Created = v1.Time{Time: epoch}
	cf.Config = v1.Config{
		User:       spec.User,
		Entrypoint: spec.Entrypoint,
		Cmd:        spec.Cmd,
		Env:        spec.Env,
		WorkingDir: spec.WorkingDir,
		Labels:     spec.Labels,
	}
	img, err = mutate.ConfigFile(img, cf)
	if err != nil {
		return nil, fmt.Errorf("set image config: %w", err)
	}
	return img, nil
}

// entry is one tar entry of the layer.
type entry struct {
	hdr  tar.Header
	data []byte
}

// layerTar returns the layer's uncompressed tar: files checked, their parent directories
// added, sorted by path.
func layerTar(files []File) ([]byte, error) {
	// Keyed by path without the leading slash (a directory's tar name adds a trailing one).
	entries := map[string]*entry{}
	var listed []string
	for i, f := range files {
		e, err := fileEntry(f)
		if err != nil {
			return nil, fmt.Errorf("image file %d (%q): %w", i, f.Path, err)
		}
		key := strings.TrimPrefix(f.Path, "/")
		if _, dup := entries[key]; dup {
			return nil, fmt.Errorf("image file %q is listed twice: keep one", f.Path)
		}
		entries[key] = e
		listed = append(listed, key)
	}
	for _, key := range listed {
		for dir := path.Dir(key); dir != "."; dir = path.Dir(dir) {
			parent, ok := entries[dir]
			if !ok {
				entries[dir] = &entry{hdr: dirHeader(dir+"/", 0o755, 0, 0)}
				continue
			}
			if parent.hdr.Typeflag != tar.TypeDir {
				return nil, fmt.Errorf("image file /%s is a parent of /%s: make it a directory (Dir: true) or move one of them", dir, key)
			}
		}
	}
	keys := make([]string, 0, len(entries))
	for key := range entries {
		keys = append(keys, key)
	}
	sort.Strings(keys)

	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, key := range keys {
		e := entries[key]
		if err := tw.WriteHeader(&e.hdr); err != nil {
			return nil, fmt.Errorf("image layer entry /%s: %w", key, err)
		}
		if _, err := tw.Write(e.data); err != nil {
			return nil, fmt.Errorf("image layer entry /%s: %w", key, err)
		}
	}
	if err := tw.Close(); err != nil {
		return nil, fmt.Errorf("image layer: %w", err)
	}
	return buf.Bytes(), nil
}

// fileEntry checks f and returns its tar entry; names are relative ("opt/detour/bin/detour",
// directories with a trailing slash), as in docker's own layers.
func fileEntry(f File) (*entry, error) {
	if !path.IsAbs(f.Path) || path.Clean(f.Path) != f.Path || f.Path == "/" {
		return nil, fmt.Errorf("path must be absolute and clean, and not /")
	}
	if f.Mode&^0o7777 != 0 {
		return nil, fmt.Errorf("mode %#o has bits beyond permissions: give only permission bits (e.g. 0755)", f.Mode)
	}
	if f.UID < 0 || f.GID < 0 {
		return nil, fmt.Errorf("owner %d:%d is negative", f.UID, f.GID)
	}
	name := strings.TrimPrefix(f.Path, "/")
	if f.Dir {
		if f.Source != "" || f.Data != nil {
			return nil, fmt.Errorf("a directory has no content: drop Source and Data, or Dir")
		}
		mode := f.Mode
		if mode == 0 {
			mode = 0o755
		}
		return &entry{hdr: dirHeader(name+"/", mode, f.UID, f.GID)}, nil
	}
	data, mode := f.Data, f.Mode
	switch {
	case f.Source != "" && f.Data != nil:
		return nil, fmt.Errorf("both Source and Data are set: keep one")
	case f.Source != "":
		st, err := os.Stat(f.Source)
		if err != nil {
			return nil, fmt.Errorf("read source: %w (build it first, or fix the path)", err)
		}
		if !st.Mode().IsRegular() {
			return nil, fmt.Errorf("source %s is not a regular file", f.Source)
		}
		if data, err = os.ReadFile(f.Source); err != nil {
			return nil, fmt.Errorf("read source: %w", err)
		}
		if mode == 0 {
			mode = int64(st.Mode().Perm())
		}
	case f.Data != nil:
		if mode == 0 {
			mode = 0o644
		}
	default:
		return nil, fmt.Errorf("a file needs Source or Data (Data: []byte{} for an empty file), or Dir: true")
	}
	return &entry{
		hdr: tar.Header{
			Typeflag: tar.TypeReg,
			Name:     name,
			Mode:     mode,
			Uid:      f.UID,
			Gid:      f.GID,
			Size:     int64(len(data)),
			ModTime:  epoch,
		},
		data: data,
	}, nil
}

func dirHeader(name string, mode int64, uid, gid int) tar.Header {
	return tar.Header{
		Typeflag: tar.TypeDir,
		Name:     name,
		Mode:     mode,
		Uid:      uid,
		Gid:      gid,
		ModTime:  epoch,
	}
}
