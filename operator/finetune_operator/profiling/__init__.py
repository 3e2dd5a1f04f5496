"""The pre-flight memory profile, operator side (pure: no Kubernetes I/O here).

A job whose model family the analytic memory model does not know (sizing raises
`UnknownArchitecture`) is measured instead: a CPU-only pod runs the trainer image's
`python -m finetune_trainer.profile`, which traces the trainer's real training step on fake
tensors for a few representative setups (`setups.py`) and reports per-phase peaks in its
termination message. The planner then sizes every setup it considers from those figures
(`estimate.py`: a `ProfiledArchitecture` that carries them). Measurements are cached per
(config hash, setup) in a ConfigMap the operator owns (`cache.py`), so a model is profiled once.
The pod is rendered by `pod.py`; what the lifecycle decides from what the shell saw is `state.py`.
"""
