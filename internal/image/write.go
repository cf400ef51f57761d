package image

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// WriteTarball writes imgs, keyed by their tagged references, into one docker-save tarball at
// path (manifest.json with each image's RepoTags, its config and its layers, shared layers
// once), the format `docker load` and `ctr -n k8s.io images import` accept. The file is
// written atomically: a temporary file in the same directory, synced, then renamed.
func WriteTarball(path string, imgs map[string]v1.Image) (err error) {
	if len(imgs) == 0 {
		return errors.New("write image tarball " + path + ": no images given")
	}
	refs := make(map[name.Reference]v1.Image, len(imgs))
	keys := make([]string, 0, len(imgs))
	for ref := range imgs {
		keys = append(keys, ref)
	}
	sort.Strings(keys)
	for _, ref := range keys {
		tag, err := name.NewTag(ref)
		if err != nil {
			return fmt.Errorf("write image tarball %s: reference %q: %w (want registry/repository:tag; a tarball needs tags, not digests)", path, ref, err)
		}
		if imgs[ref] == nil {
			return fmt.Errorf("write image tarball %s: reference %q has no image", path, ref)
		}
		refs[tag] = imgs[ref]
	}

	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("write image tarball: %w", err)
	}
	tmp, err := os.CreateTemp(dir, ".tmp-"+filepath.Base(path)+"-")
	if err != nil {
		return fmt.Errorf("write image tarball: %w", err)
	}
	defer func() {
		if err != nil {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	if err := tarball.MultiRefWrite(refs, tmp); err != nil {
		return fmt.Errorf("write image tarball %s: %w", path, err)
	}
	if err := tmp.Chmod(0o644); err != nil {
		return fmt.Errorf("write image tarball %s: %w", path, err)
	}
	if err := tmp.Sync(); err != nil {
		return fmt.Errorf("write image tarball %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("write image tarball %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("write image tarball %s: %w", path, err)
	}
	return nil
}

// Push uploads img to the registry as ref, with the credentials `docker login` (or a
// credential helper named in ~/.docker/config.json, or $DOCKER_CONFIG) holds for it.
func Push(ctx context.Context, ref string, img v1.Image) error {
	r, err := name.ParseReference(ref)
	if err != nil {
		return fmt.Errorf("push image: reference %q: %w (want registry/repository:tag)", ref, err)
	}
	if err := remote.Write(r, img, remote.WithContext(ctx), remote.WithAuthFromKeychain(authn.DefaultKeychain)); err != nil {
		return fmt.Errorf("push image %s: %w (check the registry's name and that `docker login %s` holds credentials that may push there)", ref, err, r.Context().RegistryStr())
	}
	return nil
}
