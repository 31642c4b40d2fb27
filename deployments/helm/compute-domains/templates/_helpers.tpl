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

{{- define "cd.etcdEndpoint" -}}
{{- if .Values.etcd.endpoints -}}
{{- join "," .Values.etcd.endpoints -}}
{{- else -}}
{{- default (printf "cd-etcd.%s.svc:2379" (include "cd.namespace" .)) .Values.etcd.endpoint -}}
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
     Called with dict "values" (the component's values) "port" (its health port). */}}
{{- define "cd.podAnnotations" -}}
{{- $a := dict -}}
{{- if .values.metrics.enabled -}}
{{- $_ := set $a "prometheus.io/scrape" "true" -}}
{{- $_ := set $a "prometheus.io/port" (toString .port) -}}
{{- $_ := set $a "prometheus.io/path" "/metrics" -}}
{{- end -}}
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

{{/* The etcd client certificate flags and volume (manifests/overlays/production's). */}}
{{- define "cd.etcdTlsFlags" -}}
{{- if .Values.etcd.tls.enabled }}
- --etcd-ca-file=/etc/computedomains/etcd-tls/ca.crt
- --etcd-cert-file=/etc/computedomains/etcd-tls/tls.crt
- --etcd-key-file=/etc/computedomains/etcd-tls/tls.key
{{- end }}
{{- end -}}

{{- define "cd.etcdTlsMount" -}}
{{- if .Values.etcd.tls.enabled }}
- name: etcd-tls
  mountPath: /etc/computedomains/etcd-tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* Called with dict "root" "secret" "mode". */}}
{{- define "cd.etcdTlsVolume" -}}
{{- if .root.Values.etcd.tls.enabled }}
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
