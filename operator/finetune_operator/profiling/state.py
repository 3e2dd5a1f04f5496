"""What the lifecycle decides about the profile, from what the shell saw (pure).

The shell (shell/profiling.py) reads the cache ConfigMap and the job's profile pod and hands
them over as a `ProfileObservation`; it also writes a finished pod's measurements into the
cache before the lifecycle runs, so the lifecycle only ever sees the cache and the pod's phase.
`resolve` returns either the architecture to plan with (everything needed is measured) or a
`ProfileStep`: what to create or delete and what to say meanwhile (condition `Profiled`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from finetune_trainer.contract import ProfileReport

from .. import api
from ..sizing import UnknownArchitecture
from ..sizing.from_job import architecture_of, config_json_of
from ..planning.policy import ClusterPolicy
from .cache import CachedProfile, as_report, refused_measurements
from .estimate import ProfiledArchitecture, profiled_architecture
from .pod import placement_hash, profile_pod_name, render_profile_pod
from .setups import JobProfile, NotProfilable, config_hash, job_profile, profile_request

COND_PROFILED = "Profiled"
# A job may ask for the profile even when the analytic model knows its family (to size it from
# measurements instead): this annotation on the FineTuneJob, value "true".
PROFILE_ANNOTATION = "finetune.dev/memory-profile"


class ProfileRequested(UnknownArchitecture):
    """The job asks for a profile of a family the analytic model knows (PROFILE_ANNOTATION)."""

    def __init__(self, model_type: str):
        super().__init__(model_type, ())
        self.args = (f"model_type: the job asks for a measured profile ({PROFILE_ANNOTATION}: \"true\")",)


def asks_for_profile(job: api.FineTuneJob) -> bool:
    return (job.metadata.annotations or {}).get(PROFILE_ANNOTATION, "").lower() == "true"
# How often to look at a profile pod that runs (it wakes no watch of ours).
PROFILE_POLL_SECONDS = 5.0


@dataclass(frozen=True)
class ProfilePod:
    """The job's profile pod as the shell read it (labelled with the job's uid; others are never read)."""

    name: str
    phase: str  # Pending | Running | Succeeded | Failed
    config_hash: str
    report: ProfileReport | None  # parsed from the termination message, when it ended
    message: str = ""  # the kubelet's reason/message for a pod that ended without a report
    unschedulable: str = ""  # the scheduler's message while no node fits the pending pod
    placement: str = ""  # its PLACEMENT_ANNOTATION: where the policy of its time let it run


@dataclass(frozen=True)
class ProfileObservation:
    config: Mapping[str, Any]
    config_hash: str
    profile: JobProfile
    cached: CachedProfile
    pod: ProfilePod | None = None
    pod_namespace: str = ""  # where the shell runs profile pods: the operator's namespace


@dataclass(frozen=True)
class Profiled:
    """Everything needed is measured: plan with `architecture`; delete the finished pod."""

    architecture: ProfiledArchitecture
    delete: list[str]
    message: str
    pod_namespace: str = ""  # where the pods in `delete` are


@dataclass
class ProfileStep:
    """Not plannable yet (or never): what to do about the profile."""

    condition: tuple[str, str, str]  # (status, reason, message) of the Profiled condition
    create: list[dict[str, Any]] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)  # pod names
    failure: api.FieldProblem | None = None  # terminal: the model cannot be profiled
    event: tuple[str, str, str] | None = None
    pod_namespace: str = ""  # where the pods in `delete` are


def model_config_of(spec: api.FineTuneJobSpec, model_config: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The job's config.json as a dict (every key of an inline one, the ConfigMap's, or a preset's)."""
    return config_json_of(spec, model_config)


def needs_profile(spec: api.FineTuneJobSpec, model_config: Mapping[str, Any] | None, *, asked: bool = False
                  ) -> Mapping[str, Any] | None:
    """The config to profile when the analytic model does not know the job's family (or the job asks
    for a profile), else None."""
    try:
        arch = architecture_of(spec, model_config)
    except UnknownArchitecture:
        return model_config_of(spec, model_config)
    except Exception:  # noqa: BLE001 - any other problem is the lifecycle's to report
        return None
    if asked:
        return model_config_of(spec, model_config) or arch.to_hf_config()
    return None


def observation(spec: api.FineTuneJobSpec, config: Mapping[str, Any], cached_reader, trainer_image: str
                ) -> ProfileObservation | NotProfilable:
    """Build the pure half of an observation; `cached_reader(config_hash, setups)` is the shell's read.
    `trainer_image` is the policy's: the image profile pods run, part of the cache key."""
    try:
        profile = job_profile(spec)
    except NotProfilable as error:
        return error
    digest = config_hash(config, trainer_image)
    return ProfileObservation(config, digest, profile, cached_reader(digest, profile.setups()))


def resolve(job: api.FineTuneJob, seen: ProfileObservation | NotProfilable | None, unknown: UnknownArchitecture,
            policy: ClusterPolicy) -> Profiled | ProfileStep:
    name = profile_pod_name(job.metadata.namespace or "default", job.metadata.name)
    family = unknown.model_type
    if isinstance(seen, NotProfilable):
        message = (f"model_type {family!r} is not in the analytic memory model and this job cannot be profiled: "
                   f"{str(seen).split(': ', 1)[-1]}")
        return ProfileStep(("False", "NotProfilable", message), failure=api.FieldProblem(path=seen.field,
                                                                                          message=message))
    if seen is None:
        # The shell could not tell what to profile (no config): report the unknown family as before.
        return ProfileStep(("False", "NotProfiled", str(unknown)), failure=api.FieldProblem(
            path="spec.model.architecture", message=str(unknown).split(": ", 1)[-1]))
    pod = seen.pod
    # Stale: traced for another config, or pending under a placement the policy has changed since
    # (profilePod tolerations added for a tainted cluster: the new pod can land, the old never will).
    stale = [pod.name] if pod is not None and (
        pod.config_hash != seen.config_hash
        or (pod.phase == "Pending" and pod.placement != placement_hash(job, policy))) else []
    if stale:
        pod = None
    report = as_report(seen.cached)
    if report is not None and not seen.cached.missing:
        arch = profiled_architecture(report, seen.profile, seen.cached.measurements, seen.config_hash,
                                     name=job.spec.model.name)
        done = [pod.name] if pod is not None and pod.phase in ("Succeeded", "Failed") else []
        return Profiled(arch, stale + done, profiled_message(arch), seen.pod_namespace)
    if pod is not None and pod.phase in ("Succeeded", "Failed"):
        if pod.report is not None and not pod.report.ok:
            where = pod.report.error_field
            path = where if where.startswith("spec.") else (
                f"spec.model.architecture ({where})" if where else "spec.model.architecture")
            message = f"the pre-flight profile of model_type {family!r} failed: {pod.report.error}"
            return ProfileStep(("False", "ProfileFailed", message), failure=api.FieldProblem(path=path, message=message))
        refused = refused_measurements(pod.report, seen.profile.setups()) if pod.report is not None else {}
        if refused:
            # The trainer image measured something impossible: profiling again would measure it again.
            message = (f"the pre-flight profile of model_type {family!r} reported figures that cannot be true "
                       f"(not cached): {'; '.join(sorted(refused.values()))}")
            return ProfileStep(("False", "ProfileFailed", message), failure=api.FieldProblem(
                path="spec.model.architecture", message=message))
        if pod.phase == "Failed":
            why = pod.message or "the pod failed without a report"
            message = f"the pre-flight profile pod {pod.name} of model_type {family!r} failed: {why}"
            return ProfileStep(("False", "ProfileFailed", message), failure=api.FieldProblem(
                path="spec.model.architecture", message=message))
        # Succeeded, yet setups are missing (a pod traces at most MAX_SETUPS_PER_POD; or a cache write was
        # lost): the next pod traces the rest.
        done = len(seen.cached.measurements)
        return ProfileStep(("Unknown", "Profiling", f"profiled {done} of {done + len(seen.cached.missing)} setups; "
                            "the next profile pod traces the rest"), delete=stale + [pod.name],
                           pod_namespace=seen.pod_namespace)
    if pod is not None and pod.unschedulable:
        # It waits (a node may come: a CPU pool scaling up), saying why and where the platform decides.
        message = (f"the profile pod {pod.name} of model_type {family!r} cannot be scheduled: {pod.unschedulable} "
                   "(it runs in the job's regions with the cluster policy's profilePod tolerations and nodeSelector)")
        return ProfileStep(("Unknown", "ProfilePodUnschedulable", message), delete=stale,
                           pod_namespace=seen.pod_namespace)
    if pod is not None:
        message = (f"profiling model_type {family!r} on the CPU ({len(seen.cached.missing)} setups) in pod {pod.name} "
                   "before any GPU is requested")
        return ProfileStep(("Unknown", "Profiling", message), delete=stale, pod_namespace=seen.pod_namespace)
    request = profile_request(job.spec, seen.config, seen.cached.missing)
    manifest = render_profile_pod(job, request, seen.config_hash, policy, seen.pod_namespace)
    why = ("the job asks for a measured profile" if isinstance(unknown, ProfileRequested)
           else f"model_type {family!r} is not in the analytic memory model")
    message = (f"{why}: profiling it on the CPU ({len(request.setups)} setups) in pod {name} "
               "before any GPU is requested")
    return ProfileStep(("Unknown", "Profiling", message), create=[manifest], delete=stale,
                       event=("Normal", "Profiling", message), pod_namespace=seen.pod_namespace)


def profiled_message(arch: ProfiledArchitecture) -> str:
    model = arch.profiled
    assert model is not None
    return (f"planned from the pre-flight profile of model_type {arch.family!r} (config {arch.config_hash}, "
            f"{len(model.measurements)} measured setups, {arch.total_params / 1e9:.3g}B parameters)")
