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
{{- /* The job id as Prometheus' pod-annotation scraping (labelmap of the pod's labels) names it: the alerts and
  dashboards tell jobs apart by imerge_job. */}}
imerge_job: {{ include "imerge.jobId" .root | quote }}
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
  value: {{ include "imerge.jobId" . | quote }}
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


{{/* The job id: job.id, else the release's name (two releases never share a job's Redis keys or dashboards). */}}
{{- define "imerge.jobId" -}}
{{- default .Release.Name .Values.job.id }}
{{- end }}

{{/* The job as one JobSet (jobset.enabled): its name, and the subdomain every pod's hostname lives in. */}}
{{- define "imerge.jobsetSubdomain" -}}
{{- include "imerge.fullname" . }}
{{- end }}

{{/* The stable DNS name of shard $index (a string: a number or a shell or env expression). */}}
{{- define "imerge.shardHost" -}}
{{- $fullname := include "imerge.fullname" .root }}
{{- if .root.Values.jobset.enabled }}
{{- printf "%s-ps-0-%s.%s.%s.svc" $fullname .index (include "imerge.jobsetSubdomain" .root) .namespace }}
{{- else }}
{{- printf "%s-ps-%s.%s-ps.%s.svc" $fullname .index $fullname .namespace }}
{{- end }}
{{- end }}

{{/* Worker 0's stable name (MASTER_ADDR of a script's own process group). */}}
{{- define "imerge.workerZeroHost" -}}
{{- $fullname := include "imerge.fullname" . }}
{{- if .Values.jobset.enabled }}
{{- printf "%s-worker-0-0.%s" $fullname (include "imerge.jobsetSubdomain" .) }}
{{- else }}
{{- printf "%s-worker-0.%s-metrics" $fullname $fullname }}
{{- end }}
{{- end }}

{{/* A pod template's metadata: pass (dict "root" . "component" "ps" "pod" .Values.shards), and optionally "labels"
and "annotations" (dicts) of the chart's own (the gangs'). Labels: the component's, then the given ones, the
component's podLabels, the chart's podLabels (the first of them wins); a podLabel may not replace one of the
chart's own labels, which its selectors match. Annotations: the given ones, the component's podAnnotations, the
chart's podAnnotations, then Prometheus' (metrics.podAnnotations). */}}
{{- define "imerge.podMetadata" -}}
{{- $root := .root }}
{{- $own := include "imerge.componentLabels" (dict "root" $root "component" .component) | fromYaml }}
{{- range $key, $_ := merge (dict) (default (dict) .pod.podLabels) (default (dict) $root.Values.podLabels) }}
{{- if hasKey $own $key }}
{{- fail (printf "podLabels: %s is one of the chart's own labels (its Services and StatefulSets select pods by them); choose another key" $key) }}
{{- end }}
{{- end }}
{{- $labels := merge (dict) (default (dict) .labels) (default (dict) .pod.podLabels) (default (dict) $root.Values.podLabels) }}
{{- $annotations := merge (dict) (default (dict) .annotations) (default (dict) .pod.podAnnotations) (default (dict) $root.Values.podAnnotations) }}
{{- if and $root.Values.metrics.podAnnotations (ne .component "redis") }}
{{- $_ := merge $annotations (dict "prometheus.io/scrape" "true" "prometheus.io/port" (toString $root.Values.metrics.port) "prometheus.io/path" "/metrics") }}
{{- end }}
labels:
  {{- include "imerge.componentLabels" (dict "root" $root "component" .component) | nindent 2 }}
  {{- with $labels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Where a component's pods run and how they rank: priorityClassName, nodeSelector, tolerations, affinity
(pass (dict "root" . "pod" .Values.shards "affinity" <the default affinity, or nil>)). */}}
{{- define "imerge.podPlacement" -}}
{{- with default .root.Values.priorityClassName .pod.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .pod.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations | default .pod.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .pod.affinity | default .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The Kueue labels of the object Kueue admits (kueue.queueName, kueue.priorityClass). */}}
{{- define "imerge.kueueLabels" -}}
{{- with .Values.kueue.queueName }}
kueue.x-k8s.io/queue-name: {{ . | quote }}
{{- end }}
{{- with .Values.kueue.priorityClass }}
kueue.x-k8s.io/priority-class: {{ . | quote }}
{{- end }}
{{- end }}

{{/* helm upgrade: refused (a Job's pod template cannot change), unless job.allowUpgrade. */}}
{{- define "imerge.upgradeGuard" -}}
{{- if and .Release.IsUpgrade (not .Values.job.allowUpgrade) }}
{{- fail (printf "helm upgrade of the training job %q is refused: Kubernetes lets no Job's pod template change, so the upgrade would stop half-applied. To run the job again with new values: helm uninstall %s -n %s, then helm install it (the shards' checkpoint volumes are kept); to change only what lies outside the Jobs (alerts, dashboards, metrics, Kueue labels), pass --set job.allowUpgrade=true" .Release.Name .Release.Name .Release.Namespace) }}
{{- end }}
{{- end }}
