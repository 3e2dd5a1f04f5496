"""Render attempt N of a FineTuneJob under a plan: a ConfigMap and a PyTorchJob, as plain dicts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from finetune_trainer.contract import DEFAULT_REPORT_PATH, TrainerConfig

from .. import api
from ..planning import ClusterPolicy, Plan
from . import layout as paths
from . import pod
from .errors import RenderError
from .labels import common_labels, owner_reference
from .layout import layout_of, training_image
from .names import attempt_name
from .network import render_network_policy
from .templating import render_json_template
from .trainer_config import build_trainer_config

PREDICTED_PEAK_ANNOTATION = "finetune.dev/predicted-peak-bytes"
MODEL_ANNOTATION = "finetune.dev/model"
PLAN_ANNOTATION = "finetune.dev/plan"
# The FineTuneJob's full name: the job label holds it shortened (with a hash) when it is over 63 characters.
JOB_NAME_ANNOTATION = "finetune.dev/job-name"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# What the training operator deletes when the job has finished: its pods still Running or
# Pending (they hold GPUs), never the terminated ones that explain a failure.
CLEAN_POD_POLICY = "Running"


@dataclass(frozen=True)
class RenderedAttempt:
    """What the operator creates for one attempt, ready for the API (ConfigMap first)."""

    name: str
    config_map: dict[str, Any]
    pytorch_job: dict[str, Any]
    trainer_config: TrainerConfig
    network_policy: dict[str, Any] | None = None

    @property
    def objects(self) -> list[dict[str, Any]]:
        """In creation order: the pods mount the ConfigMap, so it goes first; the NetworkPolicy is
        there before any pod of the attempt is."""
        return [self.config_map, *([self.network_policy] if self.network_policy else []), self.pytorch_job]


def starts_suspended(spec: api.FineTuneJobSpec) -> bool:
    """Whether an attempt's training job is created suspended: the user's `spec.suspend`, or a
    named queue, because Kueue admits a job by un-suspending it (created running, it would
    start before admission, and quota would mean nothing)."""
    return spec.suspend or spec.queue_name is not None


def is_queued(child: Mapping[str, Any]) -> bool:
    """Whether a training job (as rendered, or as read back from the API) is admitted by a
    queueing system: it carries the queue label. Its suspension is the queue's, never ours
    to lift."""
    labels = (child.get("metadata") or {}).get("labels") or {}
    return bool(labels.get(QUEUE_LABEL))


def render_attempt(job: api.FineTuneJob, plan: Plan, attempt: int, policy: ClusterPolicy) -> RenderedAttempt:
    """The ConfigMap and PyTorchJob of attempt `attempt` (from 1) of `job` under `plan`.

    Raises RenderError naming the field when the job or plan cannot be rendered.
    """
    if attempt < 1:
        raise RenderError("attempt", f"must be at least 1, got {attempt}")
    name = attempt_name(job.metadata.name, attempt)
    layout = layout_of(job.spec, policy)
    region = pod.pinned_region(job, plan, policy)
    labels = common_labels(job, attempt)
    owner = owner_reference(job)
    image = training_image(job.spec, policy)
    config_map, trainer_config = render_config_map(job, plan, attempt, policy)

    object_labels = dict(labels)
    if job.spec.queue_name is not None:
        object_labels[QUEUE_LABEL] = job.spec.queue_name
    container_security = pod.container_security_context()
    training_env = pod.env(layout)

    def pod_data(master: bool) -> dict[str, Any]:
        """The Master's pod, or a Worker's: only the master uploads the result (rank 0 writes it)."""
        uploads = master and layout.upload is not None
        limits = pod.resources(plan, pod.UPLOAD_CPU_MILLIS if uploads else 0)
        init_containers = pod.init_containers(
            job, image, container_security, {k: v for k, v in limits.items() if k != pod.GPU_RESOURCE}, layout,
            master=master,
        )
        return {
            "labels": labels,
            "annotations": {
                PREDICTED_PEAK_ANNOTATION: str(plan.predicted_peak_bytes),
                JOB_NAME_ANNOTATION: job.metadata.name,
                **pod.scanner_skips(pod.takes_credentials(init_containers),
                                    network_policy=policy.network_policy.enabled),
            },
            "security_context": pod.pod_security_context(),
            "match_expressions": pod.match_expressions(policy.region_label_key, region, plan),
            "tolerations": pod.tolerations(plan),
            "init_containers": init_containers,
            "image": image,
            "command": pod.trainer_command(plan, layout, master=master),
            "env": training_env,
            "resources": limits,
            "volume_mounts": pod.volume_mounts(layout),
            "container_security_context": container_security,
            "report_path": DEFAULT_REPORT_PATH,
            "volumes": pod.volumes(name, layout, plan),
        }

    replicas = [{"type": "Master", "count": 1, "pod": pod_data(master=True)}]
    if plan.nodes > 1:
        replicas.append({"type": "Worker", "count": plan.nodes - 1, "pod": pod_data(master=False)})
    pytorch_job = render_json_template(
        "pytorchjob.json.j2",
        pytorch_job_meta=_meta(
            name,
            job,
            object_labels,
            owner,
            {MODEL_ANNOTATION: job.spec.model.name, PLAN_ANNOTATION: plan.summary(), JOB_NAME_ANNOTATION: job.metadata.name},
        ),
        suspend=starts_suspended(job.spec),
        clean_pod_policy=CLEAN_POD_POLICY,
        nproc_per_node=str(plan.gpus_per_node),
        replicas=replicas,
    )
    return RenderedAttempt(name=name, config_map=config_map, pytorch_job=pytorch_job, trainer_config=trainer_config,
                           network_policy=render_network_policy(job, attempt, policy))


def render_config_map(
    job: api.FineTuneJob, plan: Plan, attempt: int, policy: ClusterPolicy
) -> tuple[dict[str, Any], TrainerConfig]:
    """The attempt's ConfigMap (the trainer's input, named like the attempt's training job) and the
    config it holds: the same object whichever backend (PyTorchJob or TrainJob) runs the attempt."""
    if attempt < 1:
        raise RenderError("attempt", f"must be at least 1, got {attempt}")
    name = attempt_name(job.metadata.name, attempt)
    layout = layout_of(job.spec, policy)
    trainer_config = build_trainer_config(job, plan, attempt, layout)
    config_map = render_json_template(
        "configmap.json.j2",
        config_map_meta=_meta(name, job, common_labels(job, attempt), owner_reference(job), {}),
        config_key=paths.CONFIG_KEY,
        config_json=trainer_config.to_json(),
    )
    return config_map, trainer_config


def _meta(
    name: str, job: api.FineTuneJob, labels: dict[str, str], owner: dict[str, Any] | None, annotations: dict[str, str]
) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": job.metadata.namespace,
        "labels": labels,
        "owner": owner,
        "annotations": annotations,
    }
