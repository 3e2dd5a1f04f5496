"""combinations.py is the one home of what combines with what: a setup it accepts is accepted
by the memory model's TrainingSetup, the trainer's contract, the API's validators and the
CRD's CEL rules generated from it, and a setup it refuses is refused by each of them, naming
the field the rule blames."""

from __future__ import annotations

import functools
import re
from typing import Any, get_args

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from finetune_operator import api
from finetune_operator.sizing.presets import preset
from finetune_operator.sizing import ModelArchitecture, SizingError, TrainingSetup
from finetune_trainer import combinations as C
from finetune_trainer.contract import TrainerConfig, deepspeed_config
from finetune_trainer.memory_levers import BY_NAME, derived_choices

DENSE = preset("llama-3.2-1b").with_layers(2)
MOE = preset("mixtral-8x7b").with_layers(2)
SOFTCAPPED = preset("gemma-2-9b").with_layers(2)  # final logit soft-capping
GLOBAL_BATCH = 8

choices = st.builds(
    C.Choices,
    method=st.sampled_from(C.METHODS),
    strategy=st.sampled_from(C.STRATEGIES),
    offload=st.sampled_from(C.OFFLOADS),
    optimizer=st.sampled_from(C.OPTIMIZERS),
    precision=st.sampled_from(C.PRECISIONS),
    master_weights=st.sampled_from(get_args(BY_NAME["master_weights"].schema["master_weights"].type)),
    update_rounding=st.sampled_from(get_args(BY_NAME["master_weights"].schema["update_rounding"].type)),
    optimizer_in_backward=st.booleans(),
    gradient_accumulation=st.sampled_from((1, 2)),
    gradient_clipping=st.booleans(),
    gradient_checkpointing=st.booleans(),
    activation_offloading=st.booleans(),
    liger_kernel=st.booleans(),
    target_experts=st.booleans(),
    modules_to_save=st.booleans(),
    moe=st.booleans(),
    chunked_loss=st.booleans(),
    logit_transform=st.booleans(),
).map(lambda c: c.but(logit_transform=False) if c.moe else c)  # no soft-capped MoE model here


def _setup(c: C.Choices) -> TrainingSetup:
    return TrainingSetup(
        architecture=MOE if c.moe else SOFTCAPPED if c.logit_transform else DENSE, method=c.method, strategy=c.strategy, world_size=2, offload=c.offload,
        optimizer=c.optimizer, precision=c.precision, master_weights=c.master_weights,
        update_rounding=c.update_rounding, optimizer_in_backward=c.optimizer_in_backward,
        gradient_accumulation=c.gradient_accumulation, gradient_checkpointing=c.gradient_checkpointing,
        activation_offloading=c.activation_offloading, lora_target_experts=bool(c.target_experts),
        lora_dropout=0.0, loss_chunks=8 if c.chunked_loss else 1, liger_kernel=c.liger_kernel,
        lora_modules_to_save=_saved(c),
    )


def _saved(c: C.Choices) -> tuple[str, ...]:
    """lora.modulesToSave as the choice says (only adapters have it)."""
    return ("embed_tokens", "lm_head") if c.modules_to_save and c.method != "full" else ()


def _contract(c: C.Choices) -> TrainerConfig:
    stage = {"zero1": 1, "zero2": 2, "zero3": 3}.get(c.strategy)
    ds = None
    if stage:
        # The config the renderer would write; an offload it cannot write is a mismatch the contract refuses.
        ds = deepspeed_config(stage, c.offload if (c.offload != "optimizer+params" or stage == 3) else "optimizer")
    return TrainerConfig.model_validate({
        "jobName": "j", "model": {"path": "/m"}, "dataset": {"path": "/d"}, "outputDirectory": "/o", "maxSteps": 1,
        "method": c.method, "strategy": c.strategy, "offload": c.offload, "deepspeed": ds,
        "optimizer": c.optimizer, "precision": c.precision, "masterWeights": c.master_weights,
        "updateRounding": c.update_rounding, "optimizerInBackward": c.optimizer_in_backward,
        "gradientAccumulation": c.gradient_accumulation, "maxGradNorm": 1.0 if c.gradient_clipping else 0.0,
        "gradientCheckpointing": c.gradient_checkpointing, "activationOffloading": c.activation_offloading,
        "lora": {"targetExperts": bool(c.target_experts), "modulesToSave": list(_saved(c))},
        "lossChunks": 8 if c.chunked_loss else 1, "ligerKernel": c.liger_kernel,
    })


def _spec_document(c: C.Choices) -> dict[str, Any]:
    micro = GLOBAL_BATCH // (2 * c.gradient_accumulation)
    spec: dict[str, Any] = {
        "model": {"name": "m", "architecture": {"preset": "llama-3.2-1b"}, "source": {"pvc": {"claimName": "models"}}},
        "dataset": {"source": {"pvc": {"claimName": "data", "path": "t.jsonl"}}},
        "method": c.method,
        "training": {
            "maxSteps": 10, "globalBatchSize": GLOBAL_BATCH, "microBatchSize": micro, "precision": c.precision,
            "optimizer": c.optimizer, "masterWeights": c.master_weights, "updateRounding": c.update_rounding,
            "optimizerInBackward": c.optimizer_in_backward, "gradientCheckpointing": c.gradient_checkpointing,
            "activationOffloading": c.activation_offloading, "lossChunks": 8 if c.chunked_loss else 1,
            "ligerKernel": c.liger_kernel,
        },
        "resources": {"gpus": 2, "strategy": c.strategy, "offload": c.offload},
        "placement": {"regions": ["eu"]},
    }
    if c.method != "full":
        spec["lora"] = {"rank": 8, "targetExperts": bool(c.target_experts), "modulesToSave": list(_saved(c))}
    return spec


def _accepted(build) -> tuple[bool, str]:
    try:
        build()
    except (SizingError, ValidationError, api.JobValidationError) as error:
        return False, str(error)
    return True, ""


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=choices)
def test_setup_and_contract_agree_with_the_table(c: C.Choices):
    # TrainingSetup knows the model (MoE or not) but not gradient clipping (the renderer's).
    for_setup = c.but(gradient_clipping=None, target_experts=c.target_experts if c.method != "full" else None,
                  modules_to_save=c.modules_to_save if c.method != "full" else None)
    ok, why = _accepted(lambda: _setup(c))
    assert ok == C.allows(for_setup), (for_setup, why)
    if not ok:
        first = C.first_violation(for_setup)
        with pytest.raises(SizingError) as error:
            _setup(c)
        assert error.value.field == first.field
    # The contract knows clipping but not the model's experts.
    for_contract = c.but(moe=None, logit_transform=None, target_experts=c.target_experts if c.method != "full" else None,
                  modules_to_save=c.modules_to_save if c.method != "full" else None)
    ok, why = _accepted(lambda: _contract(c))
    assert ok == C.allows(for_contract), (for_contract, why)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=choices)
def test_api_and_its_cel_rules_agree_with_the_table(c: C.Choices):
    # The API knows neither the model (a preset name only) nor clipping; lora settings exist for adapters only.
    for_api = c.but(moe=None, logit_transform=None, gradient_clipping=None, target_experts=c.target_experts if c.method != "full" else None,
                  modules_to_save=c.modules_to_save if c.method != "full" else None)
    document = _spec_document(c)
    ok, why = _accepted(lambda: api.parse_spec(document))
    assert ok == C.allows(for_api), (for_api, why)
    if not ok:
        first = C.first_violation(for_api)
        assert f"spec.{api.CHOICE_PATHS[first.field]}" in why, (first, why)
    # The CEL rules see what the API server sees; they cannot derive gradient accumulation, nor a
    # lever's derived choice (chunked_loss: lossChunks > 1; the pydantic validator does): apart from
    # that they reject exactly what the table does.
    assert _cel_accepts(document) == C.allows(
        for_api.but(gradient_accumulation=None, **dict.fromkeys(derived_choices())))


@functools.cache
def _table_cel_rules() -> tuple[str, ...]:
    messages = {rule.message for rule in C.RULES}
    return tuple(r["rule"] for r in api.FineTuneJobSpec.model_json_schema()["x-kubernetes-validations"]
                 if r["message"] in messages)


def _cel_accepts(spec: dict[str, Any]) -> bool:
    rules = _table_cel_rules()
    assert len(rules) >= 12
    return all(_eval_cel(rule, spec) for rule in rules)


def _eval_cel(rule: str, spec: dict[str, Any]) -> bool:
    """Evaluate the small CEL subset cel_rules writes (has, in, &&, !, literals) on a document."""

    def get(path: str) -> Any:
        node: Any = spec
        for key in path.split("."):
            node = node[key]
        return node

    def has(path: str) -> bool:
        try:
            get(path)
        except (KeyError, TypeError):
            return False
        return True

    text = re.sub(r"has\(self\.([\w.]+)\)", r'_has("\1")', rule)
    text = re.sub(r"self\.([\w.]+)", r'_get("\1")', text)
    text = text.replace("size(", "len(").replace("&&", " and ").replace("!(", " not (").replace("true", "True").replace("false", "False")
    return bool(eval(text, {"_has": has, "_get": get}))  # noqa: S307 - our own generated rules


def test_planner_enumeration_follows_the_table():
    assert C.offloads_for("ddp") == ("none",)
    assert C.offloads_for("fsdp") == ("none", "optimizer+params")
    assert C.offloads_for("zero1") == ("none", "optimizer")
    assert C.offloads_for("zero3") == C.OFFLOADS
    assert C.strategies_for("qlora") == ("ddp", "fsdp", "zero3")
    assert C.strategies_for("full", optimizer="paged-adamw-8bit") == ("ddp", "fsdp")
    assert C.strategies_for("full", precision="fp16") == ("ddp", "zero1", "zero2", "zero3")


def test_undecided_fields_break_nothing():
    assert C.allows(C.Choices())
    assert C.allows(C.Choices(method="qlora", precision="bf16"))
    assert not C.allows(C.Choices(method="qlora", precision="fp32"))
