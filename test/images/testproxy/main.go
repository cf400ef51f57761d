// Command testproxy is the end-to-end tests' mesh proxy (the image detour.test/proxy:1): a real
// transparent proxy on detour's default ports. Outbound connections redirected to it go to
// their original destination, inbound ones to the app on 127.0.0.1; one line per connection
// on stdout; /ready on the admin port. It exits 0 on SIGTERM or SIGINT.
//
//	testproxy -outbound :4140 -inbound :4143 -admin :4191
package main

import "github.com/detourmesh/detour/test/images/testprog"

func main() { testprog.Main("testproxy", testprog.RunProxy) }
