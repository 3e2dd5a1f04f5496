"""The registry of memory levers (finetune_trainer/memory_levers): each lever is one object, and
what the planner, sizing, recovery and the trainer config read of levers comes from it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from finetune_operator import api
from finetune_operator.planning.search.estimate import Estimates
from finetune_operator.sizing.presets import preset
from finetune_operator.sizing import ModelArchitecture, TrainingSetup, estimate_memory
from finetune_operator.sizing.memory import lever_savings
from finetune_trainer import combinations
from finetune_trainer.memory_levers import (
    BY_NAME,
    LEVERS,
    NO_LEVERS,
    Levers,
    config_fields,
    in_use,
    ladder,
    lever_ask,
    lever_options,
    levers_of,
    savings,
)

L8 = preset("llama-3.1-8b")


def test_levers_fields_are_the_registry_fields_off_by_default():
    assert Levers._fields == tuple(f for lever in LEVERS for f in lever.off)
    assert NO_LEVERS.setup_fields() == {f: v for lever in LEVERS for f, v in lever.off.items()}
    # The schemas' defaults are the off values: TrainingSetup, the plan status, the trainer config.
    setup = TrainingSetup(architecture=L8)
    assert levers_of(setup) == NO_LEVERS and in_use(setup) == ()


def test_every_lever_rule_is_in_the_one_table():
    names = [r.name for r in combinations.RULES]
    for lever in LEVERS:
        assert lever.rules, lever.name
        for rule in lever.rules:
            assert names.count(rule.name) == 1
    assert "activation-offload-checkpointing" in names


def test_the_api_spells_each_choice_field_of_a_lever():
    assert config_fields() == {"master_weights": "masterWeights", "update_rounding": "updateRounding",
                               "optimizer_in_backward": "optimizerInBackward", "chunked_loss": "lossChunks",
                               "sequence_split": "sequenceParallel",
                               "activation_offloading": "activationOffloading", "liger_kernel": "ligerKernel"}
    for choice, field in config_fields().items():
        assert api.CHOICE_PATHS[choice] == f"training.{field}"


def test_a_lever_whose_rung_follows_no_rung_is_refused():
    assert ladder(("gradientCheckpointing", "sharding", "offload", "moreGPUs"))[:2] == (
        "gradientCheckpointing", "chunkedLoss")
    with pytest.raises(AssertionError, match="activation_offloading"):
        ladder(("gradientCheckpointing", "offload", "moreGPUs"))


def test_one_savings_algorithm_for_a_setup_and_for_the_planner_cache():
    setup = TrainingSetup(architecture=L8, method="full", master_weights="bf16", update_rounding="stochastic",
                          optimizer_in_backward=True, loss_chunks=8, gradient_checkpointing=True,
                          activation_offloading=True, micro_batch_size=2, sequence_length=2048)
    direct = lever_savings(setup)
    # Every lever but Liger's, which replaces the chunked loss (its saving: test_liger_kernel.py), and
    # sequence parallelism, which needs DeepSpeed (its terms: test_sequence_parallel.py).
    assert set(direct) == set(in_use(setup)) == set(BY_NAME) - {"liger_kernel", "sequence_parallel"}

    class _Ask:  # the fields of a job Estimates.setup reads
        arch, method, lora_rank, lora_targets, precision, optimizer = L8, "full", 16, "all-linear", "bf16", "adamw"
        sequence_length, attention, global_batch_size, target_experts, packing, lora_dropout = 2048, "sdpa", 2, False, False, 0.0
        lora_modules_to_save, padding_free, micro_batch_tokens = (), False, ()

    estimates = Estimates(_Ask(), estimate_memory)
    cached = estimates.savings(1, "ddp", "none", True, 2, levers_of(setup))
    assert cached == direct
    # Each saving is the required bytes with that lever alone turned off, less the setup's own.
    own = estimate_memory(setup).required_bytes
    without = estimate_memory(replace(setup, activation_offloading=False)).required_bytes
    assert direct["activation_offloading"] == max(0, without - own)
    assert savings(levers_of(setup), own, lambda other: None) == dict.fromkeys(direct, 0)


def test_planner_freedom_of_an_unset_lever_and_of_a_set_one():
    class _Training:
        master_weights, update_rounding, precision, optimizer = "auto", "auto", "bf16", "adamw"
        optimizer_in_backward, loss_chunks, activation_offloading, liger_kernel = None, "auto", True, None
        sequence_parallel = 1

    ask = lever_ask(_Training(), "full", False)
    assert ask.fixed == frozenset({"activation_offloading", "sequence_parallel"})
    base = combinations.Choices(method="full", strategy="ddp", offload="none", optimizer="adamw", precision="bf16",
                                gradient_checkpointing=True, gradient_accumulation=4, gradient_clipping=True)
    options = lever_options(ask, base, accumulation_one=False, allows=combinations.allows)
    # bf16 master weights with their auto rounding, no step in backward (accumulation 4), 8 chunks, offloading.
    assert options == (Levers("fp32", "nearest", False, 8, True, False, 1), Levers("bf16", "stochastic", False, 8, True, False, 1))
    assert lever_options(ask, base.but(gradient_checkpointing=False), accumulation_one=False,
                         allows=combinations.allows) == ()  # offloading needs checkpointing


def test_the_plan_status_holds_exactly_the_registrys_lever_fields_in_order():
    from finetune_operator.api import PlanStatus
    from finetune_trainer.memory_levers import Levers

    held = tuple(name for name in PlanStatus.model_fields if name in Levers._fields)
    assert held == Levers._fields
    for lever in LEVERS:
        for name, field in lever.schema.items():
            assert PlanStatus.model_fields[name].default == lever.off[name]
            assert PlanStatus.model_fields[name].description == field.doc


def test_a_new_lever_reaches_the_plan_status_through_the_registry():
    from pydantic import BaseModel
    from finetune_trainer.memory_levers import LeverField, lever_fields_model

    fake = replace(LEVERS[-1], name="fake_lever", off={"fake_lever": False}, auto={"fake_lever": "auto"},
                   schema={"fake_lever": LeverField(bool, "A lever only this test has.")})

    class Head(BaseModel):
        node_pool: str

    model = lever_fields_model(Head, (*LEVERS, fake))
    assert list(model.model_fields)[-1] == "fake_lever" and list(model.model_fields)[0] == "node_pool"
    assert model(node_pool="p").fake_lever is False
    assert model.model_fields["fake_lever"].description == "A lever only this test has."


def test_the_training_spec_holds_exactly_the_registrys_spec_fields_in_order():
    from inspect import cleandoc

    from finetune_operator.api import TrainingSpec
    from finetune_trainer.memory_levers import camel

    names = list(TrainingSpec.model_fields)
    held = tuple(name for name in names if name in Levers._fields)
    assert held == Levers._fields
    # Together, after gradientCheckpointing: the CRD's field order of the hand-written TrainingSpec.
    start = names.index("gradient_checkpointing") + 1
    assert tuple(names[start:start + len(held)]) == held
    for lever in LEVERS:
        for name, field in lever.spec.items():
            info = TrainingSpec.model_fields[name]
            assert info.default == lever.auto[name]
            assert info.description == cleandoc(field.doc)
            assert info.alias == camel(name)


def test_a_new_lever_with_a_spec_field_reaches_the_training_spec_and_its_crd_schema():
    from pydantic import ValidationError

    from finetune_operator.api.training import _TrainingSpecHead, lever_spec_type
    from finetune_operator.crd import _Converter
    from finetune_trainer.memory_levers import AutoOrInt, LeverField, lever_spec_model

    fake = replace(LEVERS[-1], name="fake_chunks", off={"fake_chunks": 1}, auto={"fake_chunks": "auto"},
                   schema={"fake_chunks": LeverField(int, "Fake chunks.")},
                   spec={"fake_chunks": LeverField(AutoOrInt(1, 4, "number of fake chunks"), """
                       A lever only this test has,
                       over two lines.""")})
    model = lever_spec_model(_TrainingSpecHead, (*LEVERS, fake), lever_spec_type)
    assert list(model.model_fields) == [*_TrainingSpecHead.model_fields, *Levers._fields, "fake_chunks"]
    assert model().fake_chunks == "auto" and model(fakeChunks=3).fake_chunks == 3
    with pytest.raises(ValidationError):
        model(fakeChunks=5)
    raw = model.model_json_schema(by_alias=True, mode="validation")
    node = _Converter(raw.get("$defs", {})).convert(raw)["properties"]["fakeChunks"]
    assert node["description"] == ("A lever only this test has,\nover two lines.\n"
                                   "Accepts `auto` or an integer from 1 to 4.")
    assert node["default"] == "auto" and node["x-kubernetes-int-or-string"] is True
    (rule,) = node["x-kubernetes-validations"]
    assert rule["message"] == "must be 'auto' or an integer number of fake chunks between 1 and 4"


def test_every_schema_takes_its_lever_fields_from_the_registry():
    """TrainingSetup, combinations.Choices, the Plan and the trainer config hold exactly the registry's
    lever fields (the Plan and the config in `LEVERS` order, as declared), with their off values."""
    from dataclasses import fields

    from finetune_operator.planning.plan import Plan, PlanKey
    from finetune_trainer.contract import TrainerConfig
    from finetune_trainer.memory_levers.fields import lever_choice_names

    setup_fields = {f.name: f.default for f in fields(TrainingSetup)}
    assert {name: setup_fields[name] for name in Levers._fields} == NO_LEVERS.setup_fields()
    choice_names = lever_choice_names(LEVERS)
    assert tuple(f.name for f in fields(combinations.Choices))[-len(choice_names):] == choice_names
    for model in (Plan, TrainerConfig):
        names = list(model.model_fields)
        start = names.index("master_weights")
        assert tuple(names[start:start + len(Levers._fields)]) == Levers._fields
        assert all(model.model_fields[name].default == off for name, off in NO_LEVERS.setup_fields().items())
    assert PlanKey._fields[-1] == "levers" and PlanKey._field_defaults["levers"] == NO_LEVERS


def test_a_setup_refuses_a_lever_value_its_lever_does_not_declare_naming_the_field():
    from finetune_operator.sizing import SizingError

    for field, value, says in (("loss_chunks", 0, "greater than or equal to 1"), ("master_weights", "fp16", "'fp32' or 'bf16'"),
                               ("activation_offloading", 1, "valid boolean"), ("liger_kernel", "yes", "valid boolean")):
        with pytest.raises(SizingError) as error:
            TrainingSetup(architecture=L8, **{field: value})
        assert error.value.field == field and says in str(error.value), error.value
