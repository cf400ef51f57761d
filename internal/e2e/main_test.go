package e2e

import (
	"os"
	"testing"
)

func TestMain(m *testing.M) { ServeHolder(); os.Exit(m.Run()) }
