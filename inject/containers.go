package inject

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"

	"github.com/detourmesh/detour/annotations"
)

// restricted is the security context of both injected containers: a fixed non-root identity,
// no privilege escalation, a read-only root filesystem, no capabilities and the configured
// seccomp profile (RuntimeDefault unless the configuration says otherwise). Each field the
// restricted Pod Security Standard checks is set on the container itself, so that the injected
// containers pass it whatever the pod's securityContext holds: PodSecurity admission runs after
// the mutating webhooks.
func restricted(uid, gid uint32, seccomp corev1.SeccompProfile) *corev1.SecurityContext {
	return &corev1.SecurityContext{
		SeccompProfile:           seccomp.DeepCopy(),
		RunAsUser:                ptr(int64(uid)),
		RunAsGroup:               ptr(int64(gid)),
		RunAsNonRoot:             ptr(true),
		AllowPrivilegeEscalation: ptr(false),
		ReadOnlyRootFilesystem:   ptr(true),
		Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
	}
}

// ValidatorCommand is the validator container's command line for cfg: it proves that
// connections to the sentinels are redirected to the proxy's outbound port (see the validator
// package).
func ValidatorCommand(cfg *Config) []string {
	return validatorCommand(cfg, fmt.Sprintf("--port=%d", cfg.Proxy.OutboundPort))
}

// validatorCommand is `detour validate` with the configured timeout and sentinels, ports first.
func validatorCommand(cfg *Config, ports ...string) []string {
	cmd := append([]string{"detour", "validate"}, ports...)
	cmd = append(cmd, "--timeout="+cfg.Validator.Timeout.String())
	if cfg.Validator.Sentinel != "" {
		cmd = append(cmd, "--sentinel="+cfg.Validator.Sentinel)
	}
	if cfg.Validator.Sentinel6 != "" {
		cmd = append(cmd, "--sentinel6="+cfg.Validator.Sentinel6)
	}
	return cmd
}

// The fields below are the API server's defaults, set here so that a stored injected pod is
// exactly what the webhook wrote and admitting it again changes nothing.
const (
	terminationMessagePath = "/dev/termination-log"
)

func validatorContainer(cfg *Config) corev1.Container {
	return corev1.Container{
		Name:                     annotations.ValidatorContainer,
		Image:                    cfg.Validator.Image,
		ImagePullPolicy:          cfg.Validator.ImagePullPolicy,
		Command:                  ValidatorCommand(cfg),
		Resources:                *cfg.Validator.Resources.DeepCopy(),
		SecurityContext:          restricted(cfg.Validator.UID, cfg.Validator.GID, cfg.Validator.SeccompProfile),
		TerminationMessagePath:   terminationMessagePath,
		TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
	}
}

func proxyContainer(cfg *Config) corev1.Container {
	p := &cfg.Proxy
	c := corev1.Container{
		Name:                     annotations.ProxyContainer,
		Image:                    p.Image,
		ImagePullPolicy:          p.ImagePullPolicy,
		Command:                  clone(p.Command),
		Args:                     clone(p.Args),
		Resources:                *p.Resources.DeepCopy(),
		ReadinessProbe:           p.ReadinessProbe.DeepCopy(),
		LivenessProbe:            p.LivenessProbe.DeepCopy(),
		StartupProbe:             p.StartupProbe.DeepCopy(),
		Lifecycle:                p.Lifecycle.DeepCopy(),
		SecurityContext:          restricted(p.UID, p.GID, p.SeccompProfile),
		TerminationMessagePath:   terminationMessagePath,
		TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
	}
	for _, e := range p.Env {
		c.Env = append(c.Env, *e.DeepCopy())
	}
	for _, port := range p.AdminPorts {
		c.Ports = append(c.Ports, corev1.ContainerPort{
			Name:          AdminPortName(port),
			ContainerPort: int32(port),
			Protocol:      corev1.ProtocolTCP,
		})
	}
	return c
}

// ValidatorBinary is detour's binary in the proxy container of a pod whose check runs in the
// proxy's start: detour's image is mounted read-only at annotations.ValidatorMountPath.
const ValidatorBinary = annotations.ValidatorMountPath + "/opt/detour/bin/detour"

// foldValidator makes proxy run the validator's check first: its command becomes detour's
// binary from the image volume running `detour validate` with the validator's flags, which
// execs the proxy's own command and arguments once the check passed (the same process: the
// proxy's signals, exit code and output are its own); on failure it exits with the validator's
// code, and the sidecar crash-loops where the validator init container did.
func foldValidator(pod *corev1.Pod, proxy *corev1.Container, cfg *Config) {
	pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{
		Name: annotations.ValidatorVolume,
		VolumeSource: corev1.VolumeSource{Image: &corev1.ImageVolumeSource{
			Reference: cfg.Validator.Image, PullPolicy: cfg.Validator.ImagePullPolicy,
		}},
	})
	proxy.VolumeMounts = append(proxy.VolumeMounts, corev1.VolumeMount{
		Name: annotations.ValidatorVolume, MountPath: annotations.ValidatorMountPath, ReadOnly: true,
	})
	// The check runs as the proxy's UID, whose connections to a sentinel the plugin sends to the
	// check port; a node whose plugin predates the check port sends them to the outbound port,
	// which the check then tries when the check port refuses.
	check := validatorCommand(cfg, fmt.Sprintf("--port=%d", cfg.Validator.CheckPort), fmt.Sprintf("--fallback-port=%d", cfg.Proxy.OutboundPort))
	proxy.Command = append(append([]string{ValidatorBinary}, check[1:]...), "--")
	proxy.Args = append(clone(cfg.Proxy.Command), cfg.Proxy.Args...)
	if pod.Spec.NodeSelector == nil {
		pod.Spec.NodeSelector = map[string]string{}
	}
	pod.Spec.NodeSelector[annotations.ImageVolumesLabel] = "true"
}

func clone(s []string) []string {
	if s == nil {
		return nil
	}
	return append([]string(nil), s...)
}
