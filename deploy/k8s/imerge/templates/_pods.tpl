{{/*
The pod templates of the four components, shared by both layouts: StatefulSets and Jobs (the default), and one
JobSet (jobset.enabled). Each is a PodTemplateSpec (metadata and spec); pass (dict "root" .).
*/}}

{{/* A PS shard. In a StatefulSet its index is the pod's ordinal; in the JobSet, its completion index. */}}
{{- define "imerge.shardPod" -}}
{{- $root := .root }}
{{- $values := $root.Values }}
{{- $shards := $values.shards }}
{{- $component := dict "root" $root "component" "ps" }}
{{- $persistent := and $shards.checkpoints.persistence.enabled (or (not $values.jobset.enabled) $shards.checkpoints.persistence.existingClaim) }}
metadata:
  {{- include "imerge.podMetadata" (dict "root" $root "component" "ps" "pod" $shards) | nindent 2 }}
spec:
  {{- include "imerge.podCommon" $root | nindent 2 }}
  {{- if $values.jobset.enabled }}
  restartPolicy: OnFailure  # a crashed shard restarts in its pod, its checkpoints (emptyDir) still there
  {{- end }}
  # SIGTERM: the shard drains to a common round and writes its final checkpoint within gracePeriodS
  terminationGracePeriodSeconds: {{ add $shards.gracePeriodS 10 }}
  containers:
    - name: ps
      image: {{ include "imerge.image" $root }}
      imagePullPolicy: {{ $values.image.pullPolicy }}
      args: ["ps"]
      env:
        {{- include "imerge.commonEnv" $root | nindent 8 }}
        {{- if $values.tls.enabled }}
        {{- include "imerge.tlsEnv" $root | nindent 8 }}
        {{- end }}
        - name: POD_NAMESPACE
          valueFrom:
            fieldRef: {fieldPath: metadata.namespace}
        - name: IMERGE_SHARD_INDEX
          valueFrom:
            {{- if $values.jobset.enabled }}
            fieldRef: {fieldPath: "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
            {{- else }}
            fieldRef: {fieldPath: "metadata.labels['apps.kubernetes.io/pod-index']"}
            {{- end }}
        - name: IMERGE_HOST
          value: 0.0.0.0
        - name: IMERGE_PORT
          value: {{ $shards.port | quote }}
        - name: IMERGE_DATA_PORT
          value: {{ $shards.dataPort | quote }}
        - name: IMERGE_ADVERTISE
          value: {{ printf "%s:%v" (include "imerge.shardHost" (dict "root" $root "index" "$(IMERGE_SHARD_INDEX)" "namespace" "$(POD_NAMESPACE)")) $shards.port | quote }}
        - name: IMERGE_PULL_TIMEOUT_S
          value: {{ $shards.pullTimeoutS | quote }}
        - name: IMERGE_GRACE_S
          value: {{ $shards.gracePeriodS | quote }}
        # A restarted pod restores from the checkpoints on its volume when the job recovers
        - name: IMERGE_CHECKPOINT_DIR
          value: /checkpoints
        - name: IMERGE_CHECKPOINT_EVERY
          value: {{ $shards.checkpoints.every | quote }}
      ports:
        - name: grpc
          containerPort: {{ $shards.port }}
        - name: data
          containerPort: {{ $shards.dataPort }}
        - name: metrics
          containerPort: {{ $values.metrics.port }}
      {{- if $values.tls.enabled }}
      # Kubernetes' gRPC probes do not speak TLS: ask the health service with imerge health,
      # by the advertised name that the certificate carries (the TLS files come from IMERGE_TLS_*).
      readinessProbe:
        exec:
          command: ["sh", "-c", "exec imerge health --address \"$IMERGE_ADVERTISE\""]
        periodSeconds: 5
        timeoutSeconds: 5
      livenessProbe:
        exec:
          command: ["sh", "-c", "exec imerge health --address \"$IMERGE_ADVERTISE\" --service ''"]
        initialDelaySeconds: 30
        periodSeconds: 10
        timeoutSeconds: 5
      {{- else }}
      readinessProbe:
        grpc:
          port: {{ $shards.port }}
          service: imerge.v1.ParameterServer
        periodSeconds: 5
      livenessProbe:
        grpc:
          port: {{ $shards.port }}
        initialDelaySeconds: 30
        periodSeconds: 10
      {{- end }}
      resources:
        {{- toYaml $shards.resources | nindent 8 }}
      securityContext:
        {{- toYaml $values.securityContext | nindent 8 }}
      volumeMounts:
        - {name: tmp, mountPath: /tmp}
        {{- if $shards.checkpoints.persistence.existingClaim }}
        - {name: checkpoints, mountPath: /checkpoints, subPathExpr: "shard-$(IMERGE_SHARD_INDEX)"}
        {{- else }}
        - {name: checkpoints, mountPath: /checkpoints}
        {{- end }}
        {{- if $values.tls.enabled }}
        {{- include "imerge.tlsMount" $root | nindent 8 }}
        {{- end }}
        {{- with $shards.volumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - {name: tmp, emptyDir: {}}
    {{- if $shards.checkpoints.persistence.existingClaim }}
    - name: checkpoints
      persistentVolumeClaim: {claimName: {{ $shards.checkpoints.persistence.existingClaim | quote }}}
    {{- else if not $persistent }}
    - {name: checkpoints, emptyDir: {}}
    {{- end }}
    {{- if $values.tls.enabled }}
    {{- include "imerge.tlsVolume" $root | nindent 4 }}
    {{- end }}
    {{- with $shards.volumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- $spread := dict "podAntiAffinity" (dict "preferredDuringSchedulingIgnoredDuringExecution" (list (dict "weight" 100 "podAffinityTerm" (dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" (include "imerge.componentSelector" $component | fromYaml)))))) }}
  {{- include "imerge.podPlacement" (dict "root" $root "pod" $shards "affinity" $spread) | nindent 2 }}
{{- end }}

{{/* A worker pod: rank = completion index (with gpu.count N, node index of N worker processes). */}}
{{- define "imerge.workerPod" -}}
{{- $root := .root }}
{{- $values := $root.Values }}
{{- $workers := $values.workers }}
{{- $procs := include "imerge.procsPerPod" $root | int }}
{{- $fullname := include "imerge.fullname" $root }}
{{- $gang := dict }}
{{- if eq $workers.gang.scheduler "coscheduling" }}
{{- $_ := set $gang "scheduling.x-k8s.io/pod-group" (printf "%s-workers" $fullname) }}
{{- end }}
{{- $groupAnnotation := dict }}
{{- if eq $workers.gang.scheduler "volcano" }}
{{- $_ := set $groupAnnotation "scheduling.k8s.io/group-name" (printf "%s-workers" $fullname) }}
{{- end }}
metadata:
  {{- include "imerge.podMetadata" (dict "root" $root "component" "worker" "pod" $workers "labels" $gang "annotations" $groupAnnotation) | nindent 2 }}
spec:
  {{- include "imerge.podCommon" $root | nindent 2 }}
  restartPolicy: Never
  {{- if not $values.jobset.enabled }}
  subdomain: {{ $fullname }}-metrics  # pod i is <fullname>-worker-i.<this Service>
  {{- end }}
  {{- with $workers.gang.scheduler }}
  schedulerName: {{ $workers.gang.schedulerName | default (ternary "volcano" "scheduler-plugins-scheduler" (eq . "volcano")) }}
  {{- end }}
  {{- if and $workers.gpu.enabled $workers.gpu.runtimeClassName }}
  runtimeClassName: {{ $workers.gpu.runtimeClassName }}
  {{- end }}
  containers:
    - name: worker
      image: {{ include "imerge.image" $root }}
      imagePullPolicy: {{ $values.image.pullPolicy }}
      {{- if and $workers.command (eq $procs 1) }}
      command:
        {{- toYaml $workers.command | nindent 8 }}
      {{- else if $workers.command }}
      args:  # imerge worker starts a process of the script per GPU
        {{- toYaml (concat (list "worker" "--") $workers.command) | nindent 8 }}
      {{- else }}
      args: ["worker"]
      {{- end }}
      env:
        {{- include "imerge.commonEnv" $root | nindent 8 }}
        {{- if $values.tls.enabled }}
        {{- include "imerge.tlsEnv" $root | nindent 8 }}
        {{- end }}
        - name: IMERGE_RANK
          valueFrom:
            fieldRef: {fieldPath: "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
        - name: IMERGE_WORLD_SIZE
          value: {{ include "imerge.workerCount" $root | quote }}
        {{- if $workers.command }}
        - name: MASTER_ADDR
          value: {{ include "imerge.workerZeroHost" $root | quote }}
        - name: MASTER_PORT
          value: {{ $workers.masterPort | quote }}
        {{- if eq $procs 1 }}
        - name: RANK
          valueFrom:
            fieldRef: {fieldPath: "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
        - name: WORLD_SIZE
          value: {{ include "imerge.workerCount" $root | quote }}
        - name: LOCAL_RANK
          value: "0"
        - name: LOCAL_WORLD_SIZE
          value: "1"
        {{- end }}
        {{- end }}
        {{- if gt $procs 1 }}
        - name: IMERGE_NPROC_PER_NODE
          value: {{ $procs | quote }}
        - name: IMERGE_NODE_RANK
          valueFrom:
            fieldRef: {fieldPath: "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
        {{- end }}
        - name: IMERGE_MODEL
          value: {{ $workers.model | quote }}
        - name: IMERGE_DATA
          value: {{ $workers.data | quote }}
        - name: IMERGE_ITERS
          value: {{ $workers.iters | quote }}
        - name: IMERGE_EPOCHS
          value: {{ $workers.epochs | quote }}
        - name: IMERGE_BATCH_SIZE
          value: {{ $workers.batchSize | quote }}
        - name: IMERGE_FUSION
          value: {{ $workers.fusion | quote }}
        - name: IMERGE_SLOTS
          value: {{ $workers.slots | quote }}
        - name: IMERGE_INTERLEAVE_PERIOD
          value: {{ $workers.interleavePeriod | quote }}
      ports:
        {{- range $local := until $procs }}
        - name: {{ ternary "metrics" (printf "metrics-%d" $local) (eq $local 0) }}
          containerPort: {{ add $values.metrics.port $local }}
        {{- end }}
      resources:
        {{- $resources := deepCopy $workers.resources }}
        {{- if $workers.gpu.enabled }}
        {{- $limits := merge (dict $workers.gpu.resourceName $workers.gpu.count) (default (dict) $resources.limits) }}
        {{- $_ := set $resources "limits" $limits }}
        {{- end }}
        {{- toYaml $resources | nindent 8 }}
      securityContext:
        {{- toYaml $values.securityContext | nindent 8 }}
      volumeMounts:
        - {name: tmp, mountPath: /tmp}
        {{- if $workers.shmSize }}
        - {name: dshm, mountPath: /dev/shm}
        {{- end }}
        {{- if $values.tls.enabled }}
        {{- include "imerge.tlsMount" $root | nindent 8 }}
        {{- end }}
        {{- with $workers.volumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - {name: tmp, emptyDir: {}}
    {{- with $workers.shmSize }}
    # DataLoader worker processes hand batches over in shared memory: /dev/shm of this size, in RAM
    - name: dshm
      emptyDir: {medium: Memory, sizeLimit: {{ . }}}
    {{- end }}
    {{- if $values.tls.enabled }}
    {{- include "imerge.tlsVolume" $root | nindent 4 }}
    {{- end }}
    {{- with $workers.volumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- $tolerations := $workers.tolerations }}
  {{- if $workers.gpu.enabled }}
  {{- $tolerations = append $tolerations (dict "key" $workers.gpu.resourceName "operator" "Exists" "effect" "NoSchedule") }}
  {{- end }}
  {{- include "imerge.podPlacement" (dict "root" $root "pod" $workers "tolerations" $tolerations) | nindent 2 }}
{{- end }}

{{/* The coordinator: exits 0 once the training job finished, 1 on the job's failure. */}}
{{- define "imerge.coordinatorPod" -}}
{{- $root := .root }}
{{- $values := $root.Values }}
{{- $coordinator := $values.coordinator }}
metadata:
  {{- include "imerge.podMetadata" (dict "root" $root "component" "coordinator" "pod" $coordinator) | nindent 2 }}
spec:
  {{- include "imerge.podCommon" $root | nindent 2 }}
  restartPolicy: Never
  containers:
    - name: coordinator
      image: {{ include "imerge.image" $root }}
      imagePullPolicy: {{ $values.image.pullPolicy }}
      args: ["coordinator"]
      env:
        {{- include "imerge.commonEnv" $root | nindent 8 }}
        - name: IMERGE_NUM_WORKERS
          value: {{ include "imerge.workerCount" $root | quote }}
        - name: IMERGE_NUM_SHARDS
          value: {{ $values.shards.replicas | quote }}
        - name: IMERGE_HEARTBEAT_TTL_S
          value: {{ $coordinator.heartbeatTtlS | quote }}
      ports:
        - name: metrics
          containerPort: {{ $values.metrics.port }}
      readinessProbe:
        httpGet: {path: /metrics, port: metrics}
        periodSeconds: 5
      livenessProbe:
        httpGet: {path: /metrics, port: metrics}
        initialDelaySeconds: 30
        periodSeconds: 10
      resources:
        {{- toYaml $coordinator.resources | nindent 8 }}
      securityContext:
        {{- toYaml $values.securityContext | nindent 8 }}
      volumeMounts:
        - {name: tmp, mountPath: /tmp}
        {{- with $coordinator.volumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - {name: tmp, emptyDir: {}}
    {{- with $coordinator.volumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- include "imerge.podPlacement" (dict "root" $root "pod" $coordinator) | nindent 2 }}
{{- end }}

{{/* Redis, the coordinator's store (redis.enabled). */}}
{{- define "imerge.redisPod" -}}
{{- $root := .root }}
{{- $values := $root.Values }}
{{- $redis := $values.redis }}
metadata:
  {{- include "imerge.podMetadata" (dict "root" $root "component" "redis" "pod" $redis) | nindent 2 }}
spec:
  {{- include "imerge.podCommon" $root | nindent 2 }}
  {{- if $values.jobset.enabled }}
  restartPolicy: OnFailure
  {{- end }}
  containers:
    - name: redis
      image: {{ $redis.image }}
      imagePullPolicy: {{ $values.image.pullPolicy }}
      args:
        - redis-server
        - --port
        - "6379"
        - --requirepass
        - $(REDIS_PASSWORD)
        - --dir
        - /data
        {{- if $redis.persistence.enabled }}
        - --appendonly
        - "yes"
        {{- else }}
        - --save
        - ""
        - --appendonly
        - "no"
        {{- end }}
      env:
        - name: REDIS_PASSWORD
          valueFrom:
            secretKeyRef:
              name: {{ include "imerge.redisSecret" $root }}
              key: {{ $redis.auth.secretKey }}
        - name: REDISCLI_AUTH
          valueFrom:
            secretKeyRef:
              name: {{ include "imerge.redisSecret" $root }}
              key: {{ $redis.auth.secretKey }}
      ports:
        - name: redis
          containerPort: 6379
      readinessProbe:
        exec:
          command: ["redis-cli", "ping"]
        periodSeconds: 5
      livenessProbe:
        tcpSocket:
          port: redis
        initialDelaySeconds: 15
        periodSeconds: 10
      resources:
        {{- toYaml $redis.resources | nindent 8 }}
      securityContext:
        {{- toYaml $values.securityContext | nindent 8 }}
      volumeMounts:
        - {name: data, mountPath: /data}
        {{- with $redis.volumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  {{- if or (not $redis.persistence.enabled) $values.jobset.enabled $redis.volumes }}
  volumes:
    {{- if or (not $redis.persistence.enabled) $values.jobset.enabled }}
    - {name: data, emptyDir: {}}
    {{- end }}
    {{- with $redis.volumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
  {{- include "imerge.podPlacement" (dict "root" $root "pod" $redis) | nindent 2 }}
{{- end }}

{{/* The workers' Job spec (without its lifetime): Indexed, one pod per worker node. Exit code 75: the job
recovered from a checkpoint and this worker left to rejoin it; its pod is replaced without counting against
backoffLimit. Exit code 76: a fatal error of the job, which no retry mends. Any other failure counts. */}}
{{- define "imerge.workerJobSpec" -}}
completionMode: Indexed
completions: {{ .Values.workers.replicas }}
parallelism: {{ .Values.workers.replicas }}
backoffLimit: {{ .Values.workers.backoffLimit }}
podFailurePolicy:
  rules:
    - action: Ignore
      onExitCodes:
        containerName: worker
        operator: In
        values: [75]
      onPodConditions: []
    - action: FailJob
      onExitCodes:
        containerName: worker
        operator: In
        values: [76]
      onPodConditions: []
template:
  {{- include "imerge.workerPod" (dict "root" .) | nindent 2 }}
{{- end }}

{{/* The coordinator's Job spec (without its lifetime). */}}
{{- define "imerge.coordinatorJobSpec" -}}
backoffLimit: {{ .Values.coordinator.backoffLimit }}
podFailurePolicy:
  rules:
    - action: FailJob
      onExitCodes:
        containerName: coordinator
        operator: In
        values: [1]
      onPodConditions: []
template:
  {{- include "imerge.coordinatorPod" (dict "root" .) | nindent 2 }}
{{- end }}
