// Package nsutil is the one way detour runs code inside another network namespace: lock the OS
// thread, switch, run, switch back. If switching back fails the thread stays locked, so the Go
// runtime discards it when the goroutine ends instead of reusing a thread in the wrong namespace.
package nsutil

import (
	"fmt"
	"os"
	"runtime"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Do runs fn with the calling goroutine's thread in the network namespace at path (for example
// /var/run/netns/cni-1234 or /proc/PID/ns/net). fn must not start goroutines that depend on the
// namespace: they run on other threads. Processes fn starts inherit the namespace.
func Do(path string, fn func() error) (err error) {
	target, err := netns.GetFromPath(path)
	if err != nil {
		return fmt.Errorf("open network namespace %s: %w", path, err)
	}
	defer target.Close()

	runtime.LockOSThread()
	origin, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("open the current network namespace: %w", err)
	}
	defer origin.Close()
	if err := netns.Set(target); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("enter network namespace %s: %w", path, err)
	}
	// Switch back also when fn panics, so a recovered panic never leaves the goroutine in the
	// pod's namespace.
	defer func() {
		if setErr := netns.Set(origin); setErr != nil {
			// Leave the thread locked: the runtime terminates it when this goroutine exits.
			err = fmt.Errorf("return from network namespace %s: %w (after: %v)", path, setErr, err)
			return
		}
		runtime.UnlockOSThread()
	}()
	return fn()
}

// Scratch runs fn with the calling goroutine's thread in a new, empty network namespace, which
// the kernel removes once fn has returned (nothing else holds it); path names it for code that
// enters namespaces by path ([Do]). It needs CAP_SYS_ADMIN. fn must not start goroutines that
// depend on the namespace.
func Scratch(fn func(path string) error) (err error) {
	runtime.LockOSThread()
	origin, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("open the current network namespace: %w", err)
	}
	defer origin.Close()
	scratch, err := netns.New() // unshare(CLONE_NEWNET): this thread is in it now
	if err != nil {
		if setErr := netns.Set(origin); setErr == nil {
			runtime.UnlockOSThread()
		}
		return fmt.Errorf("create a scratch network namespace: %w", err)
	}
	defer scratch.Close()
	defer func() {
		if setErr := netns.Set(origin); setErr != nil {
			err = fmt.Errorf("return from the scratch network namespace: %w (after: %v)", setErr, err)
			return // the thread stays locked: the runtime discards it
		}
		runtime.UnlockOSThread()
	}()
	return fn(fmt.Sprintf("/proc/%d/task/%d/ns/net", os.Getpid(), unix.Gettid()))
}

// OwnUserNamespace reports whether the network namespace at path belongs to a user namespace
// other than the caller's — a pod with hostUsers: false — where the kernel refuses iptables'
// owner matches written from outside. It says no when it cannot tell.
func OwnUserNamespace(path string) bool {
	f, err := os.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	fd, err := unix.IoctlRetInt(int(f.Fd()), unix.NS_GET_USERNS)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	var owner, ours unix.Stat_t
	if unix.Fstat(fd, &owner) != nil || unix.Stat("/proc/self/ns/user", &ours) != nil {
		return false
	}
	return owner.Ino != ours.Ino || owner.Dev != ours.Dev
}
