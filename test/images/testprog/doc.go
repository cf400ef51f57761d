// Package testprog is the logic of the end-to-end tests' own programs, each a thin main in
// test/images: pause (a sandbox's PID 1), testproxy (a real transparent proxy on detour's
// ports) and workload (serves, dials and prints its identity, in steps chained by "then").
// test/images builds them into the test images; unit tests run them in-process.
package testprog
