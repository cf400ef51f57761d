package framework

import (
	"context"
	"os"
	"strings"
	"time"
)

// Tail returns the last lines of s, for a failure message.
func Tail(s string, lines int) string {
	l := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(l) > lines {
		l = l[len(l)-lines:]
	}
	return strings.Join(l, "\n")
}

// ReadFile returns the content of p, or nothing.
func ReadFile(p string) string {
	data, _ := os.ReadFile(p)
	return string(data)
}

// SleepCtx sleeps for d and reports whether ctx is still live.
func SleepCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	select {
	case <-ctx.Done():
		return false
	case <-time.After(d):
		return true
	}
}
