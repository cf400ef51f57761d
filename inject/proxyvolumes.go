package inject

import (
	"fmt"
	"path"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/detourmesh/detour/annotations"
)

// What a production proxy needs beside its image and command (issue 43): its configuration file,
// an identity token, a state directory — volumes the webhook adds to the pod and mounts in the
// proxy — and its own lifecycle hooks. The volumes are of the kinds the restricted Pod Security
// Standard allows, so an injected pod that passed it still does.

// proxyVolumeKinds are the volume sources proxy.volumes may use: those the restricted Pod
// Security Standard allows (k8s.io/pod-security-admission, restrictedVolumes), but the
// persistent and CSI ones, which a proxy never needs in every pod.
var proxyVolumeKinds = []string{"configMap", "downwardAPI", "emptyDir", "projected", "secret"}

// volumeKind names the one source of v that proxy.volumes allows, "" when it has none, or
// another when it has another or more than one.
func volumeKind(v *corev1.Volume) string {
	var kinds []string
	s := &v.VolumeSource
	for _, k := range []struct {
		name string
		set  bool
	}{
		{"configMap", s.ConfigMap != nil}, {"downwardAPI", s.DownwardAPI != nil},
		{"emptyDir", s.EmptyDir != nil}, {"projected", s.Projected != nil}, {"secret", s.Secret != nil},
	} {
		if k.set {
			kinds = append(kinds, k.name)
		}
	}
	if len(kinds) == 1 {
		return kinds[0]
	}
	if len(kinds) > 1 {
		return strings.Join(kinds, " and ")
	}
	var none corev1.VolumeSource
	if *s == none {
		return ""
	}
	return "another"
}

// completeProxyVolumes checks proxy.volumes, proxy.volumeMounts and proxy.lifecycle into c,
// with the API server's defaults filled in (defaultVolumeSource, checkHook); check collects the
// errors.
func (f *File) completeProxyVolumes(c *Config, check func(error)) {
	p := f.Proxy
	names := map[string]bool{}
	for i, v := range p.Volumes {
		field := fmt.Sprintf("proxy.volumes[%d]", i)
		switch kind := volumeKind(&v); {
		case len(validation.IsDNS1123Label(v.Name)) > 0:
			check(invalid(field+".name", fmt.Sprintf("%q", v.Name), "a volume's name is a DNS label: lower-case letters, digits and '-', at most 63 characters"))
		case v.Name == annotations.ValidatorVolume:
			check(invalid(field+".name", v.Name, "detour's own volume has this name (the check at the proxy's start mounts detour's image there): choose another"))
		case names[v.Name]:
			check(invalid(field+".name", v.Name, "the name is listed twice"))
		case kind == "":
			check(invalid(field, v.Name, "set its source: one of %s", strings.Join(proxyVolumeKinds, ", ")))
		case !slices.Contains(proxyVolumeKinds, kind):
			check(invalid(field, v.Name, "use one source of %s (the kinds every pod may have under the restricted Pod Security Standard); it has %s", strings.Join(proxyVolumeKinds, ", "), kind))
		default:
			if err := checkVolumeSource(field, &v.VolumeSource); err != nil {
				check(err)
				continue
			}
			names[v.Name] = true
			v := *v.DeepCopy()
			defaultVolumeSource(&v.VolumeSource)
			c.Proxy.Volumes = append(c.Proxy.Volumes, v)
		}
	}
	paths := map[string]bool{}
	for i, m := range p.VolumeMounts {
		field := fmt.Sprintf("proxy.volumeMounts[%d]", i)
		clean := path.Clean(m.MountPath)
		switch {
		case !names[m.Name]:
			check(invalid(field+".name", fmt.Sprintf("%q", m.Name), "mount one of proxy.volumes (%s)", proxyVolumeList(c.Proxy.Volumes)))
		case !path.IsAbs(m.MountPath):
			check(invalid(field+".mountPath", fmt.Sprintf("%q", m.MountPath), "write an absolute path"))
		case clean == annotations.ValidatorMountPath || strings.HasPrefix(clean, annotations.ValidatorMountPath+"/") || strings.HasPrefix(annotations.ValidatorMountPath, clean+"/") || clean == "/":
			check(invalid(field+".mountPath", m.MountPath, "detour mounts its own image at %s in the proxy: mount elsewhere", annotations.ValidatorMountPath))
		case paths[clean]:
			check(invalid(field+".mountPath", m.MountPath, "two mounts have this path"))
		case path.IsAbs(m.SubPath) || slices.Contains(strings.Split(m.SubPath, "/"), ".."):
			check(invalid(field+".subPath", fmt.Sprintf("%q", m.SubPath), "write a path inside the volume: relative, without '..'"))
		case m.MountPropagation != nil && *m.MountPropagation != corev1.MountPropagationNone:
			check(invalid(field+".mountPropagation", *m.MountPropagation, "the proxy runs unprivileged: leave it unset or None"))
		default:
			paths[clean] = true
			c.Proxy.VolumeMounts = append(c.Proxy.VolumeMounts, *m.DeepCopy())
		}
	}
	if l := p.Lifecycle; l != nil {
		c.Proxy.Lifecycle = l.DeepCopy()
		for _, h := range []struct {
			field string
			h     *corev1.LifecycleHandler
		}{{"proxy.lifecycle.postStart", c.Proxy.Lifecycle.PostStart}, {"proxy.lifecycle.preStop", c.Proxy.Lifecycle.PreStop}} {
			if h.h != nil {
				check(checkHook(h.field, h.h))
			}
		}
	}
	for i := range c.Proxy.Env {
		if r := c.Proxy.Env[i].ValueFrom; r != nil && r.FieldRef != nil && r.FieldRef.APIVersion == "" {
			r.FieldRef.APIVersion = "v1"
		}
	}
}

// checkVolumeSource refuses what the API server would refuse in every injected pod: a configMap
// without its name, a secret without its secretName, a projected volume without sources or with
// a token source without its path.
func checkVolumeSource(field string, s *corev1.VolumeSource) error {
	switch {
	case s.ConfigMap != nil && s.ConfigMap.Name == "":
		return invalid(field+".configMap.name", nil, "is required: the ConfigMap of the pod's namespace to mount")
	case s.Secret != nil && s.Secret.SecretName == "":
		return invalid(field+".secret.secretName", nil, "is required: the Secret of the pod's namespace to mount")
	case s.Projected != nil && len(s.Projected.Sources) == 0:
		return invalid(field+".projected.sources", nil, "list at least one source, e.g. {serviceAccountToken: {audience: mesh.example, path: token}}")
	}
	if s.Projected != nil {
		for j, src := range s.Projected.Sources {
			if t := src.ServiceAccountToken; t != nil && t.Path == "" {
				return invalid(fmt.Sprintf("%s.projected.sources[%d].serviceAccountToken.path", field, j), nil, "is required: the token's file name in the volume")
			}
		}
	}
	return nil
}

// defaultVolumeSource fills in the defaults the API server would (k8s.io/kubernetes
// pkg/apis/core/v1, defaults.go), so that an injected pod is stored exactly as the webhook wrote
// it and admitting it again changes nothing: file modes 0644, a token valid for an hour, field
// references of API version v1.
func defaultVolumeSource(s *corev1.VolumeSource) {
	mode := func(m **int32) {
		if *m == nil {
			*m = ptr(int32(0o644))
		}
	}
	fields := func(items []corev1.DownwardAPIVolumeFile) {
		for i := range items {
			if r := items[i].FieldRef; r != nil && r.APIVersion == "" {
				r.APIVersion = "v1"
			}
		}
	}
	switch {
	case s.ConfigMap != nil:
		mode(&s.ConfigMap.DefaultMode)
	case s.Secret != nil:
		mode(&s.Secret.DefaultMode)
	case s.DownwardAPI != nil:
		mode(&s.DownwardAPI.DefaultMode)
		fields(s.DownwardAPI.Items)
	case s.Projected != nil:
		mode(&s.Projected.DefaultMode)
		for _, src := range s.Projected.Sources {
			if t := src.ServiceAccountToken; t != nil && t.ExpirationSeconds == nil {
				t.ExpirationSeconds = ptr(int64(3600))
			}
			if d := src.DownwardAPI; d != nil {
				fields(d.Items)
			}
		}
	}
}

// checkHook checks one of the proxy's own lifecycle hooks, and fills in an httpGet's defaults
// as the API server would.
func checkHook(field string, h *corev1.LifecycleHandler) error {
	n := 0
	for _, set := range []bool{h.Exec != nil, h.HTTPGet != nil, h.Sleep != nil, h.TCPSocket != nil} {
		if set {
			n++
		}
	}
	switch {
	case h.TCPSocket != nil:
		return invalid(field+".tcpSocket", nil, "a tcpSocket hook is deprecated and does nothing: use exec, httpGet or sleep")
	case n != 1:
		return invalid(field, nil, "set one of exec, httpGet or sleep")
	case h.Exec != nil && len(h.Exec.Command) == 0:
		return invalid(field+".exec.command", nil, "is required: the command the kubelet runs in the proxy container")
	case h.Sleep != nil && h.Sleep.Seconds < 0:
		return invalid(field+".sleep.seconds", h.Sleep.Seconds, "a number of seconds from 0 to the pods' terminationGracePeriodSeconds (30 unless a pod sets it)")
	case h.HTTPGet != nil:
		if err := checkProbeHost(field, &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: h.HTTPGet}}); err != nil {
			return err
		}
		if h.HTTPGet.Path == "" {
			h.HTTPGet.Path = "/"
		}
		if h.HTTPGet.Scheme == "" {
			h.HTTPGet.Scheme = corev1.URISchemeHTTP
		}
	}
	return nil
}

// proxySleepError denies pod when one of the proxy's own sleep hooks sleeps longer than pod's
// grace period, which the API server refuses.
func proxySleepError(pod *corev1.Pod, cfg *Config) error {
	l := cfg.Proxy.Lifecycle
	if l == nil {
		return nil
	}
	grace := int64(corev1.DefaultTerminationGracePeriodSeconds)
	if pod.Spec.TerminationGracePeriodSeconds != nil {
		grace = *pod.Spec.TerminationGracePeriodSeconds
	}
	for _, h := range []struct {
		field string
		h     *corev1.LifecycleHandler
	}{{"proxy.lifecycle.postStart", l.PostStart}, {"proxy.lifecycle.preStop", l.PreStop}} {
		if h.h != nil && h.h.Sleep != nil && h.h.Sleep.Seconds > grace {
			return deny("the webhook configuration's %s.sleep.seconds (%d) is longer than the pod's terminationGracePeriodSeconds (%d), which the API server refuses: raise the pod's grace period to at least %d, or ask the cluster admin to shorten the proxy's sleep",
				h.field, h.h.Sleep.Seconds, grace, h.h.Sleep.Seconds)
		}
	}
	return nil
}

func proxyVolumeList(vs []corev1.Volume) string {
	if len(vs) == 0 {
		return "none is set"
	}
	var names []string
	for _, v := range vs {
		names = append(names, v.Name)
	}
	return strings.Join(names, ", ")
}

// addProxyVolumes adds the configuration's proxy volumes to pod and mounts them in proxy; a pod
// volume of the same name, or a sleep hook longer than the pod's grace period, is a denial that
// says what to change.
func addProxyVolumes(pod *corev1.Pod, proxy *corev1.Container, cfg *Config) error {
	if err := proxySleepError(pod, cfg); err != nil {
		return err
	}
	for i, v := range cfg.Proxy.Volumes {
		if slices.ContainsFunc(pod.Spec.Volumes, func(o corev1.Volume) bool { return o.Name == v.Name }) {
			return deny("the pod's volume %q has the name of a volume detour adds for the proxy (the webhook configuration's proxy.volumes[%d]): rename the pod's volume, or ask the cluster admin to rename the proxy's", v.Name, i)
		}
	}
	for _, v := range cfg.Proxy.Volumes {
		pod.Spec.Volumes = append(pod.Spec.Volumes, *v.DeepCopy())
	}
	for _, m := range cfg.Proxy.VolumeMounts {
		proxy.VolumeMounts = append(proxy.VolumeMounts, *m.DeepCopy())
	}
	return nil
}
