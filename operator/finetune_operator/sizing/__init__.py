"""Per-GPU memory sizing of fine-tuning setups. Pure code: no torch at import time."""

from .architecture import MODULE_KINDS, ModelArchitecture
from .errors import SizingError, UnknownArchitecture
from .memory import MemoryEstimate, estimate_memory
from .presets import PRESETS
from .traits import FAMILIES
from .setup import TrainingSetup

__all__ = [
    "FAMILIES",
    "MODULE_KINDS",
    "MemoryEstimate",
    "ModelArchitecture",
    "PRESETS",
    "SizingError",
    "TrainingSetup",
    "UnknownArchitecture",
    "estimate_memory",
]
