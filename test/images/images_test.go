package images

import (
	"archive/tar"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/detourmesh/detour/test/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// imageFile is a regular file of an image.
type imageFile struct {
	mode    int64
	content string
}

// imageFiles reads the regular files of the image's single layer.
func imageFiles(t *testing.T, img v1.Image) map[string]imageFile {
	t.Helper()
	layers, err := img.Layers()
	if err != nil || len(layers) != 1 {
		t.Fatalf("layers: %d, %v; want one", len(layers), err)
	}
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	files := map[string]imageFile{}
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return files
		}
		if err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			b, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			files["/"+h.Name] = imageFile{mode: h.Mode, content: string(b)}
		}
	}
}

func TestBuild(t *testing.T) {
	b, err := Build(context.Background(), t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{pauseProg, proxyProg, workloadProg} {
		st, err := os.Stat(b.Bin(p))
		if err != nil || st.Mode().Perm()&0o111 == 0 {
			t.Errorf("binary %s: %v %v", p, st, err)
		}
	}

	const passwd, group = "root:x:0:0:root:/root:/sbin/nologin\n", "root:x:0:\n"
	for _, tc := range []struct {
		ref        string
		user       string
		entrypoint string
		files      map[string]string // path -> content ("" when it is a program)
	}{
		{b.Refs.Pause, "65535:65535", "/pause", map[string]string{"/pause": ""}},
		{b.Refs.Proxy, "", "/usr/local/bin/testproxy", map[string]string{"/usr/local/bin/testproxy": ""}},
		{b.Refs.Workload, "", "/usr/local/bin/workload",
			map[string]string{"/usr/local/bin/workload": "", "/etc/passwd": passwd, "/etc/group": group}},
		{b.Refs.WorkloadNumeric, "1500", "/usr/local/bin/workload",
			map[string]string{"/usr/local/bin/workload": "", "/etc/passwd": passwd, "/etc/group": group}},
		{b.Refs.WorkloadNamed, "app", "/usr/local/bin/workload", map[string]string{
			"/usr/local/bin/workload": "",
			"/etc/passwd":             passwd + "app:x:1600:1600:app:/:/sbin/nologin\n",
			"/etc/group":              group + "app:x:1600:\n",
		}},
	} {
		t.Run(tc.ref, func(t *testing.T) {
			tag, err := name.NewTag(tc.ref)
			if err != nil {
				t.Fatal(err)
			}
			img, err := tarball.ImageFromPath(b.Tarball, &tag)
			if err != nil {
				t.Fatalf("%s is not in %s: %v", tc.ref, b.Tarball, err)
			}
			cf, err := img.ConfigFile()
			if err != nil {
				t.Fatal(err)
			}
			if cf.Config.User != tc.user || !reflect.DeepEqual(cf.Config.Entrypoint, []string{tc.entrypoint}) || cf.OS != "linux" {
				t.Errorf("config: user %q entrypoint %q os %s; want %q [%s] linux", cf.Config.User, cf.Config.Entrypoint, cf.OS, tc.user, tc.entrypoint)
			}
			files := imageFiles(t, img)
			var paths, wantPaths []string
			for p := range files {
				paths = append(paths, p)
			}
			for p := range tc.files {
				wantPaths = append(wantPaths, p)
			}
			sort.Strings(paths)
			sort.Strings(wantPaths)
			if !reflect.DeepEqual(paths, wantPaths) {
				t.Fatalf("files %q, want %q", paths, wantPaths)
			}
			for p, content := range tc.files {
				f := files[p]
				if content == "" {
					// A program: the binary Build left in bin/, executable by anyone.
					bin, _ := os.ReadFile(b.Bin(filepath.Base(p)))
					if f.content != string(bin) || f.mode != 0o755 {
						t.Errorf("%s: mode %#o, content %d bytes; want bin/%s, 0755", p, f.mode, len(f.content), filepath.Base(p))
					}
				} else if f.content != content || f.mode != 0o644 {
					t.Errorf("%s: mode %#o %q, want 0644 %q", p, f.mode, f.content, content)
				}
			}
		})
	}

	// One tarball, every image tagged in manifest.json (what ctr and docker read).
	m, err := tarball.LoadManifest(func() (io.ReadCloser, error) { return os.Open(b.Tarball) })
	if err != nil {
		t.Fatal(err)
	}
	var tags []string
	for _, d := range m {
		tags = append(tags, d.RepoTags...)
	}
	sort.Strings(tags)
	want := []string{"detour.test/haproxy:2.6", "detour.test/pause:1", "detour.test/proxy:1", "detour.test/workload-named:1", "detour.test/workload-numeric:1", "detour.test/workload:1"}
	if !reflect.DeepEqual(tags, want) {
		t.Errorf("manifest.json RepoTags %q, want %q", tags, want)
	}

	t.Run("programs", func(t *testing.T) { testPrograms(t, b) })

	// HAProxy: the host's binary, every library it links and the loader, and its configuration.
	tag, _ := name.NewTag(b.Refs.HAProxy)
	img, err := tarball.ImageFromPath(b.Tarball, &tag)
	if err != nil {
		t.Fatal(err)
	}
	files := imageFiles(t, img)
	libs, err := sharedLibraries(HAProxyBinary)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range append(libs, HAProxyBinary) {
		host, _ := os.ReadFile(p)
		if f, ok := files[p]; !ok || f.content != string(host) {
			t.Errorf("the HAProxy image lacks %s as on the host", p)
		}
	}
	if files[HAProxyConfigPath].content != string(HAProxyConfig) {
		t.Errorf("the HAProxy image's %s is not HAProxyConfig", HAProxyConfigPath)
	}
	if cf, err := img.ConfigFile(); err != nil || !reflect.DeepEqual(cf.Config.Entrypoint, []string{HAProxyBinary, "-W", "-db", "-f", HAProxyConfigPath}) || cf.Config.User != "" {
		t.Errorf("the HAProxy image's config: %+v, %v", cf, err)
	}
}

func TestParseLdd(t *testing.T) {
	out := "\tlinux-vdso.so.1 (0x00007ffd)\n\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)\n\t/lib64/ld-linux-x86-64.so.2 (0x00007f)\n"
	libs, err := parseLdd([]byte(out))
	if want := []string{"/lib/x86_64-linux-gnu/libc.so.6", "/lib64/ld-linux-x86-64.so.2"}; err != nil || !reflect.DeepEqual(libs, want) {
		t.Errorf("parseLdd = %q, %v; want %q", libs, err, want)
	}
	if _, err := parseLdd([]byte("\tlibfoo.so.1 => not found\n")); err == nil || !strings.Contains(err.Error(), "libfoo.so.1 not found") {
		t.Errorf("a missing library: %v", err)
	}
	if _, err := parseLdd([]byte("\tnot a dynamic executable\n")); err == nil {
		t.Error("no library: no error")
	}
}

// testPrograms runs the built binaries as a container runtime would: their exit codes, and a
// clean exit on SIGTERM (as PID 1 a program that does not handle it would never stop).
func testPrograms(t *testing.T, b *Built) {
	for _, tc := range []struct {
		prog  string
		args  []string
		ready string // output to wait for before SIGTERM ("-": none, just a moment); "" runs to the end
		code  int
		out   string // a regular expression the output matches
	}{
		{pauseProg, nil, "-", 0, `^$`},
		{pauseProg, []string{"x"}, "", 2, `usage: pause`},
		{proxyProg, []string{"-outbound", "127.0.0.1:0", "-inbound", "127.0.0.1:0", "-admin", "127.0.0.1:0"}, "proxy admin listening", 0, `proxy outbound listening on 127\.0\.0\.1:\d+\n`},
		{proxyProg, []string{"-admin"}, "", 1, `testproxy: flag needs an argument`},
		{workloadProg, []string{"id"}, "", 0, `^uid=\d+ gid=\d+ groups=[0-9,]*\n$`},
		{workloadProg, []string{"sleep", "then", "id"}, "-", 0, `^$`},
		{workloadProg, []string{"serve", "-listen", "127.0.0.1:0", "-name", "x"}, "listening", 0, `^serve x listening on 127\.0\.0\.1:\d+\n$`},
		{workloadProg, []string{"dial", "-addr", "127.0.0.1:1", "-timeout", "1s", "then", "id"}, "", 0, `^dial 127\.0\.0\.1:1 failed: .*\nuid=`},
		{workloadProg, []string{"dial", "-addr", "127.0.0.1:1", "-must", "-timeout", "1s", "then", "id"}, "", 1, `^dial 127\.0\.0\.1:1 failed: .*\nworkload: dial 127\.0\.0\.1:1 failed`},
		{workloadProg, []string{"nope"}, "", 1, `usage: workload`},
	} {
		t.Run(strings.Join(append([]string{tc.prog}, tc.args...), " "), func(t *testing.T) {
			var out syncFile
			cmd := exec.Command(b.Bin(tc.prog), tc.args...)
			cmd.Stdout, cmd.Stderr = &out, &out
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			switch tc.ready {
			case "":
			case "-": // no output: give it time to be running, not starting
				time.Sleep(200 * time.Millisecond)
				cmd.Process.Signal(syscall.SIGTERM)
			default:
				for deadline := time.Now().Add(10 * time.Second); !strings.Contains(out.String(), tc.ready) && time.Now().Before(deadline); {
					time.Sleep(10 * time.Millisecond)
				}
				cmd.Process.Signal(syscall.SIGTERM)
			}
			err := cmd.Wait()
			code := 0
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				code = ee.ExitCode()
			} else if err != nil {
				t.Fatal(err)
			}
			if code != tc.code || !regexp.MustCompile(tc.out).MatchString(out.String()) {
				t.Errorf("exit %d, output %q; want exit %d, output matching %s", code, out.String(), tc.code, tc.out)
			}
		})
	}
}

// syncFile collects a program's output while the test reads it.
type syncFile struct {
	mu sync.Mutex
	b  strings.Builder
}

func (f *syncFile) Write(p []byte) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.b.Write(p)
}

func (f *syncFile) String() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.b.String()
}

// The unmounted configuration is the image's without the two lines that need a volume, and
// HAProxy accepts it with neither the admin socket's directory nor the token in place.
func TestHAProxyUnmountedConfig(t *testing.T) {
	full, unmounted := string(HAProxyConfig), string(HAProxyUnmountedConfig)
	if got, want := strings.Count(full, "\n")-strings.Count(unmounted, "\n"), 2; got != want {
		t.Errorf("unmounted.cfg has %d lines fewer than haproxy.cfg, want %d", got, want)
	}
	directives := func(cfg string) string { // without the comment lines
		var s strings.Builder
		for line := range strings.Lines(cfg) {
			if !strings.HasPrefix(strings.TrimSpace(line), "#") {
				s.WriteString(line)
			}
		}
		return s.String()
	}
	for _, mounted := range []string{"/run/haproxy/", "/var/run/secrets/mesh/"} {
		inFull, inUnmounted := strings.Contains(directives(full), mounted), strings.Contains(directives(unmounted), mounted)
		if !inFull || inUnmounted {
			t.Errorf("%s: in haproxy.cfg %v, in unmounted.cfg %v; want only in haproxy.cfg", mounted, inFull, inUnmounted)
		}
	}
	if got := string(withoutMounted([]byte("a\nb # mounted\nc # mounted  \nd # mounted here\n"))); got != "a\nd # mounted here\n" {
		t.Errorf("withoutMounted = %q", got)
	}
	if _, err := os.Stat(HAProxyBinary); err != nil {
		t.Skipf("%s: %v (bash hack/host-deps.sh installs Debian's haproxy package)", HAProxyBinary, err)
	}
	dir := t.TempDir()
	for name, cfg := range map[string][]byte{"unmounted.cfg": HAProxyUnmountedConfig, "haproxy.cfg": HAProxyConfig} {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, cfg, 0o644); err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command(HAProxyBinary, "-c", "-f", path).CombinedOutput()
		if want := name == "unmounted.cfg"; (err == nil) != want {
			t.Errorf("haproxy -c -f %s without the volumes: %v, want valid %v\n%s", name, err, want, out)
		}
	}
}
