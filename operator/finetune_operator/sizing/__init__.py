"""Per-GPU memory sizing of fine-tuning setups. Pure code: no torch at import time."""

from .architecture import FAMILIES, MODULE_KINDS, ModelArchitecture
from .errors import SizingError
from .presets import PRESETS
from .setup import TrainingSetup

__all__ = [
    "FAMILIES",
    "MODULE_KINDS",
    "ModelArchitecture",
    "PRESETS",
    "SizingError",
    "TrainingSetup",
]
