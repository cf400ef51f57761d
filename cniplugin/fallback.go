package cniplugin

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/detourmesh/detour/internal/fsutil"
)

// A pod that asked for inbound connections to its listening ports only gets every inbound
// connection redirected where the kernel refuses the socket lookup (iptables.InboundFallback).
// The rules say so themselves (CNI CHECK and `detour check` read them); for people, ADD records
// the sandbox in the state directory and DEL takes the record away, and the node agent, which
// reads the directory, puts an Event on the pod and serves detour_cni_inbound_fallback_pods.

// FallbackDirName is the directory in the plugin's state directory that holds one
// FallbackRecord per sandbox running with the inbound fallback, named after its container ID.
const FallbackDirName = "inbound-fallback"

// FallbackRecord is a sandbox that got the inbound fallback.
type FallbackRecord struct {
	Namespace   string    `json:"namespace"`
	Name        string    `json:"name"`
	UID         string    `json:"uid,omitempty"`
	ContainerID string    `json:"containerID"`
	Refusal     string    `json:"refusal"`
	Time        time.Time `json:"time"`
}

// Message is what the pod's Event says.
func (r FallbackRecord) Message() string {
	return fmt.Sprintf("detour.dev/redirect-inbound is listening, but the kernel refused the socket lookup when the pod's sandbox was set up (%s), "+
		"so every inbound connection of this pod goes to the proxy, as with detour.dev/inbound-capture: all: load nft_socket (nftables backend) or xt_socket (iptables backends) on the node, then recreate the pod",
		r.Refusal)
}

// fallbackWarning is ADD's log line's warning for a pod that fell back.
func fallbackWarning(refused error) string {
	return fmt.Sprintf("the kernel refused the socket lookup of detour.dev/redirect-inbound: listening (%v), so every inbound connection of this pod goes to the proxy, as with detour.dev/inbound-capture: all; load nft_socket (nftables backend) or xt_socket (iptables backends) on the node and recreate the pod (docs/troubleshooting.md)", refused)
}

// recordFallback records c's sandbox as running with the inbound fallback. Best effort: a
// record it cannot write must not fail the pod, whose rules already say it fell back.
func (p *Plugin) recordFallback(c *call, refused error) {
	if p.StateDir == "" || !validContainerID(c.args.ContainerID) {
		return
	}
	r := FallbackRecord{Namespace: c.pod.Namespace, Name: c.pod.Name, UID: c.pod.UID, ContainerID: c.args.ContainerID,
		Refusal: refused.Error(), Time: time.Now().UTC()}
	data, err := json.Marshal(r)
	if err == nil {
		dir := filepath.Join(p.StateDir, FallbackDirName)
		if err = os.MkdirAll(dir, 0o755); err == nil {
			_, err = fsutil.WriteFileAtomic(filepath.Join(dir, c.args.ContainerID+".json"), data, 0o644)
		}
	}
	if err != nil {
		c.warning += fmt.Sprintf("; record the fallback in %s: %v", p.StateDir, err)
	}
}

// forgetFallback removes c's sandbox's fallback record, if any.
func (p *Plugin) forgetFallback(c *call) {
	if p.StateDir == "" || !validContainerID(c.args.ContainerID) {
		return
	}
	path := filepath.Join(p.StateDir, FallbackDirName, c.args.ContainerID+".json")
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		c.warning = strings.TrimPrefix(c.warning+fmt.Sprintf("; remove the fallback record %s: %v", path, err), "; ")
	}
}

// validContainerID reports whether id can name a file: the CNI spec allows alphanumerics,
// underscores, periods and hyphens, and the runtime checks it, but a file name is built from it.
func validContainerID(id string) bool {
	return id != "" && id != "." && id != ".." && !strings.ContainsAny(id, `/\`)
}

// ReadFallbacks returns the records in the state directory dir, oldest first; a missing
// directory is none, a record it cannot parse is skipped and named in err.
func ReadFallbacks(dir string) ([]FallbackRecord, error) {
	entries, err := os.ReadDir(filepath.Join(dir, FallbackDirName))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read the plugin's fallback records: %w", err)
	}
	var out []FallbackRecord
	var errs []error
	for _, e := range entries {
		if e.IsDir() || filepath.Ext(e.Name()) != ".json" {
			continue
		}
		path := filepath.Join(dir, FallbackDirName, e.Name())
		data, err := os.ReadFile(path)
		if errors.Is(err, os.ErrNotExist) {
			continue // DEL took it away meanwhile
		}
		var r FallbackRecord
		if err == nil {
			err = json.Unmarshal(data, &r)
		}
		if err == nil && (r.Namespace == "" || r.Name == "" || r.ContainerID == "") {
			err = errors.New("no namespace, name or container ID")
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("fallback record %s: %w", path, err))
			continue
		}
		out = append(out, r)
	}
	slices.SortFunc(out, func(a, b FallbackRecord) int { return a.Time.Compare(b.Time) })
	return out, errors.Join(errs...)
}
