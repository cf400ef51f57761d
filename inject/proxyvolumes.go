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

// completeProxyVolumes checks proxy.volumes, proxy.volumeMounts and proxy.lifecycle into c;
// check collects the errors.
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
			names[v.Name] = true
			c.Proxy.Volumes = append(c.Proxy.Volumes, *v.DeepCopy())
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
		case m.MountPropagation != nil && *m.MountPropagation != corev1.MountPropagationNone:
			check(invalid(field+".mountPropagation", *m.MountPropagation, "the proxy runs unprivileged: leave it unset or None"))
		default:
			paths[clean] = true
			c.Proxy.VolumeMounts = append(c.Proxy.VolumeMounts, *m.DeepCopy())
		}
	}
	if l := p.Lifecycle; l != nil {
		for _, h := range []struct {
			field string
			h     *corev1.LifecycleHandler
		}{{"proxy.lifecycle.postStart", l.PostStart}, {"proxy.lifecycle.preStop", l.PreStop}} {
			if h.h != nil && h.h.Exec == nil && h.h.HTTPGet == nil && h.h.Sleep == nil {
				check(invalid(h.field, nil, "set exec, httpGet or sleep"))
			}
			if h.h != nil && h.h.HTTPGet != nil && h.h.HTTPGet.Host != "" {
				check(invalid(h.field+".httpGet.host", h.h.HTTPGet.Host, "leave it unset: the kubelet calls the pod's own IP"))
			}
		}
		c.Proxy.Lifecycle = l.DeepCopy()
	}
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
// volume of the same name is an error naming both (the pod's must be renamed, or the admin's).
func addProxyVolumes(pod *corev1.Pod, proxy *corev1.Container, cfg *Config) error {
	for i, v := range cfg.Proxy.Volumes {
		if slices.ContainsFunc(pod.Spec.Volumes, func(o corev1.Volume) bool { return o.Name == v.Name }) {
			return deny("the pod's volume %q has the name of the proxy's volume %q (the webhook configuration's proxy.volumes[%d]): rename the pod's volume, or ask the cluster admin to rename the proxy's", v.Name, v.Name, i)
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
