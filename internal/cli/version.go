package cli

import (
	"github.com/spf13/cobra"

	"github.com/detourmesh/detour/internal/version"
)

// newVersionCommand returns `detour version`: the version, and the commit and settings the
// binary was built with (`detour --version` prints the version alone).
func newVersionCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print detour's version, the commit it was built from and the build's settings",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			_, err := cmd.OutOrStdout().Write([]byte(version.Read().String()))
			return err
		},
	}
}
