// Package fastpath is what makes an admission of package webhook cheap without changing its
// answer: the JSON patch computed from the typed pods ([Patch]) instead of a diff of the whole
// documents, its encoding ([MarshalPatch]), a deep equality without reflect.DeepEqual's cycle
// map, and an AdmissionReview decoder that reads the body once ([ReviewHandler]). Each falls
// back to controller-runtime's way wherever it is unsure; the webhook's tests hold both ways to
// the same answers.
package fastpath
