{{/*
A worker StatefulSet with its headless Service and PDB, shared by every prefill stage and decode:
(dict "root" $ "name" name "component" c "role" prefill|decode "v" .Values.<role> "args" list "labels" dict).
StatefulSet, not Deployment: a pod keeps its name (its worker id, the key of its blocks in the kvstore
index) and its DNS name across restarts, and pod r of each prefill stage pairs with pod r of the next.
*/}}
{{- define "glmserve.workerStatefulSet" -}}
{{- $root := .root -}}
{{- $v := .v -}}
{{- $sel := merge (dict) .labels (fromYaml (include "glmserve.selectorLabels" (dict "root" $root "component" .component))) -}}
{{- $own := merge (dict) .labels (dict "app.kubernetes.io/component" .component) -}}
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: {{ .name }}
  labels:
    {{- include "glmserve.labels" $root | nindent 4 }}
    {{- toYaml $own | nindent 4 }}
spec:
  serviceName: {{ .name }}
  replicas: {{ $v.replicas }}
  # Workers do not depend on each other's start order: start and replace them all at once.
  podManagementPolicy: Parallel
  selector:
    matchLabels:
      {{- toYaml $sel | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "glmserve.labels" $root | nindent 8 }}
        {{- toYaml $own | nindent 8 }}
      annotations:
        {{- include "glmserve.podAnnotations" (dict "root" $root "port" $root.Values.metricsPort "extra" $v.podAnnotations) | nindent 8 }}
    spec:
      serviceAccountName: {{ include "glmserve.serviceAccountName" $root }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      terminationGracePeriodSeconds: {{ include "glmserve.terminationGracePeriodSeconds" $root }}
      {{- include "glmserve.scheduling" $v | nindent 6 }}
      containers:
        - name: {{ .role }}
          image: {{ include "glmserve.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          command: ["python", "-m", "glmserve.services.{{ .role }}.main"]
          args:
            {{- range .args }}
            - {{ . }}
            {{- end }}
            {{- range $v.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          {{- include "glmserve.env" (dict "root" $root "service" (printf "glmserve-%s" .role) "podIndex" true) | nindent 10 }}
          ports:
            - {name: grpc, containerPort: {{ $v.port }}}
            - {name: metrics, containerPort: {{ $root.Values.metricsPort }}}
          # The gRPC port opens once the model is loaded.
          startupProbe:
            tcpSocket: {port: grpc}
            periodSeconds: {{ $v.startupProbe.periodSeconds }}
            failureThreshold: {{ $v.startupProbe.failureThreshold }}
          readinessProbe:
            tcpSocket: {port: grpc}
            periodSeconds: 5
          livenessProbe:
            httpGet: {path: /metrics, port: metrics}
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: 3
          {{- include "glmserve.lifecycle" $root | nindent 10 }}
          resources:
            {{- include "glmserve.workerResources" (dict "resources" $v.resources "gpu" $v.gpu) | nindent 12 }}
          volumeMounts:
            {{- include "glmserve.modelMount" $root | nindent 12 }}
      volumes:
        {{- include "glmserve.modelVolume" $root | nindent 8 }}
---
# Headless: one DNS record per pod (<pod>.<service>), how the router and the other stages reach it.
apiVersion: v1
kind: Service
metadata:
  name: {{ .name }}
  labels:
    {{- include "glmserve.labels" $root | nindent 4 }}
    {{- toYaml $own | nindent 4 }}
spec:
  clusterIP: None
  # Pods are addressed while they load too (their gRPC port refuses until ready; the router polls Health).
  publishNotReadyAddresses: true
  selector:
    {{- toYaml $sel | nindent 4 }}
  ports:
    - {name: grpc, port: {{ $v.port }}, targetPort: grpc}
    - {name: metrics, port: {{ $root.Values.metricsPort }}, targetPort: metrics}
{{- if $v.pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ .name }}
  labels:
    {{- include "glmserve.labels" $root | nindent 4 }}
    {{- toYaml $own | nindent 4 }}
spec:
  maxUnavailable: {{ $v.pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- toYaml $sel | nindent 6 }}
{{- end }}
{{- end -}}
