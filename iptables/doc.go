// Package iptables builds detour's redirect ruleset and applies it inside a pod's network
// namespace.
//
// [Build] is pure: a [Config] in, a [Ruleset] out, rendered as iptables-restore text for the nat
// table by [Ruleset.Restore] and golden-tested; [BuildNFT] turns the same configs into detour's
// own nf_tables table ([NFTRuleset], native expressions, printed in nft list syntax). [Executor]
// is the one place that touches the kernel: it enters the namespace in Go (no nsenter) and
// applies, removes or checks a ruleset — with one iptables-restore per IP family on the legacy or
// nft backend, or with one netlink transaction and no tool on the nftables backend.
package iptables
