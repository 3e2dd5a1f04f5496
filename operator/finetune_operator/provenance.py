"""The provenance record of a FineTuneJob: what the model was trained on, where, with what, and at
what cost. A pure function of the job (spec and status), so `finetune-operator record NAME` prints
the same record from the live object, a saved `kubectl get -o yaml`, or a backup.

Who knows what:
- the operator, in status: every attempt's plan (pool, region, GPU type and count), the nodes its
  pods ran on, the trainer image each ran (by digest where the kubelet reported one), when it ran and
  how it ended, and what the next attempt changed (the attempt's message);
- the trainer, in the success report and beside the output (provenance/attempt-N.json): the sha256
  of every dataset file and of the base model's config, the records and tokens it trained on.

GPU-hours count from an attempt's first pod start (`runningSince`) to its end, times its GPUs: time
queued or waiting for a node holds no GPU. Energy is an estimate, said to be one: GPU-hours times the
GPU type's board power (planning/gpus.py), an upper bound of the cards' draw that leaves out hosts,
network and cooling.
"""

from __future__ import annotations

from datetime import datetime

from finetune_trainer.contract import ExportFacts, TrainingFacts

from . import api
from .planning.gpus import gpu_type_info
from .rendering.layout import FINAL_FOLDER

RECORD_DIRECTORY = "provenance"  # the trainer's (finetune_trainer.provenance), in the output location
ENERGY_NOTE = ("estimate: GPU-hours x the GPU type's board power (TDP) from the operator's GPU table; "
               "an upper bound of the GPUs' draw, without hosts, network or cooling")


class AttemptRecord(api.StatusModel):
    attempt: int
    training_job: str
    outcome: str
    message: str = ""
    node_pool: str | None = None
    region: str | None = None
    gpu_type: str | None = None
    gpus: int | None = None
    nodes: list[str] = []
    images: list[str] = []
    plan: str = ""
    created: datetime | None = None
    running_since: datetime | None = None
    ended: datetime | None = None
    gpu_hours: float = 0.0
    energy_kwh_estimate: float | None = None
    predicted_peak_gi_b: float | None = None
    observed_peak_gi_b: float | None = None


class SourceRecord(api.StatusModel):
    location: str
    """Where it was read from: hf://repo@revision, s3://endpoint/bucket/key, pvc://claim/path."""


class ModelRecord(SourceRecord):
    name: str
    config_sha256: str | None = None


class DatasetRecord(SourceRecord):
    format: str
    packing: bool
    sha256: str | None = None
    files: int | None = None
    records: int | None = None
    held_out: int | None = None
    """Sequences held out for evaluation; the split is a function of the seed (spec.training.seed)."""


class EvalDatasetRecord(SourceRecord):
    """spec.evaluation.dataset: a separate evaluation dataset."""

    sha256: str | None = None
    examples: int | None = None


class ProvenanceRecord(api.StatusModel):
    """The whole record, as `finetune-operator record` prints it."""

    job: str
    namespace: str
    uid: str | None = None
    phase: str
    complete: bool
    """True once the job succeeded: then every figure below is final."""
    method: str
    base_model: ModelRecord
    dataset: DatasetRecord
    eval_dataset: EvalDatasetRecord | None = None
    requested_image: str | None = None
    output: str
    export: str | None = None
    """The merged/ or full/ folder the export after training wrote (spec.export), beside the output."""
    trainer_records: str
    """The trainer's own record of each attempt that finished, with every dataset file's sha256."""
    attempts: list[AttemptRecord]
    steps: int | None = None
    tokens_last_attempt: int | None = None
    final_loss: float | None = None
    eval_loss: float | None = None
    gpu_hours: float
    energy_kwh_estimate: float | None = None
    energy_note: str = ENERGY_NOTE


def location(source: api.ModelSource | api.DataSource | api.OutputSpec) -> str:
    """One line naming where a source or output is (no credentials: only the Secret's name is in the spec)."""
    hf = getattr(source, "hf", None)
    if hf is not None:
        return f"hf://{hf.repo}@{hf.revision}"
    if source.s3 is not None:
        s3 = source.s3
        return f"s3://{s3.endpoint}/{s3.bucket}/{s3.key}".rstrip("/")
    if source.pvc is not None:
        return f"pvc://{source.pvc.claim_name}/{source.pvc.path or ''}".rstrip("/")
    return "unknown"


def base_model_name(spec: api.FineTuneJobSpec) -> str:
    hf = spec.model.source.hf
    return f"{spec.model.name} (revision {hf.revision})" if hf is not None else spec.model.name


def attempt_gpu_hours(record: api.AttemptStatus, now: datetime) -> float:
    """GPUs x (end, or now while it runs, - its first pod's start, or its creation when no pod was seen)."""
    if record.plan is None:
        return 0.0
    start = record.running_since or record.start_time
    if start is None:
        return 0.0
    end = record.end_time or (now if record.outcome == "Running" else None)
    if end is None or end <= start:
        return 0.0
    return record.plan.gpus * (end - start).total_seconds() / 3600


def energy_kwh(gpu_type: str, gpu_hours: float) -> float | None:
    info = gpu_type_info(gpu_type)
    return None if info is None else gpu_hours * info.board_power_watts / 1000


def _attempt_record(record: api.AttemptStatus, now: datetime) -> AttemptRecord:
    plan = record.plan
    hours = attempt_gpu_hours(record, now)
    return AttemptRecord(
        attempt=record.attempt, training_job=record.pytorch_job, outcome=record.outcome, message=record.message,
        node_pool=plan.node_pool if plan else None, region=plan.region if plan else None,
        gpu_type=plan.gpu_type if plan else None, gpus=plan.gpus if plan else None,
        nodes=record.nodes, images=record.images, plan=record.plan_summary,
        created=record.start_time, running_since=record.running_since, ended=record.end_time,
        gpu_hours=round(hours, 4),
        energy_kwh_estimate=_rounded(energy_kwh(plan.gpu_type, hours)) if plan else None,
        predicted_peak_gi_b=record.predicted_peak_gi_b, observed_peak_gi_b=record.observed_peak_gi_b,
    )


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _energy_total(attempts: list[AttemptRecord]) -> float | None:
    """The sum, or None when an attempt that used GPUs has a GPU type without a board power."""
    if any(a.energy_kwh_estimate is None and a.gpu_hours > 0 for a in attempts):
        return None
    return round(sum(a.energy_kwh_estimate or 0.0 for a in attempts), 4)


def output_location(spec: api.FineTuneJobSpec) -> str:
    """Where the result went (rendering/layout.py decides it the same way)."""
    if spec.output is not None:
        return location(spec.output)
    if spec.checkpoint is not None:
        pvc = spec.checkpoint.pvc
        return f"pvc://{pvc.claim_name}/{pvc.path or ''}".rstrip("/") + f"/{FINAL_FOLDER}"
    return "the training pod's own disk (neither spec.output nor spec.checkpoint is set: gone with the pod)"


def output_records(spec: api.FineTuneJobSpec) -> str:
    if spec.output is None and spec.checkpoint is None:
        return output_location(spec)
    return f"{output_location(spec)}/{RECORD_DIRECTORY}/"


def export_location(spec: api.FineTuneJobSpec, export: ExportFacts | None) -> str | None:
    """Where the trainer's export went, in the job's terms: its folder (merged/, full/) in the output location."""
    if export is None:
        return None
    return f"{output_location(spec)}/{export.kind}"


def summary(job: api.FineTuneJob, facts: TrainingFacts | None, steps: int | None,
            now: datetime, export: ExportFacts | None = None) -> api.ProvenanceSummary:
    """status.provenance of a job that just succeeded (the lifecycle writes it once)."""
    status = job.status or api.FineTuneJobStatus()
    attempts = [_attempt_record(a, now) for a in status.attempts]
    return api.ProvenanceSummary(
        base_model=base_model_name(job.spec),
        base_config_sha256=facts.base_config_sha256 if facts else None,
        dataset_sha256=facts.dataset_sha256 if facts else None,
        dataset_files=facts.dataset_files if facts else None,
        records=facts.records if facts else None,
        held_out=facts.held_out if facts else None,
        eval_dataset_sha256=facts.eval_dataset_sha256 if facts else None,
        eval_examples=facts.eval_examples if facts else None,
        best_eval_step=facts.best_eval_step if facts else None,
        best_eval_loss=facts.best_eval_loss if facts else None,
        stopped_early_at=facts.stopped_early_at if facts else None,
        output_is_best=facts.output_is_best if facts else None,
        tokens_last_attempt=facts.tokens if facts else None,
        steps=steps,
        final_loss=facts.final_loss if facts else None,
        eval_loss=facts.eval_loss if facts else None,
        attempts=len(attempts),
        regions=sorted({a.region for a in attempts if a.region}),
        gpu_hours=round(sum(a.gpu_hours for a in attempts), 4),
        energy_kwh_estimate=_energy_total(attempts),
        record=output_records(job.spec),
        export=export_location(job.spec, export),
        export_bytes=export.total_bytes if export else None,
    )


def build_record(job: api.FineTuneJob, now: datetime) -> ProvenanceRecord:
    """The full record of `job` as it stands: final once the job succeeded (`complete`)."""
    spec, status = job.spec, job.status or api.FineTuneJobStatus()
    attempts = [_attempt_record(a, now) for a in status.attempts]
    summed = status.provenance
    return ProvenanceRecord(
        job=job.metadata.name, namespace=job.metadata.namespace or "default", uid=job.metadata.uid,
        phase=status.phase, complete=status.phase == "Succeeded" and summed is not None,
        method=spec.method,
        base_model=ModelRecord(name=base_model_name(spec), location=location(spec.model.source),
                               config_sha256=summed.base_config_sha256 if summed else None),
        dataset=DatasetRecord(location=location(spec.dataset.source), format=spec.dataset.format,
                              packing=spec.dataset.packing,
                              sha256=summed.dataset_sha256 if summed else None,
                              files=summed.dataset_files if summed else None,
                              records=summed.records if summed else None,
                              held_out=summed.held_out if summed else None),
        eval_dataset=None if spec.evaluation is None or spec.evaluation.dataset is None else EvalDatasetRecord(
            location=location(spec.evaluation.dataset), sha256=summed.eval_dataset_sha256 if summed else None,
            examples=summed.eval_examples if summed else None),
        requested_image=spec.image,
        output=output_location(spec),
        export=summed.export if summed else None,
        trainer_records=output_records(spec),
        attempts=attempts,
        steps=summed.steps if summed else None,
        tokens_last_attempt=summed.tokens_last_attempt if summed else None,
        final_loss=summed.final_loss if summed else None,
        eval_loss=summed.eval_loss if summed else None,
        gpu_hours=round(sum(a.gpu_hours for a in attempts), 4),
        energy_kwh_estimate=_energy_total(attempts),
    )


def pod_facts(pods: list[dict], trainer_containers: tuple[str, ...]) -> tuple[list[str], list[str], datetime | None]:
    """What an attempt's pods show of where and with what they ran: the nodes they were scheduled to,
    the trainer container's image (imageID, the digest, once the kubelet pulled it; else the image as
    named) and the earliest pod start on a node."""
    nodes: set[str] = set()
    images: set[str] = set()
    starts: list[datetime] = []
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        if not node:
            continue
        nodes.add(node)
        status = pod.get("status") or {}
        started = api.kube_time(status.get("startTime"))
        if started is not None:
            starts.append(started)
        for container in status.get("containerStatuses") or []:
            if container.get("name") in trainer_containers:
                image = container.get("imageID") or container.get("image")
                if image:
                    images.add(image)
    return sorted(nodes), sorted(images), min(starts) if starts else None

