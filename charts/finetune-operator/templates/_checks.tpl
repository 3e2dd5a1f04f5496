{{/*
"present", "missing" or "unknown" for the Kubeflow PyTorchJob CRD. helm template and a client-side
dry run do not contact the cluster (lookup returns nothing), so an empty answer only means
"missing" when the cluster answered for something that always exists (kube-system).
*/}}
{{- define "finetune-operator.pytorchJobCRD" -}}
{{- if lookup "apiextensions.k8s.io/v1" "CustomResourceDefinition" "" "pytorchjobs.kubeflow.org" -}}
present
{{- else if lookup "v1" "Namespace" "" "kube-system" -}}
missing
{{- else -}}
unknown
{{- end -}}
{{- end -}}
