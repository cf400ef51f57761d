package repair

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"sync"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// The pod informer lists its node's pods with a limit of podPage and then watches from the
// list's resourceVersion — never a watch that sends the initial objects, which client-go opens
// by default and which has no limit: the API server's priority and fairness charges a list by
// its limit, and a watch from a resourceVersion one seat (docs/scale.md).
func TestPodInformerListsThenWatches(t *testing.T) {
	var mu sync.Mutex
	var requests []url.Values
	watching := make(chan struct{}, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/api/v1/pods" {
			http.NotFound(w, r)
			return
		}
		q := r.URL.Query()
		mu.Lock()
		requests = append(requests, q)
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		if q.Get("watch") == "true" {
			w.WriteHeader(http.StatusOK)
			w.(http.Flusher).Flush()
			select {
			case watching <- struct{}{}:
			default:
			}
			<-r.Context().Done()
			return
		}
		fmt.Fprint(w, `{"kind":"PodList","apiVersion":"v1","metadata":{"resourceVersion":"7"},"items":[]}`)
	}))
	defer srv.Close()
	client, err := kubernetes.NewForConfig(&rest.Config{Host: srv.URL})
	if err != nil {
		t.Fatal(err)
	}
	c := newNodeController(t, client)
	ctx, cancel := context.WithCancel(context.Background())
	c.factory.Start(ctx.Done())
	defer func() { cancel(); c.factory.Shutdown() }()
	select {
	case <-watching:
	case <-time.After(20 * time.Second):
		t.Fatal("the pod informer did not watch within 20 s")
	}

	mu.Lock()
	defer mu.Unlock()
	if len(requests) != 2 {
		t.Fatalf("requests %v, want a list and a watch", requests)
	}
	list, watch := requests[0], requests[1]
	if limit, err := strconv.Atoi(list.Get("limit")); list.Has("watch") || err != nil || limit < 1 || limit > podPage || list.Get("fieldSelector") != "spec.nodeName=node-1" {
		t.Errorf("first request %v: want a list of node-1's pods with a limit of at most %d", list, podPage)
	}
	if watch.Get("watch") != "true" || watch.Get("resourceVersion") != "7" || watch.Has("sendInitialEvents") || watch.Has("limit") || watch.Get("fieldSelector") != "spec.nodeName=node-1" {
		t.Errorf("second request %v: want a watch of node-1's pods from the list's resourceVersion 7, without sendInitialEvents", watch)
	}
}
