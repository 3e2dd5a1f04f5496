"""finetune-operator: sizes, places and self-heals LLM fine-tuning jobs on Kubernetes.

Where things are: `api` (the FineTuneJob models), `crd` (the generated CRD), `sizing/`
(GPU memory estimates), `planning` (node pools and the plan search), `rendering/`
(the training job and trainer config), `recovery` (failure classification and adjustments),
`shell/` (the Kubernetes I/O: informers, work queue, leadership, the process), `cli` (the
`finetune-operator` command).
"""

__version__ = "0.1.0"
