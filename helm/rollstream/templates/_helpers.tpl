{{/*
Names, labels, the Redis connection, key names, the shared pod pieces and validateValues.
*/}}

{{- define "rollstream.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rollstream.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* `<fullname>-<component>`: include "rollstream.component.fullname" (dict "ctx" $ "component" "consumer") */}}
{{- define "rollstream.component.fullname" -}}
{{- printf "%s-%s" (include "rollstream.fullname" .ctx | trunc 50 | trimSuffix "-") .component -}}
{{- end -}}

{{- define "rollstream.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rollstream.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rollstream.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rollstream.labels" -}}
helm.sh/chart: {{ include "rollstream.chart" . }}
{{ include "rollstream.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rollstream
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: (dict "ctx" $ "component" "consumer") */}}
{{- define "rollstream.component.selectorLabels" -}}
{{ include "rollstream.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "rollstream.component.labels" -}}
{{ include "rollstream.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "rollstream.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rollstream.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "rollstream.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s/%s@%s" .Values.image.registry .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s/%s:%s" .Values.image.registry .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "rollstream.redis.image" -}}
{{- printf "%s/%s:%s" .Values.redis.image.registry .Values.redis.image.repository .Values.redis.image.tag -}}
{{- end -}}

{{/* `imagePullSecrets:` of a pod spec, or nothing: {{- include "rollstream.imagePullSecrets" (dict "ctx" $ "indent" 6) }} */}}
{{- define "rollstream.imagePullSecrets" -}}
{{- if .ctx.Values.image.pullSecrets }}
{{- $secrets := list }}
{{- range .ctx.Values.image.pullSecrets }}
{{- $secrets = append $secrets (dict "name" .) }}
{{- end }}
{{- dict "imagePullSecrets" $secrets | toYaml | nindent .indent }}
{{- end }}
{{- end -}}

{{/* ------------------------------------------------------------------ Redis connection */}}

{{- define "rollstream.redis.fullname" -}}
{{- include "rollstream.component.fullname" (dict "ctx" . "component" "redis") -}}
{{- end -}}

{{- define "rollstream.redis.host" -}}
{{- if .Values.redis.enabled -}}
{{- printf "%s.%s.svc.%s" (include "rollstream.redis.fullname" .) .Release.Namespace .Values.clusterDomain -}}
{{- else -}}
{{- (urlParse .Values.redis.external.url).hostname -}}
{{- end -}}
{{- end -}}

{{- define "rollstream.redis.port" -}}
{{- if .Values.redis.enabled -}}
{{- .Values.redis.port -}}
{{- else -}}
{{- $host := (urlParse .Values.redis.external.url).host -}}
{{- if regexMatch ":[0-9]+$" $host -}}{{ regexFind "[0-9]+$" $host }}{{- else -}}6379{{- end -}}
{{- end -}}
{{- end -}}

{{- define "rollstream.redis.db" -}}
{{- if .Values.redis.enabled -}}0{{- else -}}{{ default "0" (trimPrefix "/" (urlParse .Values.redis.external.url).path) }}{{- end -}}
{{- end -}}

{{- define "rollstream.redis.tls" -}}
{{- if and (not .Values.redis.enabled) (hasPrefix "rediss://" (lower .Values.redis.external.url)) -}}true{{- end -}}
{{- end -}}

{{/* The URL the pipeline connects to (never with a password in it). */}}
{{- define "rollstream.redis.url" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s:%v/0" (include "rollstream.redis.host" .) .Values.redis.port -}}
{{- else -}}
{{- .Values.redis.external.url -}}
{{- end -}}
{{- end -}}

{{/* Name of the Secret holding the Redis password; empty when Redis has none. */}}
{{- define "rollstream.redis.secretName" -}}
{{- if .Values.redis.enabled -}}
{{- if .Values.redis.auth.enabled -}}
{{- default (include "rollstream.redis.fullname" .) .Values.redis.auth.existingSecret -}}
{{- end -}}
{{- else -}}
{{- .Values.redis.external.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "rollstream.redis.secretKey" -}}
{{- if .Values.redis.enabled -}}
{{- .Values.redis.auth.existingSecretPasswordKey -}}
{{- else -}}
{{- .Values.redis.external.existingSecretPasswordKey -}}
{{- end -}}
{{- end -}}

{{- define "rollstream.redis.username" -}}
{{- if not .Values.redis.enabled -}}{{ .Values.redis.external.username }}{{- end -}}
{{- end -}}

{{- define "rollstream.redis.tlsCaFile" -}}
{{- if and (not .Values.redis.enabled) .Values.redis.external.tlsCaSecret -}}
/etc/rollstream/tls/{{ .Values.redis.external.tlsCaKey }}
{{- end -}}
{{- end -}}

{{/*
The Redis user, password Secret and key of a role (admission, consumer, trainer), as YAML
{username, secret, key}: redis.external.roles.<role>, each field falling back to the shared
redis.external one (docs/security.md: one ACL user per role). The in-chart Redis has one
password and no users. Called with (dict "ctx" . "role" "consumer").
*/}}
{{- define "rollstream.redis.credentials" -}}
{{- $ctx := .ctx -}}
{{- $user := include "rollstream.redis.username" $ctx -}}
{{- $secret := include "rollstream.redis.secretName" $ctx -}}
{{- $key := include "rollstream.redis.secretKey" $ctx -}}
{{- if not $ctx.Values.redis.enabled -}}
{{- $role := get (default (dict) $ctx.Values.redis.external.roles) .role | default (dict) -}}
{{- $user = get $role "username" | default $user -}}
{{- $secret = get $role "existingSecret" | default $secret -}}
{{- $key = get $role "existingSecretPasswordKey" | default $key -}}
{{- end -}}
{{- toYaml (dict "username" $user "secret" $secret "key" $key) -}}
{{- end -}}

{{/* The `redis:` section of a role's config file (pipeline/config.py RedisConfig); called
with (dict "ctx" . "role" "consumer"). */}}
{{- define "rollstream.redis.config" -}}
{{- $ctx := .ctx -}}
{{- $cred := include "rollstream.redis.credentials" . | fromYaml -}}
{{- $c := dict "url" (include "rollstream.redis.url" $ctx) "namespace" $ctx.Values.run.namespace "socket_timeout_s" $ctx.Values.redis.socket_timeout_s -}}
{{- $_ := set $c "username" ($cred.username | default nil) -}}
{{- $_ := set $c "password_env" (ternary "ROLLSTREAM_REDIS_PASSWORD" nil (ne $cred.secret "")) -}}
{{- $_ := set $c "password_file" nil -}}
{{- $_ := set $c "tls_ca_file" ((include "rollstream.redis.tlsCaFile" $ctx) | default nil) -}}
{{- toYaml $c -}}
{{- end -}}

{{/* ------------------------------------------------------------------ key names (pipeline/keys.py) */}}

{{- define "rollstream.keys.prefix" -}}
{{- printf "rs:{%s}:" .Values.run.namespace -}}
{{- end -}}

{{- define "rollstream.keys.work" -}}
{{- printf "%swork" (include "rollstream.keys.prefix" .) -}}
{{- end -}}

{{/* Consumer group of the rollout consumers on the work stream (keys.WORK_GROUP). */}}
{{- define "rollstream.keys.workGroup" -}}rollout{{- end -}}

{{/* ------------------------------------------------------------------ pods */}}

{{- define "rollstream.metricsAddr" -}}
{{- $host := .Values.metrics.bindAddress -}}
{{- if contains ":" $host -}}{{ printf "[%s]:%v" $host .Values.metrics.port }}{{- else -}}{{ printf "%s:%v" $host .Values.metrics.port }}{{- end -}}
{{- end -}}

{{- define "rollstream.configChecksum" -}}
checksum/config: {{ include (print .Template.BasePath "/config/configmap.yaml") . | sha256sum }}
{{- end -}}

{{/* Environment every rollstream container gets, with its role's Redis credentials;
called with (dict "ctx" . "role" "consumer"). */}}
{{- define "rollstream.env" -}}
{{- $cred := include "rollstream.redis.credentials" . | fromYaml -}}
- name: HOME
  value: /tmp
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- if $cred.secret }}
- name: ROLLSTREAM_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $cred.secret }}
      key: {{ $cred.key }}
{{- end }}
{{- if $cred.username }}
- name: ROLLSTREAM_REDIS_USERNAME
  value: {{ $cred.username | quote }}
{{- end }}
{{- end -}}

{{/* The pod index of a StatefulSet pod (label set by Kubernetes 1.28+), as env `name`. */}}
{{- define "rollstream.env.podIndex" -}}
- name: {{ . }}
  valueFrom:
    fieldRef:
      fieldPath: metadata.labels['apps.kubernetes.io/pod-index']
{{- end -}}

{{- define "rollstream.volumeMounts" -}}
- name: config
  mountPath: /etc/rollstream
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if include "rollstream.redis.tlsCaFile" . }}
- name: redis-tls-ca
  mountPath: /etc/rollstream/tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "rollstream.volumes" -}}
- name: config
  configMap:
    name: {{ include "rollstream.fullname" . }}-config
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
{{- if include "rollstream.redis.tlsCaFile" . }}
- name: redis-tls-ca
  secret:
    secretName: {{ .Values.redis.external.tlsCaSecret }}
    items:
      - key: {{ .Values.redis.external.tlsCaKey }}
        path: {{ .Values.redis.external.tlsCaKey }}
{{- end }}
{{- end -}}

{{- define "rollstream.probes" -}}
startupProbe:
  httpGet:
    path: /healthz
    port: metrics
  periodSeconds: {{ .Values.probes.startup.periodSeconds }}
  timeoutSeconds: {{ .Values.probes.startup.timeoutSeconds }}
  failureThreshold: {{ .Values.probes.startup.failureThreshold }}
livenessProbe:
  httpGet:
    path: /healthz
    port: metrics
  initialDelaySeconds: {{ .Values.probes.liveness.initialDelaySeconds }}
  periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
  timeoutSeconds: {{ .Values.probes.liveness.timeoutSeconds }}
  failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
readinessProbe:
  httpGet:
    path: /readyz
    port: metrics
  initialDelaySeconds: {{ .Values.probes.readiness.initialDelaySeconds }}
  periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
  timeoutSeconds: {{ .Values.probes.readiness.timeoutSeconds }}
  failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
{{- end -}}

{{/* terminationGracePeriodSeconds of the consumers: grace_s (their drain) plus a margin. */}}
{{- define "rollstream.consumer.terminationGracePeriodSeconds" -}}
{{- add (int (ceil .Values.consumer.config.grace_s)) (int .Values.consumer.terminationMarginSeconds) -}}
{{- end -}}

{{/* Connection metadata of a KEDA redis-streams trigger (consumer/scaledobject.yaml). */}}
{{- define "rollstream.keda.connection" -}}
address: {{ .address | quote }}
stream: {{ .stream | quote }}
consumerGroup: {{ .group | quote }}
databaseIndex: {{ .db | quote }}
{{- if .tls }}
enableTLS: "true"
{{- end }}
{{- if and .secret (not .authRef) }}
passwordFromEnv: ROLLSTREAM_REDIS_PASSWORD
{{- end }}
{{- if and .user (not .authRef) }}
usernameFromEnv: ROLLSTREAM_REDIS_USERNAME
{{- end }}
{{- end -}}

{{/* ------------------------------------------------------------------ validateValues */}}

{{- define "rollstream.validateValues" -}}
{{- $messages := list -}}
{{- if and .Values.redis.enabled .Values.redis.external.url -}}
{{- $messages = append $messages "redis: both redis.enabled and redis.external.url are set; choose the in-chart Redis (redis.enabled=true) or an external one (redis.enabled=false, redis.external.url=...)" -}}
{{- end -}}
{{- if and (not .Values.redis.enabled) (not .Values.redis.external.url) -}}
{{- $messages = append $messages "redis: no Redis: set redis.enabled=true for the in-chart Redis, or redis.external.url (with redis.external.existingSecret for its password)" -}}
{{- end -}}
{{- if and (not .Values.redis.enabled) .Values.redis.external.url (not (regexMatch "^rediss?://" (lower .Values.redis.external.url))) -}}
{{- $messages = append $messages (printf "redis.external.url: must start with redis:// or rediss://, got %q" .Values.redis.external.url) -}}
{{- end -}}
{{- if and (not .Values.redis.enabled) .Values.redis.external.url (contains "@" .Values.redis.external.url) -}}
{{- $messages = append $messages "redis.external.url: carries credentials; put the password in a Secret (redis.external.existingSecret) and the user in redis.external.username" -}}
{{- end -}}
{{- if and .Values.consumer.autoscaling.keda.enabled .Values.consumer.autoscaling.hpa.enabled -}}
{{- $messages = append $messages "consumer.autoscaling: keda.enabled and hpa.enabled are both true; KEDA creates its own HPA, enable one" -}}
{{- end -}}
{{- if and .Values.consumer.autoscaling.hpa.enabled (not .Values.consumer.autoscaling.hpa.targetCPUUtilizationPercentage) (not .Values.consumer.autoscaling.hpa.external.metricName) -}}
{{- $messages = append $messages "consumer.autoscaling.hpa: no metric; set targetCPUUtilizationPercentage or external.metricName" -}}
{{- end -}}
{{- if and (eq (int .Values.consumer.autoscaling.minReplicas) 0) (not .Values.consumer.autoscaling.keda.enabled) -}}
{{- $messages = append $messages "consumer.autoscaling.minReplicas: 0 needs KEDA (keda.enabled=true); an HPA cannot scale to zero" -}}
{{- end -}}
{{- if gt (int .Values.consumer.autoscaling.minReplicas) (int .Values.consumer.autoscaling.maxReplicas) -}}
{{- $messages = append $messages "consumer.autoscaling: minReplicas exceeds maxReplicas" -}}
{{- end -}}
{{- if and .Values.monitoring.serviceMonitor.enabled .Values.monitoring.podMonitor.enabled -}}
{{- $messages = append $messages "monitoring: serviceMonitor and podMonitor are both enabled; every pod would be scraped twice" -}}
{{- end -}}
{{- $s := .Values.scheduler -}}
{{- $bound := sub (add (int $s.ahead) (int $s.sync_every)) 1 -}}
{{- if lt (int $s.max_lag) $bound -}}
{{- $messages = append $messages (printf "scheduler.max_lag=%v is below ahead + sync_every - 1 = %v: a first submission could be stale at consumption" $s.max_lag $bound) -}}
{{- end -}}
{{- if gt (float64 .Values.consumer.config.grace_s) (mulf (float64 .Values.consumer.config.lease_s) 10.0) -}}
{{- $messages = append $messages (printf "consumer.config.grace_s=%v exceeds ten leases (lease_s=%v)" .Values.consumer.config.grace_s .Values.consumer.config.lease_s) -}}
{{- end -}}
{{- $t := .Values.trainer -}}
{{- if ne (mod (int $t.ranks) (int $t.share)) 0 -}}
{{- $messages = append $messages (printf "trainer.share=%v does not divide trainer.ranks=%v: every shard needs share ranks" $t.share $t.ranks) -}}
{{- end -}}
{{- $checkpointDir := dig "checkpoint" "dir" "" $t.config -}}
{{- if and $t.persistence.enabled $checkpointDir (ne $checkpointDir $t.persistence.mountPath) -}}
{{- $messages = append $messages (printf "trainer.config.checkpoint.dir=%v: with trainer.persistence.enabled the checkpoints go to trainer.persistence.mountPath (%v); leave checkpoint.dir unset" $checkpointDir $t.persistence.mountPath) -}}
{{- end -}}
{{- if and $t.persistence.enabled (gt (int $t.ranks) 1) (not $t.persistence.existingClaim) -}}
{{- $messages = append $messages "trainer.persistence: more than one rank write one checkpoint directory together; set trainer.persistence.existingClaim to a ReadWriteMany claim" -}}
{{- end -}}
{{- if $messages -}}
{{- fail (printf "\n\nVALUES VALIDATION:\n%s" (join "\n" $messages)) -}}
{{- end -}}
{{- end -}}

{{/* Shards: trainer.ranks / trainer.share, one admission consumer each. */}}
{{- define "rollstream.shards" -}}
{{- div (int .Values.trainer.ranks) (max 1 (int .Values.trainer.share)) -}}
{{- end -}}

{{/*
The alerts of docs/operations.md ("Alerts"), as a Prometheus rule file's `groups`: the
PrometheusRule's spec, and what tests/integration/test_alert_rules.py hands to promtool.
Every series is this release's: its namespace and release labels (those the chart's PodMonitor
and ServiceMonitor give a scraped pod: its namespace, and its app.kubernetes.io/instance label
as `release`), so two releases in one namespace each get their own alerts.
*/}}
{{- define "rollstream.alertRules" -}}
{{- $pr := .Values.monitoring.prometheusRule -}}
{{- $own := printf "namespace=%q, release=%q" .Release.Namespace .Release.Name -}}
{{- $stalled := $pr.trainerStalledAfter -}}
groups:
  - name: rollstream
    rules:
      - alert: RollstreamComponentDown
        expr: up{ {{- $own }}, component=~"admission|consumer|trainer"} == 0
        for: 5m
        labels:
          severity: critical
        annotations:
          summary: "rollstream {{`{{ $labels.component }}`}} {{`{{ or $labels.pod $labels.instance }}`}} cannot be scraped"
          description: "Prometheus has failed to scrape this {{`{{ $labels.component }}`}} for 5 minutes: the process is down, restarting or not answering on its metrics port."
      - alert: RollstreamTrainerStalled
        expr: >-
          max by (namespace, release, shard) (increase(rollstream_trainer_steps_total{ {{- $own }}}[{{ $stalled }}])) == 0
          and max by (namespace, release, shard) (rollstream_trainer_steps_total{ {{- $own }}} offset {{ $stalled }}) >= 0
        for: 5m
        labels:
          severity: critical
        annotations:
          summary: "rollstream trainer shard {{`{{ $labels.shard }}`}} has taken no step for {{ $stalled }}"
          description: "The trainer runs and exports its metrics but took no optimizer step in the last {{ $stalled }}: it waits for rows that do not come (rollout consumers, admission) or is stuck itself. monitoring.prometheusRule.trainerStalledAfter sets the window; make it a few times the longest step you expect."
      - alert: RollstreamNoRolloutSlots
        expr: >-
          sum by (namespace, release) (rollstream_samples_in_flight{ {{- $own }}}) > 0
          unless on (namespace, release) sum by (namespace, release) (rollstream_consumer_slots{ {{- $own }}}) > 0
        for: 10m
        labels:
          severity: critical
        annotations:
          summary: "rollstream has samples in flight and no rollout consumer to run them"
          description: "{{`{{ $value }}`}} samples are in flight but no rollout consumer exports its slots: none runs (scaled to zero while there is work, crash-looping, or unable to reach Redis)."
      - alert: RollstreamSlotsIdle
        expr: >-
          sum by (namespace, release) (rollstream_consumer_slots_busy{ {{- $own }}})
          / sum by (namespace, release) (rollstream_consumer_slots{ {{- $own }}}) < {{ $pr.idleSlotsBelow }}
        for: {{ $pr.idleSlotsFor }}
        labels:
          severity: warning
        annotations:
          summary: "rollstream's rollout slots are {{`{{ $value | humanizePercentage }}`}} busy"
          description: "Less than {{ $pr.idleSlotsBelow }} of the consumers' session slots have run a rollout for {{ $pr.idleSlotsFor }}: the scheduler's in-flight target is below the slots, the task supply is short, or the trainer is the bottleneck (its waited time on the dashboard says which). Scale the consumers down or raise scheduler.inflight_samples."
      - alert: RollstreamDeadLetters
        expr: max by (namespace, release) (rollstream_stream_length{ {{- $own }}, stream="dead"}) > 0
        for: 1m
        labels:
          severity: warning
        annotations:
          summary: "rollstream's dead-letter stream holds {{`{{ $value }}`}} entries"
          description: "Entries that could not be decoded were moved to the dead-letter stream, each with its reason (docs/reliability.md). Read them with XRANGE on the run's dead stream, fix their producer, then trim the stream."
      - alert: RollstreamGroupsAbandoned
        expr: sum by (namespace, release, shard) (increase(rollstream_groups_abandoned_total{ {{- $own }}}[1h])) > 0
        labels:
          severity: warning
        annotations:
          summary: "rollstream shard {{`{{ $labels.shard }}`}} gave up {{`{{ $value | humanize }}`}} groups in the last hour"
          description: "Groups whose samples failed scheduler.max_attempts times were given up: their tasks are not trained. The Resubmitted and Discarded panels show the causes (infra errors, timeouts, unscored results)."
{{- end }}
