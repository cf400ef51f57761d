// Command detour is detour's CLI and every long-running component (webhook, node agent,
// repair controller, validator) as a subcommand. See internal/cli.
package main

import (
	"os"

	"github.com/detourmesh/detour/internal/cli"
)

func main() { os.Exit(cli.Main(os.Args[1:])) }
