package nodeagent

import (
	"fmt"
	"net/http"
)

// Handler serves the agent's probes: /readyz answers 200 while the node is ready for injected
// pods (detour's entry in place and the node marked, the state the ready label shows) and 503
// with the reason otherwise; /healthz answers 200 while the process serves.
func (a *Agent) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		ok, reason := a.Ready()
		if !ok {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		fmt.Fprintln(w, reason)
	})
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	return mux
}
