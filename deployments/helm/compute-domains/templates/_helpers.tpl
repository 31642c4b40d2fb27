{{/* The namespace everything namespaced goes to. */}}
{{- define "cd.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride -}}
{{- end -}}

{{/* Labels of every object: manifests/base's, plus Helm's own. Selectors use only the first two. */}}
{{- define "cd.labels" -}}
app.kubernetes.io/name: computedomains
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
app.kubernetes.io/part-of: computedomains
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* Pod template labels: as in manifests/base (pod labels stay the same across upgrades). */}}
{{- define "cd.podLabels" -}}
app.kubernetes.io/name: computedomains
app.kubernetes.io/component: {{ . }}
app.kubernetes.io/part-of: computedomains
{{- end -}}

{{- define "cd.selector" -}}
app.kubernetes.io/name: computedomains
app.kubernetes.io/component: {{ . }}
{{- end -}}

{{- define "cd.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The etcd members every service is given (host:port,...): the chart's three, or etcd.endpoints. */}}
{{- define "cd.etcdEndpoint" -}}
{{- if .Values.etcd.enabled -}}
{{- $ns := include "cd.namespace" . -}}
{{- $members := list -}}
{{- range $i := until 3 -}}
{{- $members = append $members (printf "cd-etcd-%d.cd-etcd.%s.svc:2379" $i $ns) -}}
{{- end -}}
{{- join "," $members -}}
{{- else -}}
{{- join "," .Values.etcd.endpoints -}}
{{- end -}}
{{- end -}}

{{/* Whether the services present client certificates: always to the chart's etcd. */}}
{{- define "cd.etcdTls" -}}
{{- if or .Values.etcd.enabled .Values.etcd.tls.enabled }}true{{ end -}}
{{- end -}}

{{/* The day (days since 1970) the chart's etcd certificates expire: the issued ones' while more
     than etcd.certificates.renewBeforeDays are left, else a fresh validityDays from today (then
     templates/etcd-certificates.yaml reissues them). Pods that mount them carry it, so they roll
     when the certificates are renewed. The same for every template of one render. */}}
{{- define "cd.etcdCertsExpiryDay" -}}
{{- include "cd.certsExpiryDay" (dict "root" . "secret" "cd-etcd-server-tls" "certs" .Values.etcd.certificates) -}}
{{- end -}}

{{/* The expiry day of a set of certificates the chart issues, read from the annotation of one of
them (`secret`): kept while more than certs.renewBeforeDays are left, else today plus
certs.validityDays (the set is reissued). */}}
{{- define "cd.certsExpiryDay" -}}
{{- $certs := .certs -}}
{{- $today := div (now | unixEpoch | atoi) 86400 -}}
{{- $issued := lookup "v1" "Secret" (include "cd.namespace" .root) .secret -}}
{{- $expiry := 0 -}}
{{- if $issued -}}
{{- $expiry = (dig "metadata" "annotations" "computedomains.nvidia.com/expiry-day" "0" $issued) | atoi -}}
{{- end -}}
{{- if le (sub $expiry $today) (int $certs.renewBeforeDays) -}}
{{- $expiry = add $today $certs.validityDays -}}
{{- end -}}
{{- $expiry -}}
{{- end -}}

{{/* The expiry day of the advisor's certificates (placement-advisor-certificates.yaml); the advisor's
     and cd-scheduler's pods carry it, so they roll when the certificates are renewed. */}}
{{- define "cd.advisorCertsExpiryDay" -}}
{{- include "cd.certsExpiryDay" (dict "root" . "secret" "cd-placement-advisor-tls" "certs" .Values.placementAdvisor.tls.certificates) -}}
{{- end -}}

{{/* true when the advisor requires mutual TLS (then the chart issues its certificates). */}}
{{- define "cd.advisorTls" -}}
{{- if and .Values.placementAdvisor.enabled .Values.placementAdvisor.tls.enabled }}true{{ end -}}
{{- end -}}

{{/* A workload pod's annotation for the chart's etcd certificates (nothing with your own etcd). */}}
{{- define "cd.etcdCertsAnnotation" -}}
{{- if .Values.etcd.enabled -}}
computedomains.nvidia.com/etcd-certs-expiry-day: {{ include "cd.etcdCertsExpiryDay" . | quote }}
{{- end -}}
{{- end -}}

{{/* --log-level from logVerbosity: a level name, or NVIDIA's klog-style number. */}}
{{- define "cd.logLevelFlag" -}}
{{- $v := toString .Values.logVerbosity -}}
{{- if $v -}}
{{- if regexMatch "^[0-9]+$" $v -}}
- --log-level={{ ge (atoi $v) 5 | ternary "debug" "info" }}
{{- else if has $v (list "debug" "info" "warning" "error") -}}
- --log-level={{ $v }}
{{- else -}}
{{- fail (printf "logVerbosity %q: use debug, info, warning, error or a number" $v) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Pod annotations: the scrape annotations when metrics are on, then the component's own.
     Called with dict "root" "values" (the component's values) "port" (its health port). */}}
{{- define "cd.podAnnotations" -}}
{{- $a := dict -}}
{{- if .values.metrics.enabled -}}
{{- $_ := set $a "prometheus.io/scrape" "true" -}}
{{- $_ := set $a "prometheus.io/port" (toString .port) -}}
{{- $_ := set $a "prometheus.io/path" "/metrics" -}}
{{- end -}}
{{- with .root }}{{ with include "cd.etcdCertsAnnotation" . }}{{ $a = merge $a (fromYaml .) }}{{ end }}{{ end -}}
{{- $a = merge (deepCopy (default dict .values.podAnnotations)) $a -}}
{{- if $a }}
annotations:
  {{- toYaml $a | nindent 2 }}
{{- end -}}
{{- end -}}

{{/* Scheduling and pull settings shared by every pod. Called with dict "root" "values". */}}
{{- define "cd.podScheduling" -}}
{{- with .values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The key prefix, and the etcd client certificate flags and volume (manifests/overlays/production's). */}}
{{- define "cd.etcdFlags" -}}
- --etcd-prefix={{ .Values.etcd.prefix }}
{{- if include "cd.etcdTls" . }}
- --etcd-ca-file=/etc/computedomains/etcd-tls/ca.crt
- --etcd-cert-file=/etc/computedomains/etcd-tls/tls.crt
- --etcd-key-file=/etc/computedomains/etcd-tls/tls.key
{{- end }}
{{- end -}}

{{- define "cd.etcdTlsMount" -}}
{{- if include "cd.etcdTls" . }}
- name: etcd-tls
  mountPath: /etc/computedomains/etcd-tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* Called with dict "root" "secret" "mode". */}}
{{- define "cd.etcdTlsVolume" -}}
{{- if include "cd.etcdTls" .root }}
- name: etcd-tls
  secret:
    secretName: {{ .secret }}
    defaultMode: {{ .mode }}
{{- end }}
{{- end -}}

{{/* The kubelet dir whose plugins_registry and plugins the two kubeletPlugin paths must be. */}}
{{- define "cd.kubeletDir" -}}
{{- $reg := trimSuffix "/" .Values.kubeletPlugin.kubeletRegistrarDirectoryPath -}}
{{- $plugins := trimSuffix "/" .Values.kubeletPlugin.kubeletPluginsDirectoryPath -}}
{{- if or (ne (base $reg) "plugins_registry") (ne (base $plugins) "plugins") (ne (dir $reg) (dir $plugins)) -}}
{{- fail (printf "kubeletPlugin.kubeletRegistrarDirectoryPath (%s) and kubeletPluginsDirectoryPath (%s) must be <dir>/plugins_registry and <dir>/plugins of one kubelet dir (cd-node-agent takes --kubelet-dir)" $reg $plugins) -}}
{{- end -}}
{{- dir $plugins -}}
{{- end -}}


{{/* A container's securityContext: the chart's unless the value sets one. Called with dict
     "values" (the container's values) "default" (the chart's, a dict). */}}
{{- define "cd.containerSecurityContext" -}}
securityContext:
  {{- toYaml (default .default .values.securityContext) | nindent 2 }}
{{- end -}}

{{/* A container's extra env from <component>.containers.<name>.env. */}}
{{- define "cd.extraEnv" -}}
{{- with .env }}
{{ toYaml . }}
{{- end }}
{{- end -}}
