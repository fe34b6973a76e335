{{/* Names: <release>-kvik-replica, <release>-kvik-gateway, cut to 63 characters (DNS labels). */}}
{{- define "kvik.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvik.replica.name" -}}
{{- printf "%s-replica" (include "kvik.fullname" .) | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvik.replica.headless" -}}
{{- printf "%s-headless" (include "kvik.replica.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvik.gateway.name" -}}
{{- printf "%s-gateway" (include "kvik.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvik.secretName" -}}
{{- default (printf "%s-secrets" (include "kvik.fullname" .)) .Values.secrets.existingSecret -}}
{{- end -}}

{{- define "kvik.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "kvik.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component ("replica" or "gateway"): call with (list $ "replica"). */}}
{{- define "kvik.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ $root.Chart.Name }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* Pod annotations: prometheus.io/* (when metrics.podAnnotations) merged with the component's own.
Call with (list $ port podAnnotations); renders an `annotations:` block, or nothing when empty. */}}
{{- define "kvik.podAnnotations" -}}
{{- $root := index . 0 -}}
{{- $annotations := deepCopy (index . 2 | default dict) -}}
{{- if $root.Values.metrics.podAnnotations -}}
{{- $_ := set $annotations "prometheus.io/scrape" "true" -}}
{{- $_ := set $annotations "prometheus.io/port" (index . 1 | toString) -}}
{{- $_ := set $annotations "prometheus.io/path" "/metrics" -}}
{{- end -}}
{{- with $annotations -}}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end -}}
{{- end -}}

{{/* The container's restricted security settings (the image runs as uid 10001). */}}
{{- define "kvik.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{- define "kvik.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Replica URLs the gateway routes to: the StatefulSet's stable pod names behind the headless
Service, one per pod the StatefulSet may have (maxReplicas under the HPA). Pods not (yet) there
fail the gateway's health probe and get no traffic until they answer. */}}
{{- define "kvik.replicaUrls" -}}
{{- $count := int .Values.replica.replicaCount -}}
{{- if .Values.replica.autoscaling.enabled -}}
{{- $count = int .Values.replica.autoscaling.maxReplicas -}}
{{- end -}}
{{- $urls := list -}}
{{- range $i := until $count -}}
{{- $urls = append $urls (printf "http://%s-%d.%s.%s.svc.%s:%d" (include "kvik.replica.name" $) $i (include "kvik.replica.headless" $) $.Release.Namespace $.Values.clusterDomain (int $.Values.replica.port)) -}}
{{- end -}}
{{- toJson $urls -}}
{{- end -}}
