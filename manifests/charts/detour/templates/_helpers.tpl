{{/* Common labels of every object. */}}
{{- define "detour.labels" -}}
app.kubernetes.io/name: detour
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end }}

{{/* Selector labels of one component: include with (list $ "webhook"). */}}
{{- define "detour.selector" -}}
app.kubernetes.io/name: detour
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "detour.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The webhook configuration file: the values' config, with the validator image defaulted
to detour's own image. */}}
{{- define "detour.webhookConfig" -}}
{{- $config := deepCopy .Values.webhook.config -}}
{{- if and (not (dig "proxy" "image" "" $config)) (not .Values.renderBundle) -}}
{{- fail "webhook.config.proxy.image is required: set it to your mesh's proxy image, for example --set webhook.config.proxy.image=ghcr.io/example/proxy:v1 (detour ships no proxy)" -}}
{{- end -}}
{{- $validator := default (dict) $config.validator -}}
{{- if not $validator.image -}}
{{- $_ := set $validator "image" (include "detour.image" .) -}}
{{- end -}}
{{- $_ := set $config "validator" $validator -}}
{{- toYaml $config -}}
{{- end }}

{{- define "detour.pluginEntryFlags" -}}
- --api-timeout={{ .Values.nodeAgent.plugin.apiTimeout }}
- --iptables-backend={{ .Values.nodeAgent.plugin.iptablesBackend }}
- --plugin-log-level={{ .Values.nodeAgent.plugin.logLevel }}
{{- with .Values.nodeAgent.plugin.logFile }}
- --plugin-log-file={{ . }}
{{- end }}
- --exclude-namespaces={{ join "," .Values.nodeAgent.plugin.excludeNamespaces }}
- --ipv6={{ .Values.nodeAgent.plugin.ipv6 }}
{{- end }}

{{/* The annotation keys only the webhook writes (annotations.WebhookKeys; a test keeps them
equal), quoted for CEL. */}}
{{- define "detour.webhookKeys" -}}
'detour.dev/injected', 'detour.dev/proxy-uid', 'detour.dev/proxy-inbound-port', 'detour.dev/proxy-outbound-port', 'detour.dev/redirect-skip-inbound-ports', 'detour.dev/redirect-skip-outbound-ports', 'detour.dev/redirect-skip-outbound-cidrs', 'detour.dev/exempt-uids', 'detour.dev/exempt-gids', 'detour.dev/validator-sentinels', 'detour.dev/validator-check-port', 'detour.dev/redirect-inbound', 'detour.dev/init-egress-status', 'detour.dev/validator'
{{- end }}
