package nodeagent

// Passes returns how many reconcile passes a's Run has finished, so a test can wait until the
// agent has looked again before it checks that nothing happened.
func Passes(a *Agent) int64 { return a.passes.Load() }
