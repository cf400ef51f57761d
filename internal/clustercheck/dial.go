package clustercheck

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/portforward"
	"k8s.io/client-go/transport/spdy"
	streamhttp "k8s.io/streaming/pkg/httpstream"
)

// DialFunc opens a TCP connection to a webhook endpoint, for the certificate check.
type DialFunc func(ctx context.Context, ep Endpoint) (net.Conn, error)

// DialDirect dials the endpoint's address: it works where the pod network is reachable (the
// check running in a pod, or on a node).
func DialDirect(ctx context.Context, ep Endpoint) (net.Conn, error) {
	var d net.Dialer
	return d.DialContext(ctx, "tcp", net.JoinHostPort(ep.Address, strconv.Itoa(int(ep.Port))))
}

// PortForward returns a DialFunc that reaches the endpoint's pod through the API server, the
// way kubectl port-forward does (websocket, falling back to SPDY): it needs only the
// kubeconfig and create on pods/portforward, so it works from a laptop outside the cluster
// network. The API server's service proxy would not do: it terminates TLS itself and never
// shows the client the certificate the webhook serves.
func PortForward(cfg *rest.Config, client kubernetes.Interface) DialFunc {
	return func(ctx context.Context, ep Endpoint) (net.Conn, error) {
		if ep.Pod == "" {
			return nil, fmt.Errorf("endpoint %s names no pod to forward a port to", ep.Address)
		}
		url := client.CoreV1().RESTClient().Post().Resource("pods").Namespace(ep.Namespace).Name(ep.Pod).SubResource("portforward").URL()
		transport, upgrader, err := spdy.RoundTripperFor(cfg)
		if err != nil {
			return nil, fmt.Errorf("port-forward to pod %s/%s: %w", ep.Namespace, ep.Pod, err)
		}
		// As kubectl port-forward: websocket first, SPDY when the upgrade is refused.
		dialer := spdy.NewDialerForStreaming(upgrader, &http.Client{Transport: transport}, http.MethodPost, url)
		if ws, err := portforward.NewSPDYOverWebsocketDialerForStreaming(url, cfg); err == nil {
			dialer = portforward.NewFallbackDialerForStreaming(ws, dialer, func(err error) bool {
				return streamhttp.IsUpgradeFailure(err) || streamhttp.IsHTTPSProxyError(err)
			})
		}
		fwCtx, stop := context.WithCancel(context.WithoutCancel(ctx))
		ready := make(chan struct{})
		fw, err := portforward.NewOnAddressesForStreamingWithContext(fwCtx, dialer, []string{"127.0.0.1"}, []string{"0:" + strconv.Itoa(int(ep.Port))}, ready, io.Discard, io.Discard)
		if err != nil {
			stop()
			return nil, fmt.Errorf("port-forward to pod %s/%s: %w", ep.Namespace, ep.Pod, err)
		}
		done := make(chan error, 1)
		go func() { done <- fw.ForwardPorts() }()
		select {
		case <-ready:
		case err := <-done:
			stop()
			return nil, fmt.Errorf("port-forward to pod %s/%s port %d: %w", ep.Namespace, ep.Pod, ep.Port, err)
		case <-ctx.Done():
			stop()
			return nil, fmt.Errorf("port-forward to pod %s/%s port %d: %w", ep.Namespace, ep.Pod, ep.Port, ctx.Err())
		}
		ports, err := fw.GetPorts()
		if err != nil || len(ports) == 0 {
			stop()
			return nil, fmt.Errorf("port-forward to pod %s/%s: no local port (%v)", ep.Namespace, ep.Pod, err)
		}
		var d net.Dialer
		conn, err := d.DialContext(ctx, "tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(int(ports[0].Local))))
		if err != nil {
			stop()
			return nil, fmt.Errorf("port-forward to pod %s/%s: %w", ep.Namespace, ep.Pod, err)
		}
		return &forwarded{Conn: conn, stop: stop}, nil
	}
}

// forwarded is a connection through a port-forward; closing it ends the forward.
type forwarded struct {
	net.Conn
	stop func()
}

func (f *forwarded) Close() error {
	err := f.Conn.Close()
	f.stop()
	return err
}
