// Command workload is the end-to-end tests' application (the images detour.test/workload*:1):
// steps chained by "then" that serve, dial and print the process's identity, e.g.
//
//	workload dial -addr 10.0.0.1:80 -must then serve -listen :8080
//
// It exits 0 at the end of the chain or on SIGTERM/SIGINT, and 1 when a step marked -must
// fails (or the command line is wrong).
package main

import "github.com/detourmesh/detour/test/images/testprog"

func main() { testprog.Main("workload", testprog.Workload) }
