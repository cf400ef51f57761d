package netlab

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"time"
)

// DialLine connects to addr over TCP and returns the first line the server sends (the servers
// of the tests and the demo answer with who they are and where the connection was headed).
func DialLine(addr string, timeout time.Duration) (string, error) {
	c, err := net.DialTimeout("tcp", addr, timeout)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(timeout))
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil && !errors.Is(err, io.EOF) {
		return "", fmt.Errorf("read the answer from %s: %w", addr, err)
	}
	return strings.TrimSpace(line), nil
}
