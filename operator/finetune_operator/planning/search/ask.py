"""Stage 0 of the plan search: what the job asks. Its fixed settings, the ranges of its `auto`
ones, and the regions it may run in (the job's, the policy's and its object storage's, intersected),
read from the spec once; the stages after it read only the `Ask`.

A job that cannot be planned whatever the pools (an architecture that cannot be read, LoRA targets
the model lacks, a merged export of adapters on fused expert weights, no allowed region) is an
`Infeasible` here, before anything is enumerated.
"""

from __future__ import annotations

from dataclasses import dataclass

from ... import api
from ...sizing import ModelArchitecture, SizingError
from ...sizing.export import estimate_export
from ...sizing.from_job import architecture_of
from ...sizing.saved_modules import saved_modules
from finetune_trainer.contract import default_export
from finetune_trainer.combinations import OFFLOADS, Choices, strategies_for
from finetune_trainer.memory_levers import LeverAsk, lever_ask

from ..plan import Infeasible
from ..policy import ClusterPolicy
from ..storage import StorageError, storage_regions

# What the master pod's upload sidecar asks for (rendering/pod.py renders it): its requests add to
# the pod's, so a node must have this much host memory beside the ranks'.
UPLOAD_SIDECAR_HOST_BYTES = 512 * 2**20


@dataclass(frozen=True)
class Ask:
    """A job's fixed settings and the ranges of its `auto` ones."""

    arch: ModelArchitecture
    method: str
    lora_rank: int
    lora_targets: str | tuple[str, ...]
    precision: str
    optimizer: str
    attention: str
    sequence_length: int
    global_batch_size: int
    steps: int | None
    gpus: int | None  # fixed total, or None (auto)
    max_gpus: int
    strategies: tuple[str, ...]
    offloads: tuple[str, ...]
    checkpointing: tuple[bool, ...]
    micro_batch_size: int | None  # fixed, or None (auto)
    headroom: float
    node_pool: str | None
    gpu_types: tuple[str, ...]
    regions: tuple[str, ...]
    fixed_strategy: bool
    fixed_offload: bool
    fixed_checkpointing: bool
    levers: LeverAsk = LeverAsk()  # the lean-trainer levers the job fixes or leaves to the planner
    target_experts: bool = False
    packing: bool = False  # spec.dataset.packing (examples packed with their boundaries)
    padding_free: bool = False  # spec.dataset.paddingFree
    micro_batch_tokens: tuple[int, ...] = ()  # spec.dataset.microBatchTokens
    lora_dropout: float = 0.0  # spec.lora.dropout (> 0 saves a dropout mask per adapted input)
    lora_modules_to_save: tuple[str, ...] = ()  # spec.lora.modulesToSave (trained in full beside the adapters)
    # Host memory the export after training needs (sizing/export.py; 0 for an adapter): rank 0 merges
    # on the CPU once the other ranks have exited, so one pod's memory must hold it.
    export_host_bytes: int = 0
    # Host memory one pod asks for beside its training container (the master's upload sidecar, for an
    # output in object storage): the pod is scheduled on its requests, so a node must hold both.
    pod_extra_host_bytes: int = 0
    # spec.evaluation.microBatchSize: evaluation's own micro-batch, which must fit beside what the
    # setup keeps resident (estimate.Estimates.eval_required); None: the plan's micro-batch.
    eval_micro_batch: int | None = None
    evaluates: bool = False  # spec.evaluation is set

    def base_choices(self, strategy: str, offload: str, checkpointing: bool) -> Choices:
        """A group's choices before its levers, for combinations.py."""
        return Choices(method=self.method, strategy=strategy, offload=offload, optimizer=self.optimizer,
                       precision=self.precision, gradient_checkpointing=checkpointing,
                       target_experts=self.target_experts if self.method != "full" else None,
                       modules_to_save=bool(self.lora_modules_to_save) if self.method != "full" else None,
                       moe=self.arch.is_moe, logit_transform=bool(self.arch.final_logit_softcapping))


def ask_from_spec(spec: api.FineTuneJobSpec, policy: ClusterPolicy, architecture: ModelArchitecture | None) -> Ask | Infeasible:
    """The job's Ask, or an Infeasible saying which field no pool can change."""
    try:
        arch = architecture or architecture_of(spec)
    except SizingError as error:
        return Infeasible(message=f"spec.model.architecture: {error}")
    lora_rank, lora_targets, lora_dropout, saved = 16, "all-linear", 0.0, ()
    if spec.lora is not None:
        lora_rank, lora_dropout = spec.lora.rank, spec.lora.dropout
        targets = spec.lora.target_modules
        lora_targets = "all-linear" if targets == ["all-linear"] else tuple(targets)
        saved = tuple(spec.lora.modules_to_save)
        if spec.method != "full":
            try:
                arch.resolve_lora_targets(lora_targets)
                saved_modules(arch, saved, lora_targets)
            except SizingError as error:
                field = "modulesToSave" if error.field == "lora_modules_to_save" else "targetModules"
                return Infeasible(message=f"spec.lora.{field}: {error.message}")
    t, r = spec.training, spec.resources
    regions = tuple(reg for reg in spec.placement.regions if reg in set(policy.allowed_regions))
    try:
        # Object storage narrows further: data is trained on only where its endpoint may be read.
        reachable = storage_regions(spec, policy)
    except StorageError:
        reachable = None  # an endpoint the policy refuses: the job is Invalid (layout_of, render_attempt say so)
    if reachable is not None:
        regions = tuple(reg for reg in regions if reg in reachable)
    headroom = r.memory_headroom if r.memory_headroom is not None else policy.default_memory_headroom
    export = spec.export or default_export(spec.method)
    target_experts = bool(spec.lora is not None and spec.lora.target_experts)
    if export == "merged" and arch.is_moe and (lora_targets == "all-linear" or target_experts):
        # peft puts all-linear adapters on the fused expert weights too (model_setup.apply_lora), and the
        # trainer's merge refuses those: say so now, not after the training.
        return Infeasible(message="spec.export: merged does not merge adapters on a mixture-of-experts model's fused "
                                  "expert weights, which lora.targetModules all-linear (and lora.targetExperts) adapt; "
                                  "use export adapter, or name the attention modules in lora.targetModules")
    exported = estimate_export(arch, export=export, method=spec.method, precision=t.precision,
                               lora_targets=lora_targets, modules_to_save=saved, stored_bytes=_stored_bytes(arch),
                               trained_bytes=2 if t.master_weights == "bf16" else 4)
    ask = Ask(
        arch=arch,
        method=spec.method,
        lora_rank=lora_rank,
        lora_targets=lora_targets,
        precision=t.precision,
        optimizer=t.optimizer,
        attention=t.attention,
        packing=spec.dataset.packing,
        padding_free=spec.dataset.padding_free,
        micro_batch_tokens=tuple(spec.dataset.micro_batch_tokens or ()),
        lora_dropout=lora_dropout if spec.method != "full" else 0.0,
        lora_modules_to_save=saved if spec.method != "full" else (),
        sequence_length=t.sequence_length,
        global_batch_size=t.global_batch_size,
        steps=t.max_steps,
        gpus=r.gpus if isinstance(r.gpus, int) else None,
        max_gpus=r.gpus if isinstance(r.gpus, int) else r.max_gpus,
        strategies=strategies_for(spec.method, t.precision, t.optimizer) if r.strategy == "auto" else (r.strategy,),
        offloads=OFFLOADS if r.offload == "auto" else (r.offload,),
        checkpointing=(False, True) if t.gradient_checkpointing is None else (t.gradient_checkpointing,),
        micro_batch_size=t.micro_batch_size if isinstance(t.micro_batch_size, int) else None,
        headroom=headroom,
        node_pool=None if r.node_pool == "auto" else r.node_pool,
        gpu_types=tuple(r.gpu_types),
        regions=regions,
        fixed_strategy=r.strategy != "auto",
        fixed_offload=r.offload != "auto",
        fixed_checkpointing=t.gradient_checkpointing is not None,
        levers=lever_ask(t, spec.method, bool(arch.final_logit_softcapping)),
        target_experts=target_experts,
        export_host_bytes=exported.host_bytes if exported is not None else 0,
        pod_extra_host_bytes=UPLOAD_SIDECAR_HOST_BYTES if spec.output is not None and spec.output.s3 is not None else 0,
        eval_micro_batch=spec.evaluation.micro_batch_size if spec.evaluation is not None else None,
        evaluates=spec.evaluation is not None,
    )
    if not ask.regions:
        wanted = ", ".join(spec.placement.regions)
        allowed = ", ".join(policy.allowed_regions) or "none"
        return Infeasible(
            message=f"no region is allowed: spec.placement.regions ({wanted}) and the cluster policy's"
            f" allowed regions ({allowed}) have no region in common",
            allowed_regions=[],
        )
    return ask


def _stored_bytes(arch: ModelArchitecture) -> int:
    """Bytes per element of the base checkpoint on disk, as its config.json says (16-bit unless fp32)."""
    dtype = arch.extra_hf_config.get("torch_dtype") or arch.extra_hf_config.get("dtype")
    return 4 if dtype == "float32" else 2
