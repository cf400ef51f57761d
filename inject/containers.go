package inject

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"

	"github.com/detourmesh/detour/annotations"
)

// restricted is the security context of both injected containers: a fixed non-root identity,
// no privilege escalation, a read-only root filesystem and no capabilities.
func restricted(uid, gid uint32) *corev1.SecurityContext {
	return &corev1.SecurityContext{
		RunAsUser:                ptr(int64(uid)),
		RunAsGroup:               ptr(int64(gid)),
		RunAsNonRoot:             ptr(true),
		AllowPrivilegeEscalation: ptr(false),
		ReadOnlyRootFilesystem:   ptr(true),
		Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
	}
}

// ValidatorCommand is the validator's command line for cfg: it proves that connections to the
// proxy's outbound port are redirected (see the validator package).
func ValidatorCommand(cfg *Config) []string {
	cmd := []string{
		"detour", "validate",
		fmt.Sprintf("--port=%d", cfg.Proxy.OutboundPort),
		"--timeout=" + cfg.Validator.Timeout.String(),
	}
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
		SecurityContext:          restricted(cfg.Validator.UID, cfg.Validator.GID),
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
		SecurityContext:          restricted(p.UID, p.GID),
		TerminationMessagePath:   terminationMessagePath,
		TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
	}
	for _, e := range p.Env {
		c.Env = append(c.Env, *e.DeepCopy())
	}
	for _, port := range p.AdminPorts {
		c.Ports = append(c.Ports, corev1.ContainerPort{
			Name:          fmt.Sprintf("admin-%d", port),
			ContainerPort: int32(port),
			Protocol:      corev1.ProtocolTCP,
		})
	}
	return c
}

func clone(s []string) []string {
	if s == nil {
		return nil
	}
	return append([]string(nil), s...)
}
