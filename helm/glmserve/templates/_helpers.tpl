{{/* Names: <release>-glmserve unless overridden, truncated to the 63 characters DNS allows. */}}
{{- define "glmserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "glmserve.fullname" -}}
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

{{- define "glmserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "glmserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: glmserve
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "router"). */}}
{{- define "glmserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "glmserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "glmserve.componentLabels" -}}
{{ include "glmserve.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "glmserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "glmserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "glmserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The drain budget: the preStop sleep, the service's own drain, and 5 s to exit. */}}
{{- define "glmserve.terminationGracePeriodSeconds" -}}
{{- add .Values.drain.preStopSleepSeconds .Values.drain.timeoutSeconds 5 -}}
{{- end -}}

{{- define "glmserve.kvstoreAddress" -}}
{{- printf "%s-kvstore:%v" (include "glmserve.fullname" .) .Values.kvstore.port -}}
{{- end -}}

{{- define "glmserve.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s-redis:6379/0" (include "glmserve.fullname" .) -}}
{{- else -}}
{{- required "redis.externalUrl is required when redis.enabled is false" .Values.redis.externalUrl -}}
{{- end -}}
{{- end -}}

{{/* Stage i's StatefulSet (and headless Service) name: (dict "root" $ "stage" i). */}}
{{- define "glmserve.prefillStageName" -}}
{{- printf "%s-prefill-s%d" (include "glmserve.fullname" .root) (int .stage) -}}
{{- end -}}

{{/* Per-pod DNS names through a headless Service: (dict "root" $ "name" sts "replicas" n "port" p). */}}
{{- define "glmserve.podAddresses" -}}
{{- $out := list -}}
{{- range $i := until (int .replicas) -}}
{{- $out = append $out (printf "%s-%d.%s.%s.svc:%v" $.name $i $.name $.root.Release.Namespace $.port) -}}
{{- end -}}
{{- join "," $out -}}
{{- end -}}

{{- define "glmserve.prefillAddresses" -}}
{{- include "glmserve.podAddresses" (dict "root" . "name" (include "glmserve.prefillStageName" (dict "root" . "stage" 0)) "replicas" .Values.prefill.replicas "port" .Values.prefill.port) -}}
{{- end -}}

{{- define "glmserve.decodeAddresses" -}}
{{- include "glmserve.podAddresses" (dict "root" . "name" (printf "%s-decode" (include "glmserve.fullname" .)) "replicas" .Values.decode.replicas "port" .Values.decode.port) -}}
{{- end -}}

{{/* Environment every glmserve container gets: its pod's name and IP, and the shared ConfigMap. */}}
{{- define "glmserve.env" -}}
env:
  - name: POD_NAME
    valueFrom: {fieldRef: {fieldPath: metadata.name}}
  - name: POD_IP
    valueFrom: {fieldRef: {fieldPath: status.podIP}}
  - name: OTEL_SERVICE_NAME
    value: {{ .service }}
  {{- if .podIndex }}
  - name: POD_INDEX
    valueFrom: {fieldRef: {fieldPath: "metadata.labels['apps.kubernetes.io/pod-index']"}}
  {{- end }}
  {{- with .extra }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
envFrom:
  - configMapRef:
      name: {{ include "glmserve.fullname" .root }}
{{- end -}}

{{- define "glmserve.podAnnotations" -}}
checksum/config: {{ include (print .root.Template.BasePath "/configmap.yaml") .root | sha256sum }}
{{- if .root.Values.monitoring.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "glmserve.lifecycle" -}}
lifecycle:
  preStop:
    sleep:
      seconds: {{ .Values.drain.preStopSleepSeconds }}
{{- end -}}

{{- define "glmserve.modelVolume" -}}
{{- $sources := list -}}
{{- range $k, $v := .Values.model.volume -}}{{- if $v -}}{{- $sources = append $sources $k -}}{{- end -}}{{- end -}}
{{- if ne (len $sources) 1 -}}
{{- fail (printf "model.volume: exactly one volume source, got %v (set the default's key to null)" $sources) -}}
{{- end -}}
- name: model
{{ toYaml .Values.model.volume | indent 2 }}
{{- end -}}

{{- define "glmserve.modelMount" -}}
- name: model
  mountPath: {{ .Values.model.path }}
  readOnly: true
{{- end -}}

{{/* GPU limits and the rest of a worker's resources: (dict "resources" r "gpu" g). */}}
{{- define "glmserve.workerResources" -}}
{{- $res := deepCopy .resources -}}
{{- if gt (int .gpu.count) 0 -}}
{{- $limits := default dict $res.limits -}}
{{- $_ := set $limits .gpu.resource (int .gpu.count) -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{- define "glmserve.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
{{ toYaml . | indent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
{{ toYaml . | indent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
{{ toYaml . | indent 2 }}
{{- end }}
{{- with .topologySpreadConstraints }}
topologySpreadConstraints:
{{ toYaml . | indent 2 }}
{{- end }}
{{- end -}}
