package framework

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The holder is a child of the test process, cloned into a new network namespace and a new
// mount namespace. It prepares both (private mounts; the host's mounts below /run, /var/lib
// and /var/log detached and scratch directories over those three, so that the node's mount
// table holds nothing of the host's there; fake files over the machine-wide sysctls the
// kubelet would rewrite; the node's links) and then starts
// every process of the node on request, so that all of them share its namespaces without
// `ip netns exec` (which remounts /sys) or nsenter. It is their subreaper: containerd's shims
// and the pods' processes stay its descendants. When its stdin closes — the test ended, or
// died — it kills everything in the run's cgroup and exits; the namespaces go with the last
// process.

// holderEnv carries the holder's spec (JSON); its presence makes the test binary a holder.
const holderEnv = "DETOUR_E2E_HOLDER"

// holderSpec is what the holder sets up before it serves requests.
type holderSpec struct {
	RunDir string
	Cgroup string // the run's cgroup, relative to each hierarchy's root
	// Sysctls maps machine-wide /proc/sys files to the value their stand-in starts with.
	Sysctls map[string]string
	// Binds are directories of the node mounted over paths of the control-plane node's, so
	// that the paths one chart gives every node (the CNI directories, the plugin's log) are
	// each node's own.
	Binds []bindMount
	Net   netSpec
}

// bindMount mounts Source over Target in the node's mount namespace.
type bindMount struct{ Source, Target string }

// request asks the holder to start a process, wait for one, or stop one.
type request struct {
	ID   int      `json:"id"`
	Op   string   `json:"op"` // "start", "wait" or "stop"
	Argv []string `json:"argv,omitempty"`
	Env  []string `json:"env,omitempty"`
	Dir  string   `json:"dir,omitempty"`
	// Stdout and Stderr receive the process's output (appended); Stderr defaults to Stdout.
	Stdout  string        `json:"stdout,omitempty"`
	Stderr  string        `json:"stderr,omitempty"`
	PID     int           `json:"pid,omitempty"`
	Timeout time.Duration `json:"timeout,omitempty"`
}

type response struct {
	ID       int    `json:"id"`
	PID      int    `json:"pid,omitempty"`
	Exited   bool   `json:"exited,omitempty"`
	ExitCode int    `json:"exitCode,omitempty"`
	Err      string `json:"err,omitempty"`
}

// holderReady is the first line the holder writes: empty Err once set up.
type holderReady struct {
	Err string `json:"err"`
}

// runHolder is the holder's main.
func runHolder(specJSON string) int {
	out := json.NewEncoder(os.Stdout)
	var spec holderSpec
	err := json.Unmarshal([]byte(specJSON), &spec)
	if err == nil {
		err = setUpHolder(spec)
	}
	if err != nil {
		out.Encode(holderReady{Err: err.Error()})
		return 1
	}
	if err := out.Encode(holderReady{}); err != nil {
		return 1
	}
	h := &holder{procs: map[int]*holderProc{}, out: out}
	go h.reapOrphans()
	h.serve(os.Stdin)
	h.stopAll()
	killCgroup(spec.Cgroup, os.Getpid())
	h.reap()
	return 0
}

func setUpHolder(spec holderSpec) error {
	if err := unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("become a subreaper: %w", err)
	}
	// Nothing mounted from here on reaches the host, and nothing the host mounts later
	// reaches the node.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make the mount namespace private: %w", err)
	}
	if err := detachHostMounts(spec.RunDir, append(slices.Clone(ReplacedDirs), spec.RunDir)...); err != nil {
		return err
	}
	root := filepath.Join(spec.RunDir, "root")
	for _, dir := range ReplacedDirs {
		scratch := filepath.Join(root, dir)
		if err := os.MkdirAll(scratch, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(scratch, dir, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("mount %s over %s: %w", scratch, dir, err)
		}
	}
	for _, b := range spec.Binds {
		if err := unix.Mount(b.Source, b.Target, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("mount %s over %s: %w", b.Source, b.Target, err)
		}
	}
	sysctlDir := filepath.Join(spec.RunDir, "sysctl")
	if err := os.MkdirAll(sysctlDir, 0o755); err != nil {
		return err
	}
	for path, value := range spec.Sysctls {
		stand := filepath.Join(sysctlDir, filepath.Base(filepath.Dir(path))+"."+filepath.Base(path))
		if err := os.WriteFile(stand, []byte(value+"\n"), 0o644); err != nil {
			return err
		}
		if err := unix.Mount(stand, path, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("mount a stand-in over %s: %w", path, err)
		}
	}
	// The stand-ins hide parts of /proc, and the kernel lets a user namespace (a pod with
	// hostUsers: false) mount a procfs only where one is already fully visible in its mount
	// namespace ("mount_too_revealing"); a node has such a /proc, this one here, with the
	// flags runc mounts the pods' /proc with.
	visible := filepath.Join(spec.RunDir, "proc")
	if err := os.MkdirAll(visible, 0o555); err != nil {
		return err
	}
	if err := unix.Mount("proc", visible, "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mount a fully visible procfs at %s: %w", visible, err)
	}
	return setUpNodeNetwork(spec.Net)
}

type holder struct {
	mu    sync.Mutex
	procs map[int]*holderProc
	outMu sync.Mutex
	out   *json.Encoder
}

type holderProc struct {
	cmd  *exec.Cmd
	done chan struct{}
}

// serve answers requests until in closes; each request runs on its own goroutine, so a long
// wait does not hold up a start.
func (h *holder) serve(in io.Reader) {
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var req request
		if err := json.Unmarshal(sc.Bytes(), &req); err != nil {
			h.reply(response{Err: fmt.Sprintf("bad request: %v", err)})
			continue
		}
		go func() { h.reply(h.handle(req)) }()
	}
}

func (h *holder) reply(r response) {
	h.outMu.Lock()
	defer h.outMu.Unlock()
	h.out.Encode(r)
}

func (h *holder) handle(req request) response {
	resp := response{ID: req.ID}
	switch req.Op {
	case "start":
		pid, err := h.start(req)
		resp.PID = pid
		if err != nil {
			resp.Err = err.Error()
		}
	case "wait", "stop":
		h.mu.Lock()
		p := h.procs[req.PID]
		h.mu.Unlock()
		if p == nil {
			resp.Err = fmt.Sprintf("process %d was not started by the holder", req.PID)
			break
		}
		if req.Op == "stop" {
			p.stop(req.Timeout)
		} else {
			select {
			case <-p.done:
			case <-time.After(req.Timeout):
			}
		}
		select {
		case <-p.done:
			resp.Exited, resp.ExitCode = true, p.cmd.ProcessState.ExitCode()
		default:
		}
	default:
		resp.Err = fmt.Sprintf("unknown operation %q", req.Op)
	}
	return resp
}

// reapOrphans reaps the processes that became the holder's children when their parent
// exited (containerd's shims, the pods' processes after a shim is killed), so that none stays
// a zombie. The holder's own children are left to their exec.Cmd.
func (h *holder) reapOrphans() {
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGCHLD)
	for range sigs {
		h.reap()
	}
}

func (h *holder) reap() {
	h.mu.Lock()
	defer h.mu.Unlock()
	self := os.Getpid()
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || h.procs[pid] != nil {
			continue
		}
		if ppid, state, ok := procParent(pid); ok && ppid == self && state == "Z" {
			unix.Wait4(pid, nil, unix.WNOHANG, nil)
		}
	}
}

// procParent returns the parent and state of pid.
func procParent(pid int) (ppid int, state string, ok bool) {
	fields, err := procStat(pid)
	if err != nil {
		return 0, "", false
	}
	ppid, err = strconv.Atoi(fields[1])
	return ppid, fields[0], err == nil
}

// procStat returns the fields of /proc/PID/stat after the command name (which may hold
// spaces and ends at the last ')'): state first, then the parent, ...
func procStat(pid int) ([]string, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil, err
	}
	s := string(data)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(fields) < 20 {
		return nil, fmt.Errorf("short /proc/%d/stat", pid)
	}
	return fields, nil
}

func (h *holder) start(req request) (int, error) {
	if len(req.Argv) == 0 {
		return 0, errors.New("start: no command")
	}
	stdout, err := os.OpenFile(req.Stdout, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return 0, err
	}
	defer stdout.Close()
	stderr := stdout
	if req.Stderr != "" && req.Stderr != req.Stdout {
		if stderr, err = os.OpenFile(req.Stderr, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644); err != nil {
			return 0, err
		}
		defer stderr.Close()
	}
	cmd := exec.Command(req.Argv[0], req.Argv[1:]...)
	cmd.Env, cmd.Dir, cmd.Stdout, cmd.Stderr = req.Env, req.Dir, stdout, stderr
	// Held from start to registration, so that the reaper never takes this child's status.
	h.mu.Lock()
	defer h.mu.Unlock()
	if err := cmd.Start(); err != nil {
		return 0, err
	}
	p := &holderProc{cmd: cmd, done: make(chan struct{})}
	go func() { cmd.Wait(); close(p.done) }()
	h.procs[cmd.Process.Pid] = p
	return cmd.Process.Pid, nil
}

// stop sends SIGTERM, then SIGKILL after grace.
func (p *holderProc) stop(grace time.Duration) {
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return
	case <-time.After(grace):
	}
	p.cmd.Process.Kill()
	<-p.done
}

// stopAll stops the processes the holder started, newest first, in parallel (each gets a few
// seconds to end cleanly).
func (h *holder) stopAll() {
	h.mu.Lock()
	procs := make([]*holderProc, 0, len(h.procs))
	for _, p := range h.procs {
		procs = append(procs, p)
	}
	h.mu.Unlock()
	var wg sync.WaitGroup
	for _, p := range procs {
		wg.Add(1)
		go func() { defer wg.Done(); p.stop(3 * time.Second) }()
	}
	wg.Wait()
}
