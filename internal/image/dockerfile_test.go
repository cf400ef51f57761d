package image

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// The Dockerfile is the second way to build detour's image; its final stage must describe the
// image DetourSpec does. Versions are compared symbolically: DetourSpec gets "${VERSION}",
// which is what the Dockerfile's labels say before Docker substitutes the build argument.
func TestDockerfileMatchesDetourSpec(t *testing.T) {
	const root = "../.."
	stage, err := finalStage(filepath.Join(root, "Dockerfile"))
	if err != nil {
		t.Fatal(err)
	}
	const binDir = "/bin-dir-of-make-build"
	spec := DetourSpec(binDir, "${VERSION}")

	if stage.from != "scratch" {
		t.Errorf("final stage is FROM %s, want scratch: a base image adds files DetourSpec does not have", stage.from)
	}
	if stage.user != spec.User {
		t.Errorf("USER %q, DetourSpec %q", stage.user, spec.User)
	}
	if !reflect.DeepEqual(stage.entrypoint, spec.Entrypoint) {
		t.Errorf("ENTRYPOINT %q, DetourSpec %q", stage.entrypoint, spec.Entrypoint)
	}
	if !reflect.DeepEqual(stage.env, spec.Env) {
		t.Errorf("ENV %q, DetourSpec %q", stage.env, spec.Env)
	}
	if !reflect.DeepEqual(stage.labels, spec.Labels) {
		t.Errorf("LABEL %q,\nDetourSpec %q", stage.labels, spec.Labels)
	}
	if len(spec.Cmd) != 0 || spec.WorkingDir != "" {
		t.Errorf("DetourSpec sets Cmd %q or WorkingDir %q: add them to the Dockerfile and to this test", spec.Cmd, spec.WorkingDir)
	}

	want := map[string]File{}
	for _, f := range spec.Files {
		want[f.Path] = f
	}
	got := map[string]bool{}
	for _, c := range stage.copies {
		for _, src := range c.sources {
			dst := path.Join(c.dest, path.Base(src))
			got[dst] = true
			f, ok := want[dst]
			switch {
			case !ok:
				t.Errorf("Dockerfile copies %s to %s; DetourSpec has no such file", src, dst)
			case c.from == "build":
				// A binary of `make build BIN=/out` in the build stage.
				if f.Source == "" || path.Base(src) != filepath.Base(f.Source) || filepath.Dir(f.Source) != binDir {
					t.Errorf("Dockerfile copies %s from the build stage to %s; DetourSpec has %+v there", src, dst, f)
				}
			case c.from == "":
				// A file of the repository: it must hold what DetourSpec embeds.
				b, err := os.ReadFile(filepath.Join(root, src))
				if err != nil {
					t.Errorf("Dockerfile copies %s: %v", src, err)
				} else if f.Data == nil || !bytes.Equal(b, f.Data) {
					t.Errorf("Dockerfile copies %s to %s; DetourSpec's %s differs", src, dst, dst)
				}
			default:
				t.Errorf("Dockerfile copies %s from %q; this test knows the build stage and the context only", src, c.from)
			}
		}
	}
	for p := range want {
		if !got[p] {
			t.Errorf("DetourSpec has %s; the Dockerfile does not copy it", p)
		}
	}
}

// dockerStage is what the test reads of a Dockerfile's stage.
type dockerStage struct {
	from       string
	copies     []dockerCopy
	env        []string
	user       string
	entrypoint []string
	labels     map[string]string
}

type dockerCopy struct {
	from    string // --from stage, "" for the build context
	sources []string
	dest    string
}

// finalStage parses the instructions of the Dockerfile's last stage that describe an image.
// It knows the subset of the syntax detour's Dockerfile uses and fails on anything else in
// that stage, so that a change to the Dockerfile cannot slip past the comparison.
func finalStage(file string) (*dockerStage, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	var lines []string
	var cont strings.Builder
	for _, l := range strings.Split(string(b), "\n") {
		trimmed := strings.TrimSpace(l)
		if strings.HasPrefix(trimmed, "#") || (trimmed == "" && cont.Len() == 0) {
			continue
		}
		if strings.HasSuffix(trimmed, "\\") {
			cont.WriteString(strings.TrimSuffix(trimmed, "\\") + " ")
			continue
		}
		cont.WriteString(trimmed)
		lines = append(lines, cont.String())
		cont.Reset()
	}
	last := -1
	for i, l := range lines {
		if strings.EqualFold(strings.Fields(l)[0], "FROM") {
			last = i
		}
	}
	if last < 0 {
		return nil, fmt.Errorf("%s: no FROM", file)
	}
	st := &dockerStage{from: strings.Fields(lines[last])[1], labels: map[string]string{}}
	for _, l := range lines[last+1:] {
		instr, rest, _ := strings.Cut(l, " ")
		rest = strings.TrimSpace(rest)
		instr = strings.ToUpper(instr)
		words, err := shellWords(rest)
		if err != nil {
			return nil, fmt.Errorf("%s: %s: %w", file, l, err)
		}
		switch instr {
		case "ARG":
			// It only names the build argument the labels use.
		case "COPY":
			c := dockerCopy{}
			for len(words) > 0 && strings.HasPrefix(words[0], "--") {
				flag, val, _ := strings.Cut(words[0], "=")
				if flag != "--from" {
					return nil, fmt.Errorf("%s: %s: flag %s is not compared with DetourSpec: extend the test", file, l, flag)
				}
				c.from, words = val, words[1:]
			}
			if len(words) < 2 {
				return nil, fmt.Errorf("%s: %s: want COPY sources... dest", file, l)
			}
			c.sources, c.dest = words[:len(words)-1], words[len(words)-1]
			st.copies = append(st.copies, c)
		case "ENV":
			for _, w := range words {
				if !strings.Contains(w, "=") {
					return nil, fmt.Errorf("%s: %s: want ENV KEY=VALUE", file, l)
				}
				st.env = append(st.env, w)
			}
		case "USER":
			st.user = rest
		case "ENTRYPOINT":
			st.entrypoint = nil
			if err := json.Unmarshal([]byte(rest), &st.entrypoint); err != nil {
				return nil, fmt.Errorf("%s: %s: want the exec form [\"...\"]: %w", file, l, err)
			}
		case "LABEL":
			for _, w := range words {
				k, v, ok := strings.Cut(w, "=")
				if !ok {
					return nil, fmt.Errorf("%s: %s: want LABEL key=value", file, l)
				}
				st.labels[k] = v
			}
		default:
			return nil, fmt.Errorf("%s: %s: instruction %s is not compared with DetourSpec: extend the test", file, l, instr)
		}
	}
	return st, nil
}

// shellWords splits s into words as the Dockerfile does for LABEL, ENV and COPY: whitespace
// separates, double quotes group (and are removed), a backslash escapes the next character.
// ${VAR} stays as written.
func shellWords(s string) ([]string, error) {
	var words []string
	var w strings.Builder
	inWord, quoted := false, false
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '\\' && i+1 < len(s):
			i++
			w.WriteByte(s[i])
			inWord = true
		case c == '"':
			quoted = !quoted
			inWord = true
		case !quoted && (c == ' ' || c == '\t'):
			if inWord {
				words = append(words, w.String())
				w.Reset()
				inWord = false
			}
		default:
			w.WriteByte(c)
			inWord = true
		}
	}
	if quoted {
		return nil, fmt.Errorf("unterminated quote")
	}
	if inWord {
		words = append(words, w.String())
	}
	return words, nil
}
