package cli

import (
	"strings"
	"testing"
)

// --hold without --uninstall is refused before anything else happens (no node name, no API
// client needed to say so).
func TestInstallCNIHoldNeedsUninstall(t *testing.T) {
	_, _, err := run(t, "", "install-cni", "--hold", "--node-name=n1", "--api-server=https://10.96.0.1:443")
	if err == nil || !strings.Contains(err.Error(), "--hold only applies with --uninstall") || !strings.Contains(err.Error(), "add --uninstall, or drop --hold") {
		t.Errorf("install-cni --hold = %v", err)
	}
	if code := ExitCode(err); code == 0 {
		t.Errorf("exit code %d", code)
	}
}

// The flags the chart passes exist.
func TestInstallCNIFlags(t *testing.T) {
	cmd := newInstallCNICommand()
	for name, def := range map[string]string{
		"plugin-service-account": "", "plugin-service-account-namespace": "", "plugin-token-ttl": "1h0m0s",
		"hold": "false", "uninstall": "false",
	} {
		f := cmd.Flags().Lookup(name)
		if f == nil || f.DefValue != def {
			t.Errorf("flag --%s = %+v, want default %q", name, f, def)
		}
	}
}
