"""Where each volume of a training pod is mounted, and what the trainer finds there.

One volume per role (model, data, eval, checkpoints, output); the same claim may serve several
roles. Paths inside a claim are not mounted with `subPath`: the whole claim is mounted
and the path goes into the trainer config, so a path is only ever data in a JSON document.
A model, data or eval data in S3-compatible object storage is fetched by an init container into an
emptyDir of its role; an output there is written to an emptyDir and uploaded after training.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Literal

from .. import api
from ..planning.policy import ClusterPolicy
from ..planning.storage import StorageError, storage_regions
from .errors import RenderError

CONFIG_DIR = "/etc/finetune"
CONFIG_KEY = "config.json"
MODEL_DIR = "/mnt/model"
DATA_DIR = "/mnt/data"
EVAL_DIR = "/mnt/eval"
CHECKPOINT_DIR = "/mnt/checkpoints"
OUTPUT_DIR = "/mnt/output"
# The training container and the upload sidecar hand the result over here (objectstore.py).
HANDOFF_DIR = "/mnt/handoff"
SCRATCH_DIR = "/tmp"
SHM_DIR = "/dev/shm"
FINAL_FOLDER = "final"

Role = Literal["model", "data", "eval", "checkpoints", "output"]


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
class Transfer:
    """A role whose files live in S3-compatible object storage: fetched before training (model,
    data) or uploaded after it (output), through an emptyDir at `local_dir`."""

    role: Role
    field: str  # the spec field, e.g. spec.dataset.source.s3
    location: api.S3Location
    local_dir: str

    @property
    def key(self) -> str:
        """What is transferred: (eval) data may be one object; a model and an output are folders."""
        return self.location.key if self.role in ("data", "eval") else self.location.folder_key

    @property
    def local_path(self) -> str:
        """Where the trainer finds it: the folder, or the one data object's file in it."""
        key = self.key
        if key == "" or key.endswith("/"):
            return self.local_dir
        return f"{self.local_dir}/{posixpath.basename(key)}"


@dataclass(frozen=True)
class Layout:
    """The volumes of one job's pods and the paths the trainer reads and writes."""

    model: ClaimMount | None  # None: fetched (Hub or object storage) into an emptyDir by an init container
    data: ClaimMount | None  # None: fetched from object storage into an emptyDir
    checkpoints: ClaimMount | None
    output: ClaimMount | None
    fetches: tuple[Transfer, ...] = ()  # model, data and eval data from object storage, in that order
    upload: Transfer | None = None  # the output to object storage
    eval: ClaimMount | None = None  # spec.evaluation.dataset on a volume

    @property
    def claims(self) -> list[ClaimMount]:
        return [m for m in (self.model, self.data, self.eval, self.checkpoints, self.output) if m is not None]

    @property
    def eval_fetched(self) -> bool:
        return any(t.role == "eval" for t in self.fetches)

    @property
    def eval_path(self) -> str | None:
        """Where the trainer finds spec.evaluation.dataset; None when the job has none."""
        if self.eval is not None:
            return self.eval.local_path
        return next((t.local_path for t in self.fetches if t.role == "eval"), None)

    @property
    def model_path(self) -> str:
        return self.model.local_path if self.model is not None else MODEL_DIR

    @property
    def data_path(self) -> str:
        if self.data is not None:
            return self.data.local_path
        return next(t.local_path for t in self.fetches if t.role == "data")

    @property
    def checkpoint_path(self) -> str | None:
        return None if self.checkpoints is None else self.checkpoints.local_path

    @property
    def output_is_ephemeral(self) -> bool:
        """Neither an output nor a checkpoint volume: the result goes to an emptyDir and is lost with the pod."""
        return self.output is None and self.checkpoints is None and self.upload is None

    @property
    def output_in_empty_dir(self) -> bool:
        """The result is written to an emptyDir: it is uploaded from there, or (ephemeral) lost with the pod."""
        return self.upload is not None or self.output_is_ephemeral

    @property
    def output_path(self) -> str:
        if self.upload is not None:
            return OUTPUT_DIR
        if self.output is not None:
            return self.output.local_path
        if self.checkpoints is not None:
            return f"{self.checkpoints.local_path}/{FINAL_FOLDER}"
        return OUTPUT_DIR


def training_image(spec: api.FineTuneJobSpec, policy: ClusterPolicy) -> str:
    """The image the job's training, init and upload containers run: `spec.image` when the policy's
    `allowedImages` allow it, else the trainer image. A disallowed image is an error naming `spec.image`
    (that image would hold the job's Hub token and object-storage keys)."""
    image = policy.image_for(spec.image)
    problem = policy.image_problem(image)
    if problem is not None:
        raise RenderError("spec.image", problem)
    return image


def _data_source(role: Role, field: str, source: api.DataSource, local_dir: str,
                 fetches: list[Transfer]) -> ClaimMount | None:
    """The training or the evaluation data: a mount on its volume, or (None) a fetch from object
    storage appended to `fetches`."""
    if source.pvc is not None:
        return ClaimMount(role, source.pvc.claim_name, local_dir, source.pvc.read_only, source.pvc.path)
    if source.s3 is not None:
        fetches.append(Transfer(role, f"{field}.s3", source.s3, local_dir))
        return None
    raise RenderError(f"{field}.uri", api.UNSUPPORTED_URI_MESSAGE)


def layout_of(spec: api.FineTuneJobSpec, policy: ClusterPolicy | None = None) -> Layout:
    """The layout for a job; sources the pods cannot read are errors naming the field.

    With the cluster policy, object storage is checked too: an endpoint the policy does not
    list, or one no region the job may use may reach, is an error naming the endpoint field.
    """
    if policy is not None:
        training_image(spec, policy)
        try:
            storage_regions(spec, policy)
        except StorageError as error:
            raise RenderError(error.path, error.message) from None
    fetches: list[Transfer] = []
    source = spec.model.source
    model = None
    if source.pvc is not None:
        model = ClaimMount("model", source.pvc.claim_name, MODEL_DIR, source.pvc.read_only, source.pvc.path)
    elif source.s3 is not None:
        fetches.append(Transfer("model", "spec.model.source.s3", source.s3, MODEL_DIR))
    elif source.hf is None:
        raise RenderError("spec.model.source.uri", api.UNSUPPORTED_URI_MESSAGE)
    data = _data_source("data", "spec.dataset.source", spec.dataset.source, DATA_DIR, fetches)
    eval_source = spec.evaluation.dataset if spec.evaluation is not None else None
    eval_mount = None if eval_source is None else _data_source(
        "eval", "spec.evaluation.dataset", eval_source, EVAL_DIR, fetches)
    checkpoints = None
    if spec.checkpoint is not None:
        pvc = spec.checkpoint.pvc
        checkpoints = ClaimMount("checkpoints", pvc.claim_name, CHECKPOINT_DIR, False, pvc.path)
    output = upload = None
    if spec.output is not None:
        if spec.output.pvc is not None:
            output = ClaimMount("output", spec.output.pvc.claim_name, OUTPUT_DIR, False, spec.output.pvc.path)
        elif spec.output.s3 is not None:
            upload = Transfer("output", "spec.output.s3", spec.output.s3, OUTPUT_DIR)
        else:
            raise RenderError("spec.output.uri", api.UNSUPPORTED_URI_MESSAGE)
    return Layout(model=model, data=data, checkpoints=checkpoints, output=output, fetches=tuple(fetches), upload=upload,
                  eval=eval_mount)
