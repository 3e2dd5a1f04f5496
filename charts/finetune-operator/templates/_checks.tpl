{{/*
"present", "missing" or "unknown" for a CRD, by name (the context). helm template and a client-side
dry run do not contact the cluster (lookup returns nothing), so an empty answer only means
"missing" when the cluster answered for something that always exists (kube-system).
*/}}
{{- define "finetune-operator.crdState" -}}
{{- if lookup "apiextensions.k8s.io/v1" "CustomResourceDefinition" "" . -}}
present
{{- else if lookup "v1" "Namespace" "" "kube-system" -}}
missing
{{- else -}}
unknown
{{- end -}}
{{- end -}}

{{- define "finetune-operator.pytorchJobCRD" -}}
{{- include "finetune-operator.crdState" "pytorchjobs.kubeflow.org" -}}
{{- end -}}

{{- define "finetune-operator.trainJobCRD" -}}
{{- include "finetune-operator.crdState" "trainjobs.trainer.kubeflow.org" -}}
{{- end -}}
