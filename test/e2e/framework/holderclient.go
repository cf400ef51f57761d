package framework

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"
)

// holderClient is the test's side of the holder.
type holderClient struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	pid   int

	mu      sync.Mutex
	nextID  int
	pending map[int]chan response
	dead    chan struct{} // closed when the holder's stdout ends
}

// startHolder starts the holder in new network and mount namespaces, moves it into the run's
// cgroup before it starts anything, and waits until it has set the namespaces up.
func startHolder(spec holderSpec, logPath string) (*holderClient, error) {
	specJSON, err := json.Marshal(spec)
	if err != nil {
		return nil, err
	}
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer logFile.Close()
	cmd := exec.Command(self)
	cmd.Env = append(os.Environ(), holderEnv+"="+string(specJSON))
	cmd.Stderr = logFile
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNS | syscall.CLONE_NEWNET}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start the node's namespace holder: %w", err)
	}
	c := &holderClient{cmd: cmd, stdin: stdin, pid: cmd.Process.Pid, pending: map[int]chan response{}, dead: make(chan struct{})}
	if err := joinCgroup(spec.Cgroup, c.pid); err != nil {
		c.close()
		return nil, fmt.Errorf("move the holder into cgroup %s: %w", spec.Cgroup, err)
	}
	dec := json.NewDecoder(stdout)
	var ready holderReady
	if err := dec.Decode(&ready); err != nil {
		c.close()
		return nil, fmt.Errorf("the node's namespace holder did not start (log in %s): %w", logPath, err)
	}
	if ready.Err != "" {
		c.close()
		return nil, fmt.Errorf("set up the node's namespaces: %s", ready.Err)
	}
	go c.readLoop(dec)
	return c, nil
}

func (c *holderClient) readLoop(dec *json.Decoder) {
	defer close(c.dead)
	for {
		var r response
		if err := dec.Decode(&r); err != nil {
			return
		}
		c.mu.Lock()
		ch := c.pending[r.ID]
		delete(c.pending, r.ID)
		c.mu.Unlock()
		if ch != nil {
			ch <- r
		}
	}
}

func (c *holderClient) call(req request) (response, error) {
	ch := make(chan response, 1)
	c.mu.Lock()
	c.nextID++
	req.ID = c.nextID
	c.pending[req.ID] = ch
	line, err := json.Marshal(req)
	if err == nil {
		_, err = c.stdin.Write(append(line, '\n'))
	}
	c.mu.Unlock()
	if err != nil {
		return response{}, fmt.Errorf("ask the holder to %s: %w", req.Op, err)
	}
	select {
	case r := <-ch:
		if r.Err != "" {
			return r, fmt.Errorf("holder: %s %v: %s", req.Op, req.Argv, r.Err)
		}
		return r, nil
	case <-c.dead:
		return response{}, fmt.Errorf("the node's namespace holder exited during %s", req.Op)
	}
}

// start starts argv inside the node with its output appended to stdout (and stderr, or
// stdout when stderr is empty).
func (c *holderClient) start(argv, env []string, stdout, stderr string) (int, error) {
	r, err := c.call(request{Op: "start", Argv: argv, Env: env, Stdout: stdout, Stderr: stderr})
	return r.PID, err
}

// wait waits up to timeout for pid to exit and returns whether it did and its exit code.
func (c *holderClient) wait(pid int, timeout time.Duration) (exited bool, code int, err error) {
	r, err := c.call(request{Op: "wait", PID: pid, Timeout: timeout})
	return r.Exited, r.ExitCode, err
}

// stop sends pid SIGTERM, then SIGKILL after grace, and waits for it.
func (c *holderClient) stop(pid int, grace time.Duration) error {
	_, err := c.call(request{Op: "stop", PID: pid, Timeout: grace})
	return err
}

// netns is the path of the node's network namespace.
func (c *holderClient) netns() string { return fmt.Sprintf("/proc/%d/ns/net", c.pid) }

// close ends the holder: it kills everything of the run and exits.
func (c *holderClient) close() error {
	c.stdin.Close()
	done := make(chan error, 1)
	go func() { done <- c.cmd.Wait() }()
	select {
	case err := <-done:
		return err
	case <-time.After(60 * time.Second):
		c.cmd.Process.Kill()
		return fmt.Errorf("the node's namespace holder did not exit within 60 s; killed")
	}
}

// ServeHolder makes the process a node's namespace holder, and exits, when [Start] started
// it as one; otherwise it returns at once. Call it first in TestMain.
func ServeHolder() {
	if spec := os.Getenv(holderEnv); spec != "" {
		os.Exit(runHolder(spec))
	}
}
