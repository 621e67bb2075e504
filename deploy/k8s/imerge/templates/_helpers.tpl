{{/* Expand the name of the chart. */}}
{{- define "imerge.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Create a default fully qualified app name, truncated at 63 chars (DNS names).
If the release name contains the chart name it is used as the full name.
*/}}
{{- define "imerge.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Chart name and version for the chart label. */}}
{{- define "imerge.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Common labels. */}}
{{- define "imerge.labels" -}}
helm.sh/chart: {{ include "imerge.chart" . }}
{{ include "imerge.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels: every pod of the release. */}}
{{- define "imerge.selectorLabels" -}}
app.kubernetes.io/name: {{ include "imerge.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of one component (coordinator, ps, worker, redis): pass (dict "root" . "component" "ps"). */}}
{{- define "imerge.componentLabels" -}}
{{ include "imerge.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "imerge.componentSelector" -}}
{{ include "imerge.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The ServiceAccount of the pods. */}}
{{- define "imerge.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "imerge.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The image: repository:tag, the tag defaulting to appVersion-cpu or appVersion-cuda. */}}
{{- define "imerge.image" -}}
{{- $variant := ternary "cuda" "cpu" .Values.workers.gpu.enabled }}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-%s" .Chart.AppVersion $variant) .Values.image.tag) }}
{{- end }}

{{- define "imerge.redisHost" -}}
{{- if .Values.redis.enabled }}
{{- printf "%s-redis" (include "imerge.fullname" .) }}
{{- else }}
{{- required "redis.external.host is required when redis.enabled is false" .Values.redis.external.host }}
{{- end }}
{{- end }}

{{/* The Secret and key holding the Redis password ("" when there is none). */}}
{{- define "imerge.redisSecret" -}}
{{- if .Values.redis.enabled }}
{{- default (printf "%s-redis" (include "imerge.fullname" .)) .Values.redis.auth.existingSecret }}
{{- else }}
{{- .Values.redis.external.existingSecret }}
{{- end }}
{{- end }}

{{- define "imerge.redisSecretKey" -}}
{{- ternary .Values.redis.auth.secretKey .Values.redis.external.secretKey .Values.redis.enabled }}
{{- end }}

{{/* Environment every IMerge role shares: job, Redis (password from a Secret), logging, metrics. */}}
{{- define "imerge.commonEnv" -}}
- name: IMERGE_JOB
  value: {{ .Values.job.id | quote }}
- name: IMERGE_JOB_TOKEN  # this release's run: roles of another run refuse a job of the same name
  value: {{ printf "%s/%s" .Release.Namespace .Release.Name | quote }}
- name: IMERGE_LOG_LEVEL
  value: {{ .Values.job.logLevel | quote }}
- name: IMERGE_WAIT_TIMEOUT_S
  value: {{ .Values.job.waitTimeoutS | quote }}
- name: IMERGE_LINK_MBPS
  value: {{ .Values.job.linkMbps | quote }}
- name: IMERGE_METRICS_PORT
  value: {{ .Values.metrics.port | quote }}
- name: IMERGE_METRICS_HOST
  value: "0.0.0.0"
{{- $secret := include "imerge.redisSecret" . }}
{{- $port := ternary 6379 .Values.redis.external.port .Values.redis.enabled }}
{{- $db := ternary 0 .Values.redis.external.db .Values.redis.enabled }}
{{- if $secret }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ include "imerge.redisSecretKey" . }}
- name: IMERGE_REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:%v/%v" (include "imerge.redisHost" .) $port $db | quote }}
{{- else }}
- name: IMERGE_REDIS_URL
  value: {{ printf "redis://%s:%v/%v" (include "imerge.redisHost" .) $port $db | quote }}
{{- end }}
{{- range $name, $value := .Values.job.extraEnv }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- end }}

{{/* Prometheus scrape annotations of a pod. */}}
{{- define "imerge.podAnnotations" -}}
{{- if .Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.metrics.port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end }}

{{/* Pod-level settings every component shares. */}}
{{- define "imerge.podCommon" -}}
serviceAccountName: {{ include "imerge.serviceAccountName" . }}
automountServiceAccountToken: false
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* TLS files of the gRPC channels, mounted from tls.secretName. */}}
{{- define "imerge.tlsEnv" -}}
- name: IMERGE_TLS_CERT
  value: /etc/imerge/tls/tls.crt
- name: IMERGE_TLS_KEY
  value: /etc/imerge/tls/tls.key
- name: IMERGE_TLS_CA
  value: /etc/imerge/tls/ca.crt
{{- end }}

{{- define "imerge.tlsVolume" -}}
- name: tls
  secret:
    secretName: {{ required "tls.secretName is required when tls.enabled" .Values.tls.secretName }}
{{- end }}

{{- define "imerge.tlsMount" -}}
- {name: tls, mountPath: /etc/imerge/tls, readOnly: true}
{{- end }}

{{/* Worker processes per worker pod: one per GPU when gpu.enabled, else one. */}}
{{- define "imerge.procsPerPod" -}}
{{- if .Values.workers.gpu.enabled }}{{ .Values.workers.gpu.count }}{{ else }}1{{ end }}
{{- end }}

{{/* Worker ranks of the job: pods times processes per pod. */}}
{{- define "imerge.workerCount" -}}
{{- mul .Values.workers.replicas (include "imerge.procsPerPod" . | int) }}
{{- end }}

{{/* How long the job's Jobs (workers, coordinator) may run, and when Kubernetes deletes them once finished. */}}
{{- define "imerge.jobLifetime" -}}
{{- with .Values.job.activeDeadlineSeconds }}
activeDeadlineSeconds: {{ . }}
{{- end }}
{{- if ge (int .Values.job.ttlSecondsAfterFinished) 0 }}
ttlSecondsAfterFinished: {{ .Values.job.ttlSecondsAfterFinished }}
{{- end }}
{{- end }}
