// Package ctxtime holds the waits that end early when their context does, for the retries of
// the webhook and the CNI plugin (which keeps its imports few).
package ctxtime

import (
	"context"
	"time"
)

// Sleep waits d, or until ctx ends (then its error).
func Sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
