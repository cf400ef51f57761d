package framework

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// Run runs argv inside the node's namespaces and returns its stdout; an exit code other than
// 0 is an error that carries stderr.
func (n *Node) Run(ctx context.Context, argv ...string) (string, error) {
	stdout, stderr, err := n.RunSplit(ctx, nil, argv...)
	if err != nil {
		return stdout, fmt.Errorf("%w\n%s", err, stderr)
	}
	return stdout, nil
}

// RunSplit runs argv (with env added to the node's environment) inside the node's
// namespaces and returns its stdout and stderr apart.
func (n *Node) RunSplit(ctx context.Context, env []string, argv ...string) (stdout, stderr string, err error) {
	dir, err := os.MkdirTemp(filepath.Join(n.Dir, "run"), "cmd-")
	if err != nil {
		return "", "", err
	}
	defer os.RemoveAll(dir)
	outPath, errPath := filepath.Join(dir, "stdout"), filepath.Join(dir, "stderr")
	pid, err := n.holder.start(argv, append(n.env(), env...), outPath, errPath)
	if err != nil {
		return "", "", err
	}
	for {
		exited, code, werr := n.holder.wait(pid, time.Second)
		out, _ := os.ReadFile(outPath)
		errOut, _ := os.ReadFile(errPath)
		stdout, stderr = string(out), string(errOut)
		switch {
		case werr != nil:
			return stdout, stderr, werr
		case exited && code != 0:
			return stdout, stderr, fmt.Errorf("%s: exit code %d", strings.Join(argv, " "), code)
		case exited:
			return stdout, stderr, nil
		}
		if ctx.Err() != nil {
			n.holder.stop(pid, time.Second)
			return stdout, stderr, fmt.Errorf("%s: %w", strings.Join(argv, " "), ctx.Err())
		}
	}
}

// Kubectl runs the real kubectl inside the node as admin.
func (n *Node) Kubectl(ctx context.Context, args ...string) (stdout, stderr string, err error) {
	return n.RunSplit(ctx, nil, append([]string{n.Bin("kubectl"), "--kubeconfig", n.Kubeconfig}, args...)...)
}

// Helm runs the real helm inside the node as admin.
func (n *Node) Helm(ctx context.Context, args ...string) (string, error) {
	home := filepath.Join(n.Dir, "helm")
	env := []string{"HELM_CACHE_HOME=" + home + "/cache", "HELM_CONFIG_HOME=" + home + "/config", "HELM_DATA_HOME=" + home + "/data"}
	stdout, stderr, err := n.RunSplit(ctx, env, append([]string{n.Bin("helm"), "--kubeconfig", n.Kubeconfig}, args...)...)
	if err != nil {
		return stdout, fmt.Errorf("%w\n%s", err, stderr)
	}
	return stdout, nil
}

// HolderPID is the PID of the node's namespace holder (holder.go): /proc/<pid>/root is the file
// system as the node's processes see it, /proc/<pid>/ns/net the node's network namespace.
func (n *Node) HolderPID() int { return n.holder.pid }

// Dial connects to addr from the node's network namespace (the host, as pods see it).
func (n *Node) Dial(ctx context.Context, network, addr string) (net.Conn, error) {
	return netnsDialer{n.holder.netns()}.DialContext(ctx, network, addr)
}

// Greeting connects to addr from the node's network namespace and returns what the server
// there says first (the workload's serve names the connection's peer).
func (n *Node) Greeting(ctx context.Context, addr string) (string, error) {
	dctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := n.Dial(dctx, "tcp", addr)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 512)
	got, err := conn.Read(buf)
	if got == 0 {
		return "", fmt.Errorf("no greeting from %s: %w", addr, err)
	}
	return string(buf[:got]), nil
}

// Bin is the path of the binary name in [Node.BinDir].
func (n *Node) Bin(name string) string { return filepath.Join(n.BinDir, name) }

// Ctr is the command line of ctr with args, talking to the node's containerd in the
// namespace of the kubelet's images (k8s.io); [Node.Run] runs it.
func (n *Node) Ctr(args ...string) []string {
	return append([]string{n.Bin("ctr"), "--address", n.containerdSocket(), "--namespace", "k8s.io"}, args...)
}

func (n *Node) containerdSocket() string {
	return filepath.Join(n.Dir, "containerd", "containerd.sock")
}
