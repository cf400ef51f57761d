// Package load measures a running detour webhook: it sends AdmissionReview requests for a
// realistic pod over TLS, at a fixed concurrency (as fast as the webhook answers) or at a fixed
// rate, and reports throughput, latency percentiles, errors and the server's peak RSS.
// hack/webhook-load is its command; docs/benchmarks-webhook.md records the figures.
package load

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// Pod is the benchmark's realistic pod: three init containers (root, a UID of its own, the
// app's UID) and two app containers with resources, probes, env and volumes.
func Pod() *corev1.Pod {
	res := corev1.ResourceRequirements{
		Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("250m"), corev1.ResourceMemory: resource.MustParse("256Mi")},
		Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("512Mi")},
	}
	c := func(name string, uid int64) corev1.Container {
		return corev1.Container{
			Name:            name,
			Image:           "registry.example.com/payments/" + name + ":1.42.0",
			Env:             []corev1.EnvVar{{Name: "MODE", Value: "production"}, {Name: "PORT", Value: "8080"}},
			Ports:           []corev1.ContainerPort{{Name: "http", ContainerPort: 8080, Protocol: corev1.ProtocolTCP}},
			Resources:       *res.DeepCopy(),
			VolumeMounts:    []corev1.VolumeMount{{Name: "data", MountPath: "/data"}},
			ReadinessProbe:  &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/ready", Port: intstr.FromInt32(8080)}}},
			SecurityContext: &corev1.SecurityContext{RunAsUser: &uid, RunAsGroup: &uid},
		}
	}
	return &corev1.Pod{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
		ObjectMeta: metav1.ObjectMeta{
			GenerateName: "payments-api-",
			Labels:       map[string]string{"app": "payments", "tier": "backend"},
			Annotations: map[string]string{
				"detour.dev/sidecar-mode": "container", "detour.dev/skip-outbound-ports": "5432,6379", "team": "payments",
			},
		},
		Spec: corev1.PodSpec{
			InitContainers: []corev1.Container{c("migrate", 0), c("fetch", 1001), c("warm", 1000)},
			Containers:     []corev1.Container{c("api", 1000), c("worker", 1000)},
			Volumes:        []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}}},
		},
	}
}

// Review returns the AdmissionReview request body for creating pod in namespace.
func Review(pod *corev1.Pod, namespace string) ([]byte, error) {
	raw, err := json.Marshal(pod)
	if err != nil {
		return nil, err
	}
	return json.Marshal(&admissionv1.AdmissionReview{
		TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"},
		Request: &admissionv1.AdmissionRequest{
			UID:       types.UID("00000000-0000-0000-0000-000000000000"),
			Kind:      metav1.GroupVersionKind{Version: "v1", Kind: "Pod"},
			Resource:  metav1.GroupVersionResource{Version: "v1", Resource: "pods"},
			Namespace: namespace,
			Operation: admissionv1.Create,
			Object:    runtime.RawExtension{Raw: raw},
		},
	})
}

// Options of a [Run].
type Options struct {
	// URL is the webhook's mutate URL, e.g. https://127.0.0.1:9443/mutate-v1-pod.
	URL string
	// CA is the PEM bundle that signed the webhook's certificate.
	CA []byte
	// Body is the AdmissionReview request sent, every time.
	Body []byte
	// Concurrency is the number of requests in flight at most (and of connections).
	Concurrency int
	// Rate is requests per second; 0 sends as fast as the webhook answers (closed loop).
	Rate int
	// Duration of the run.
	Duration time.Duration
}

// Result of a [Run].
type Result struct {
	Requests   int
	Errors     int
	FirstError string
	Elapsed    time.Duration
	// Latencies are sorted; at a fixed rate they are measured from each request's scheduled
	// start, so a stalled server is not hidden by requests that were never sent.
	Latencies []time.Duration
}

// Throughput is the completed requests per second.
func (r Result) Throughput() float64 { return float64(r.Requests) / r.Elapsed.Seconds() }

// Percentile returns the p-th percentile (0 < p ≤ 100) latency.
func (r Result) Percentile(p float64) time.Duration {
	if len(r.Latencies) == 0 {
		return 0
	}
	i := int(float64(len(r.Latencies))*p/100+0.5) - 1
	return r.Latencies[min(max(i, 0), len(r.Latencies)-1)]
}

// Client returns an HTTP client for o: TLS verified against o.CA, HTTP/1.1 keep-alive, one
// connection per concurrent request.
func Client(o Options) (*http.Client, error) {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(o.CA) {
		return nil, errors.New("load: the CA bundle holds no PEM certificate")
	}
	return &http.Client{
		Timeout: 10 * time.Second,
		Transport: &http.Transport{
			TLSClientConfig:     &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12},
			MaxIdleConns:        o.Concurrency,
			MaxIdleConnsPerHost: o.Concurrency,
			MaxConnsPerHost:     o.Concurrency,
			ForceAttemptHTTP2:   false,
		},
	}, nil
}

// Run sends requests until o.Duration has passed.
func Run(ctx context.Context, o Options) (Result, error) {
	if o.Concurrency < 1 || o.Duration <= 0 || o.Rate < 0 {
		return Result{}, fmt.Errorf("load: concurrency %d, duration %s and rate %d must be positive", o.Concurrency, o.Duration, o.Rate)
	}
	client, err := Client(o)
	if err != nil {
		return Result{}, err
	}
	ctx, cancel := context.WithTimeout(ctx, o.Duration)
	defer cancel()

	// Work items carry their scheduled start time.
	work := make(chan time.Time, o.Concurrency)
	go func() {
		defer close(work)
		if o.Rate == 0 {
			for ctx.Err() == nil {
				select {
				case work <- time.Now():
				case <-ctx.Done():
				}
			}
			return
		}
		interval := time.Second / time.Duration(o.Rate)
		next := time.Now()
		for {
			if d := time.Until(next); d > 0 {
				select {
				case <-time.After(d):
				case <-ctx.Done():
					return
				}
			}
			select {
			case work <- next:
			case <-ctx.Done():
				return
			}
			next = next.Add(interval)
		}
	}()

	var mu sync.Mutex
	var res Result
	var errs atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for range o.Concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lat := make([]time.Duration, 0, 4096)
			var firstErr string
			for scheduled := range work {
				if err := send(client, o.URL, o.Body); err != nil {
					if errs.Add(1) == 1 {
						firstErr = err.Error()
					}
					continue
				}
				lat = append(lat, time.Since(scheduled))
			}
			mu.Lock()
			res.Latencies = append(res.Latencies, lat...)
			if firstErr != "" {
				res.FirstError = firstErr
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	res.Elapsed = time.Since(start)
	res.Requests = len(res.Latencies)
	res.Errors = int(errs.Load())
	slices.Sort(res.Latencies)
	return res, nil
}

// send posts one review and checks that the webhook allowed and patched the pod.
func send(client *http.Client, url string, body []byte) error {
	resp, err := client.Post(url, "application/json", bytes.NewReader(body))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("HTTP %d: %s", resp.StatusCode, b)
	}
	if bytes.Contains(b, []byte(`"allowed":true`)) && bytes.Contains(b, []byte(`"patch":"`)) {
		return nil
	}
	var review admissionv1.AdmissionReview
	if err := json.Unmarshal(b, &review); err != nil {
		return fmt.Errorf("decode the response: %w", err)
	}
	return fmt.Errorf("the webhook did not inject the pod: %s", b)
}

// Check sends one review and decodes the whole response: allowed, a JSON patch that parses,
// and the injected marker among its operations. Run checks less (allowed, and a patch), to
// leave the CPU to the webhook.
func Check(ctx context.Context, o Options) error {
	client, err := Client(o)
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, o.URL, bytes.NewReader(o.Body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var review admissionv1.AdmissionReview
	if err := json.NewDecoder(resp.Body).Decode(&review); err != nil {
		return fmt.Errorf("decode the response: %w", err)
	}
	r := review.Response
	if r == nil || !r.Allowed || r.PatchType == nil || *r.PatchType != admissionv1.PatchTypeJSONPatch {
		return fmt.Errorf("the webhook did not patch the pod: %+v", r)
	}
	var ops []struct {
		Op   string `json:"op"`
		Path string `json:"path"`
	}
	if err := json.Unmarshal(r.Patch, &ops); err != nil {
		return fmt.Errorf("decode the patch: %w", err)
	}
	for _, op := range ops {
		if op.Path == "/metadata/annotations/detour.dev~1injected" {
			return nil
		}
	}
	return fmt.Errorf("the patch does not mark the pod injected: %s", r.Patch)
}

// PeakRSS returns the peak resident set size (VmHWM) of process pid, in bytes.
func PeakRSS(pid int) (int64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("parse VmHWM %q: %w", v, err)
			}
			return kb * 1024, nil
		}
	}
	return 0, fmt.Errorf("no VmHWM in /proc/%d/status", pid)
}

// CPUTime returns the CPU time (user and system) process pid has used so far.
func CPUTime(pid int) (time.Duration, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	// The command name, in parentheses, may hold spaces; the fields after it are fixed.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, fmt.Errorf("parse /proc/%d/stat", pid)
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 13 {
		return 0, fmt.Errorf("parse /proc/%d/stat: %d fields", pid, len(f))
	}
	// Fields 14 and 15 of stat (utime, stime) are the 12th and 13th after the name, in clock
	// ticks of 1/100 s on Linux.
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("parse /proc/%d/stat: utime %q stime %q", pid, f[11], f[12])
	}
	return time.Duration(utime+stime) * 10 * time.Millisecond, nil
}
