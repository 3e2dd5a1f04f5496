{{/* Rules on cluster-scoped resources; needed whichever namespaces are watched. */}}
{{- define "finetune-operator.clusterRules" -}}
# Planning discovers GPU nodes: their pool, region, zone, GPU labels and allocatable GPUs.
- apiGroups: [""]
  resources: [nodes]
  verbs: [get, list, watch]
# The training-job CRDs, each watched by name (a field selector on metadata.name, which the API server
# authorizes against resourceNames): when one is installed, changed or removed, the operator looks
# again at which training-job kinds are served. No other CRD is read.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  resourceNames: [pytorchjobs.kubeflow.org, trainjobs.trainer.kubeflow.org]
  verbs: [list, watch]
{{- if has (.Values.policy.trainingBackend | default "auto") (list "auto" "trainjob") }}
# TrainJobs refer to the ClusterTrainingRuntime trainJobRuntime.name: the operator checks it exists.
- apiGroups: [trainer.kubeflow.org]
  resources: [clustertrainingruntimes]
  verbs: [get]
{{- end }}
{{- end -}}

{{/* Rules on namespaced resources, granted cluster-wide or per watched namespace. */}}
{{- define "finetune-operator.namespacedRules" -}}
# The operator's own resource, read only: its informer lists and watches it, a reconcile reads it (no
# finalizer, no annotation: the operator never writes the object itself).
- apiGroups: [finetune.dev]
  resources: [finetunejobs]
  verbs: [get, list, watch]
# Phase, conditions, plan, attempts (update, guarded by resourceVersion) and progress (patch) are
# written to the status subresource.
- apiGroups: [finetune.dev]
  resources: [finetunejobs/status]
  verbs: [patch, update]
{{- $backend := .Values.policy.trainingBackend | default "auto" }}
# Each attempt is a PyTorchJob or a TrainJob (Kubeflow Trainer v2) the operator creates, watches,
# suspends (patch) and deletes before the next attempt. Reading, suspending and deleting both kinds
# stays granted whatever policy.trainingBackend says: after a change of backend, the attempts of the
# other kind still run and must still be followed, suspended and cleaned up. Creating is granted
# only for the backend(s) new attempts may use.
- apiGroups: [kubeflow.org]
  resources: [pytorchjobs]
  verbs: [get, list, watch, delete, patch]
- apiGroups: [trainer.kubeflow.org]
  resources: [trainjobs]
  verbs: [get, list, watch, delete, patch]
{{- if has $backend (list "auto" "pytorchjob") }}
- apiGroups: [kubeflow.org]
  resources: [pytorchjobs]
  verbs: [create]
{{- end }}
{{- if has $backend (list "auto" "trainjob") }}
- apiGroups: [trainer.kubeflow.org]
  resources: [trainjobs]
  verbs: [create]
{{- end }}
{{- if .Values.kueue.enabled }}
# Kueue, read only: a queued job's Workload says why it waits; its LocalQueue may not exist.
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [list]
- apiGroups: [kueue.x-k8s.io]
  resources: [localqueues]
  verbs: [get]
{{- end }}
# The trainer config of each attempt is a ConfigMap mounted into its pods: created, updated by a merge
# patch when an earlier try left another config, deleted with its attempt; a job's configMapRef is
# read (get). Nothing lists or watches ConfigMaps (the policy is polled by name).
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, create, delete, patch]
# Each attempt's NetworkPolicy (its pods talk to each other, DNS and the job's storage only): created
# before its training job, read when a create finds the name taken, deleted with its attempt.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, delete]
# Training pods are read (never written) to classify failures from their termination state. No pod is
# created here: the profile pod runs in the release namespace (the <fullname>-profile Role).
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
# status.progress: the trainer's progress line is read from the rank-0 pod's log (logs only: no exec, no attach).
- apiGroups: [""]
  resources: [pods/log]
  verbs: [get]
# The operator explains what it does with Events on the FineTuneJob, through the core API (it creates
# them, and patches the count of a repeated one).
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
{{- end -}}
