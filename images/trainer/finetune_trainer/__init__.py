"""What runs in the training pods.

Importing the package imports nothing heavy: ``finetune_trainer.contract`` is shared
with the operator, which has no torch. The training code lives in the submodules and
is run with ``python -m finetune_trainer --config /etc/finetune/config.json``.
"""
