"""lora.modulesToSave and LoRA on the output head (issue 28) through the API, the CRD, the planner and
the trainer config: the field is taken, what cannot run is refused naming the field, the planner
enumerates only the strategies that run it. The sizing terms are tested in tests/sizing/test_saved_modules.py."""

from __future__ import annotations

import pytest

from finetune_operator import api
from finetune_operator.planning import Infeasible
from finetune_operator.rendering.trainer_config import _lora

from .test_search import plan, pool, spec


def test_the_api_takes_modules_to_save_and_names_the_field_it_refuses():
    ok = spec(**{"lora": {"rank": 8, "modulesToSave": ["embed_tokens", "lm_head"]}})
    assert ok.lora.modules_to_save == ["embed_tokens", "lm_head"]
    with pytest.raises(api.JobValidationError, match=r"spec.lora.modulesToSave: lm_head: a module is adapted"):
        spec(**{"lora": {"targetModules": ["q_proj", "lm_head"], "modulesToSave": ["lm_head"]}})
    with pytest.raises(api.JobValidationError, match=r"spec.resources.strategy: lora.modulesToSave runs with ddp"):
        spec(**{"lora": {"modulesToSave": ["lm_head"]}, "resources.strategy": "fsdp"})
    with pytest.raises(api.JobValidationError, match="unique"):
        spec(**{"lora": {"modulesToSave": ["lm_head", "lm_head"]}})


def test_the_crd_refuses_both_lists_naming_a_module_and_a_sharded_strategy():
    schema = api.FineTuneJobSpec.model_json_schema()
    rules = [r["rule"] for r in schema["x-kubernetes-validations"]]
    assert any("size(self.lora.modulesToSave) > 0" in r and "'fsdp', 'zero3'" in r for r in rules)
    lora = schema["$defs"]["LoraSpec"]["x-kubernetes-validations"]
    assert any("self.modulesToSave.exists(m, m in self.targetModules)" in r["rule"] for r in lora)


def test_the_planner_avoids_fsdp_and_names_what_it_cannot_size():
    pools = [pool("h100")]
    job = plan(spec(**{"lora": {"modulesToSave": ["embed_tokens", "lm_head"]}, "resources.gpus": 2}), pools)
    assert not isinstance(job, Infeasible) and job.strategy in ("ddp", "zero1", "zero2")
    bad = plan(spec(**{"lora": {"modulesToSave": ["model.norm"]}}), pools)
    assert isinstance(bad, Infeasible) and bad.message.startswith("spec.lora.modulesToSave: 'model.norm' cannot be")
    head_only = plan(spec(**{"lora": {"targetModules": ["lm_head"]}}), pools)
    assert isinstance(head_only, Infeasible) and head_only.message.startswith("spec.lora.targetModules: names no")


def test_the_trainer_config_carries_the_list():
    job = spec(**{"lora": {"rank": 8, "modulesToSave": ["lm_head"]}})
    settings = _lora(job, type("P", (), {"method": "lora"})())
    assert settings.modules_to_save == ["lm_head"]
