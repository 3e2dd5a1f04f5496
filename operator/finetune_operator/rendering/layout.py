"""Where each volume of a training pod is mounted, and what the trainer finds there.

One volume per role (model, data, checkpoints, output); the same claim may serve several
roles. Paths inside a claim are not mounted with `subPath`: the whole claim is mounted
and the path goes into the trainer config, so a path is only ever data in a JSON document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .. import api
from .errors import RenderError

CONFIG_DIR = "/etc/finetune"
CONFIG_KEY = "config.json"
MODEL_DIR = "/mnt/model"
DATA_DIR = "/mnt/data"
CHECKPOINT_DIR = "/mnt/checkpoints"
OUTPUT_DIR = "/mnt/output"
SCRATCH_DIR = "/tmp"
SHM_DIR = "/dev/shm"
FINAL_FOLDER = "final"

Role = Literal["model", "data", "checkpoints", "output"]


@dataclass(frozen=True)
class ClaimMount:
    """A PersistentVolumeClaim mounted for one role."""

    role: Role
    claim_name: str
    mount_path: str
    read_only: bool
    path: str | None  # inside the claim

    @property
    def local_path(self) -> str:
        """Where the trainer finds the role's files."""
        return self.mount_path if self.path is None else f"{self.mount_path}/{self.path}"


@dataclass(frozen=True)
class Layout:
    """The volumes of one job's pods and the paths the trainer reads and writes."""

    model: ClaimMount | None  # None: fetched from the Hub into an emptyDir by an init container
    data: ClaimMount
    checkpoints: ClaimMount | None
    output: ClaimMount | None

    @property
    def claims(self) -> list[ClaimMount]:
        return [m for m in (self.model, self.data, self.checkpoints, self.output) if m is not None]

    @property
    def model_path(self) -> str:
        return self.model.local_path if self.model is not None else MODEL_DIR

    @property
    def checkpoint_path(self) -> str | None:
        return None if self.checkpoints is None else self.checkpoints.local_path

    @property
    def output_is_ephemeral(self) -> bool:
        """Neither an output nor a checkpoint volume: the result goes to an emptyDir and is lost with the pod."""
        return self.output is None and self.checkpoints is None

    @property
    def output_path(self) -> str:
        if self.output is not None:
            return self.output.local_path
        if self.checkpoints is not None:
            return f"{self.checkpoints.local_path}/{FINAL_FOLDER}"
        return OUTPUT_DIR


def layout_of(spec: api.FineTuneJobSpec) -> Layout:
    """The layout for a job; sources the pods cannot read yet are errors naming the field."""
    source = spec.model.source
    if source.pvc is not None:
        model = ClaimMount("model", source.pvc.claim_name, MODEL_DIR, source.pvc.read_only, source.pvc.path)
    elif source.hf is not None:
        model = None
    else:
        raise RenderError(
            "spec.model.source.uri",
            "archives at s3://, gs:// or https:// are not fetched by the training pods yet;"
            " put the weights on a volume (source.pvc) or use source.hf",
        )
    data_source = spec.dataset.source
    if data_source.pvc is None:
        raise RenderError(
            "spec.dataset.source.uri",
            "data at s3://, gs:// or https:// is not fetched by the training pods yet; put it on a volume (source.pvc)",
        )
    data = ClaimMount("data", data_source.pvc.claim_name, DATA_DIR, data_source.pvc.read_only, data_source.pvc.path)
    checkpoints = None
    if spec.checkpoint is not None:
        pvc = spec.checkpoint.pvc
        checkpoints = ClaimMount("checkpoints", pvc.claim_name, CHECKPOINT_DIR, False, pvc.path)
    output = None
    if spec.output is not None:
        if spec.output.pvc is None:
            raise RenderError(
                "spec.output.uri",
                "uploading the result to s3:// or gs:// is not supported yet; use output.pvc",
            )
        output = ClaimMount("output", spec.output.pvc.claim_name, OUTPUT_DIR, False, spec.output.pvc.path)
    return Layout(model=model, data=data, checkpoints=checkpoints, output=output)
