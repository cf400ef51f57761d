package cli

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/detourmesh/detour/annotations"
	"github.com/detourmesh/detour/internal/manifest"
	"github.com/detourmesh/detour/iptables"
)

// newRulesCommand returns `detour rules`, the ruleset the CNI plugin would install for a pod.
func newRulesCommand() *cobra.Command {
	var file, family, backend string
	cmd := &cobra.Command{
		Use:   "rules -f POD.yaml",
		Short: "Print the iptables-restore input the CNI plugin would install for an injected pod",
		Long: `rules reads an injected pod (or a workload whose pod template was injected, e.g. the output of
detour inject): the first pod or pod template of the stream, passing over other documents and
searching the items of a List. It prints the nat-table rules the detour CNI plugin installs in its network
namespace, as iptables-restore input: IPv4 first, then IPv6, each after a comment line. With
--family the output is exactly one family's input, ready for iptables-restore --test. With
--backend nftables (or auto, which writes it in every fresh pod namespace on a kernel with
nf_tables) it prints detour's own nf_tables table instead, in nft list syntax, as nft list table
inet detour shows it in the pod's namespace.`,
		Example: `  # The rules of a running pod:
  kubectl get pod web-7d4b9 -o yaml | detour rules -f -

  # Check that the IPv4 rules of an injected Deployment load:
  detour inject -f deploy.yaml --proxy-image=proxy:v1 | detour rules -f - --family=ipv4 | iptables-restore --test

  # The table of the nftables backend:
  kubectl get pod web-7d4b9 -o yaml | detour rules -f - --backend nftables`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var families []iptables.Family
			switch family {
			case "all":
				families = []iptables.Family{iptables.IPv4, iptables.IPv6}
			case "ipv4":
				families = []iptables.Family{iptables.IPv4}
			case "ipv6":
				families = []iptables.Family{iptables.IPv6}
			default:
				return fmt.Errorf("--family %q: use ipv4, ipv6 or all", family)
			}
			var nft bool
			switch backend {
			case "iptables", "legacy", "nft":
			case "nftables", "auto":
				nft = true
			default:
				return fmt.Errorf("--backend %q: use iptables (legacy, nft: iptables-restore input) or nftables (auto's choice in a fresh pod namespace: nft list syntax)", backend)
			}
			in, closeIn, err := openInput(cmd, file)
			if err != nil {
				return err
			}
			defer closeIn()
			name, a, err := manifest.PodAnnotations(in)
			if err != nil {
				return fmt.Errorf("read %s: %w", file, err)
			}
			if !annotations.IsInjected(a) {
				return fmt.Errorf("%s is not injected (no %s annotation): detour installs no rules for it; inject it first (detour inject, or the webhook)", name, annotations.Injected)
			}
			r, err := annotations.ParseRedirect(a)
			if err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			out := cmd.OutOrStdout()
			if nft {
				configs := make([]iptables.Config, len(families))
				for i, f := range families {
					configs[i] = iptables.ConfigFromRedirect(r, f)
				}
				rs, err := iptables.BuildNFT(configs...)
				if err != nil {
					return fmt.Errorf("%s: %w", name, err)
				}
				fmt.Fprint(out, rs.String())
				return nil
			}
			for _, f := range families {
				rs, err := iptables.Build(iptables.ConfigFromRedirect(r, f))
				if err != nil {
					return fmt.Errorf("%s: %w", name, err)
				}
				if len(families) > 1 {
					fmt.Fprintf(out, "# %s: %s rules (%s-restore input)\n", name, f, map[iptables.Family]string{iptables.IPv4: "iptables", iptables.IPv6: "ip6tables"}[f])
				}
				fmt.Fprint(out, rs.Restore())
			}
			return nil
		},
	}
	cmd.Flags().StringVarP(&file, "filename", "f", "", "the pod or workload YAML/JSON; - reads standard input")
	cmd.Flags().StringVar(&family, "family", "all", "ipv4, ipv6 or all")
	cmd.Flags().StringVar(&backend, "backend", "iptables", "iptables (iptables-restore input, for the legacy and nft backends) or nftables (nft list syntax; auto is the same)")
	_ = cmd.MarkFlagRequired("filename")
	return cmd
}
