package repair

import (
	"strings"
	"testing"
)

func TestFlagsParse(t *testing.T) {
	f := DefaultFlags()
	f.NodeName = "node-1"
	if cfg, err := f.Parse(); err != nil || cfg.Rate != 1 || cfg.Burst != 5 || !cfg.RequireCNIReady {
		t.Errorf("defaults = %+v, %v", cfg, err)
	}
	for _, tc := range []struct {
		modify func(*Flags)
		want   string
	}{
		{func(f *Flags) { f.NodeName = "" }, `--node-name ""`},
		{func(f *Flags) { f.Rate = 0 }, "--rate 0"},
		{func(f *Flags) { f.Rate = -1 }, "--rate -1"},
		{func(f *Flags) { f.Burst = 0 }, "--burst 0"},
		{func(f *Flags) { f.RecreatingOwners = []string{"ReplicaSet"} }, `--recreating-owners entry "ReplicaSet"`},
		{func(f *Flags) { f.RecreatingOwners = []string{"apps/"} }, `--recreating-owners entry "apps/"`},
		{func(f *Flags) { f.DefaultInject = "all" }, `--default-inject "all": use the webhook's defaultInject, "disabled" or "enabled"`},
		{func(f *Flags) { f.ExcludeNamespaces = []string{"Kube_System"} }, `--exclude-namespaces entry "Kube_System"`},
		{func(f *Flags) { f.OwnNamespace = "detour/system" }, `--namespace "detour/system": it must be detour's namespace`},
	} {
		f := DefaultFlags()
		f.NodeName = "node-1"
		tc.modify(&f)
		if _, err := f.Parse(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Parse error %v, want %q", err, tc.want)
		}
	}
}
