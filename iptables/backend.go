package iptables

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
)

// Backend is how detour writes its rules: natively over netlink into a nf_tables table of its
// own (nftables), which needs no tool on the host, or with the iptables tools of the legacy
// xtables interface or of nf_tables (iptables-nft). auto chooses per pod namespace (autoChoice):
// nftables unless the namespace holds detour's iptables rules already or legacy rules of
// another tool, or the kernel has no nf_tables; the iptables tools' backends must not be mixed
// in a namespace, so among them auto uses the one that already holds rules.
type Backend string

const (
	BackendAuto     Backend = "auto"
	BackendLegacy   Backend = "legacy"
	BackendNFT      Backend = "nft"
	BackendNFTables Backend = "nftables"
)

// ParseBackend parses "auto", "legacy", "nft" or "nftables"; an empty string is auto.
func ParseBackend(s string) (Backend, error) {
	switch b := Backend(s); b {
	case "":
		return BackendAuto, nil
	case BackendAuto, BackendLegacy, BackendNFT, BackendNFTables:
		return b, nil
	}
	return "", fmt.Errorf("iptables backend %q is not one of auto, legacy, nft, nftables", s)
}

func (b Backend) other() Backend {
	if b == BackendLegacy {
		return BackendNFT
	}
	return BackendLegacy
}

// tools are the save and restore commands of one backend and family.
type tools struct {
	backend       Backend
	save, restore string
}

// lookupTools finds the save and restore tools of backend b for family f on PATH: the
// backend-specific names (iptables-nft-save), or the plain names when they resolve to b's
// multi-call binary (as on distributions without the alternatives).
func lookupTools(b Backend, f Family) (tools, error) {
	prefix := "iptables"
	if f == IPv6 {
		prefix = "ip6tables"
	}
	find := func(op string) (string, error) {
		if p, err := exec.LookPath(prefix + "-" + string(b) + "-" + op); err == nil {
			return p, nil
		}
		p, err := exec.LookPath(prefix + "-" + op)
		if err == nil && resolvesTo(p) == b {
			return p, nil
		}
		return "", fmt.Errorf("no %s-%s-%s (or %s-%s of that backend) on PATH", prefix, b, op, prefix, op)
	}
	save, err := find("save")
	if err != nil {
		return tools{}, err
	}
	restore, err := find("restore")
	if err != nil {
		return tools{}, err
	}
	return tools{backend: b, save: save, restore: restore}, nil
}

// resolvesTo tells which backend the tool at path is, from the multi-call binary it links to
// (xtables-nft-multi, xtables-legacy-multi); a plain binary is legacy (iptables before 1.8).
func resolvesTo(path string) Backend {
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		return ""
	}
	base := filepath.Base(real)
	switch {
	case strings.Contains(base, "nft"):
		return BackendNFT
	case strings.Contains(base, "legacy"), strings.HasPrefix(base, "ip"):
		return BackendLegacy
	}
	return ""
}

// hostDefault is the backend the host's own iptables command uses, the one kube-proxy and the
// primary CNI most likely chose; nft when there is no iptables command.
func hostDefault() Backend {
	if p, err := exec.LookPath("iptables"); err == nil {
		if b := resolvesTo(p); b != "" {
			return b
		}
	}
	if _, err := exec.LookPath("iptables-legacy-restore"); err == nil {
		if _, err := exec.LookPath("iptables-nft-restore"); err != nil {
			return BackendLegacy
		}
	}
	return BackendNFT
}
