"""The trainer end to end with the lean levers on (issue 13), as pods run it: the loss
goes down, a resume continues the curve, and FSDP over two gloo ranks runs the step in
backward. In-process checks of each lever are in test_trainer_levers.py."""

from __future__ import annotations

import pytest

from .conftest import run_trainer, trainer_config, write_config

pytestmark = pytest.mark.slow

LEVERS = {
    "masterWeights": "bf16", "updateRounding": "kahan", "optimizerInBackward": True, "maxGradNorm": 0,
    "gradientAccumulation": 1, "microBatchSize": 8, "lossChunks": 4, "gradientCheckpointing": True,
    "activationOffloading": True,
}


@pytest.fixture(scope="module")
def lean_run(assets, tmp_path_factory):
    """Every single-process lever at once, 6 steps, a checkpoint at step 4."""
    work = tmp_path_factory.mktemp("lean")
    config = trainer_config(assets, work, maxSteps=6, **LEVERS)
    run = run_trainer(write_config(work, config))
    assert run.returncode == 0, run.output[-3000:]
    return work, config, run


def test_all_levers_on_one_process_learn_and_say_so(lean_run):
    work, _, run = lean_run
    [line] = run.of("levers")
    assert {k: line[k] for k in ("masterWeights", "updateRounding", "optimizerInBackward", "lossChunks",
                                 "activationOffloading")} == {"masterWeights": "bf16", "updateRounding": "kahan",
                                                              "optimizerInBackward": True, "lossChunks": 4,
                                                              "activationOffloading": True}
    # Each step, both checkpointed layers' inputs went to host memory and back.
    [offload] = run.of("activation-offload")
    assert offload["tensorsPerStep"] == 2 and offload["peakHostBytes"] > 0
    losses = run.losses()
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert losses[6] < losses[1] - 0.8, losses
    # bf16 weights throughout: the output holds bf16 tensors.
    from safetensors import safe_open

    with safe_open(work / "out" / "model.safetensors", "pt") as out:
        assert {out.get_slice(k).get_dtype() for k in out.keys()} == {"BF16"}


def test_resume_carries_kahan_buffers_and_per_parameter_optimizer_state(lean_run):
    import torch.distributed.checkpoint as dcp

    work, config, first = lean_run
    metadata = dcp.FileSystemReader(str(work / "ckpt" / "step-00000004" / "dcp")).read_metadata()
    kahan = [key for key in metadata.state_dict_metadata if key.endswith(".kahan_comp")]
    assert len(kahan) == 2 + 2 * 9 + 1  # embeddings, head, final norm, 9 tensors per layer
    second = run_trainer(write_config(work, dict(config, maxSteps=8, attempt=2)))
    assert second.returncode == 0, second.output[-3000:]
    [event] = second.of("resume")
    assert (event["step"], event["optimizerRestored"], event["fromMasterWeights"]) == (4, True, "bf16")
    # Same weights, moments, Kahan buffers and data: the curve continues exactly.
    for step in (5, 6):
        assert second.losses()[step] == pytest.approx(first.losses()[step], abs=1e-4), (second.losses(), first.losses())


def test_fsdp_two_ranks_step_in_backward_with_bf16_stochastic_rounding(assets, tmp_path, lean_run):
    """FSDP2 calls the sharded parameters' post-accumulate-grad hooks after the
    reduce-scatter: each rank steps its shard. Without the steps the loss would not move."""
    _, _, single = lean_run
    config = trainer_config(assets, tmp_path, strategy="fsdp", maxSteps=6, checkpoint=None,
                            **dict(LEVERS, microBatchSize=4, updateRounding="stochastic", lossChunks=3,
                                   gradientCheckpointing=False, activationOffloading=False))
    run = run_trainer(write_config(tmp_path, config), nproc=2)
    assert run.returncode == 0, run.output[-3000:]
    losses = run.losses()
    assert losses[6] < losses[1] - 0.8, losses
    # The same global batch of 8 and LR schedule as the single-process run; bf16 rounding
    # (stochastic here, Kahan there) and another reduction order: measured 4e-3 apart.
    for step in range(1, 7):
        assert losses[step] == pytest.approx(single.losses()[step], abs=0.02), (losses, single.losses())


def test_lora_on_fused_experts_of_a_tiny_mixtral_with_dropout(assets, tmp_path):
    """lora.targetExperts end to end: peft target_parameters on the 3-D expert weights,
    dropout 0.1 kept on the Linear adapters (peft alone refuses it), adapters saved."""
    import json

    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from .trainer_assets import build_tokenizer

    model_dir = tmp_path / "tiny-mixtral"
    tokenizer = build_tokenizer(model_dir)
    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     num_local_experts=4, num_experts_per_tok=2, pad_token_id=0, bos_token_id=2,
                                     eos_token_id=3, max_position_embeddings=256)).save_pretrained(model_dir)
    config = trainer_config(assets, tmp_path, model={"path": str(model_dir)}, method="lora", learningRate=1e-2,
                            maxSteps=5, checkpoint=None,
                            lora={"rank": 8, "alpha": 16, "dropout": 0.1, "targetExperts": True})
    run = run_trainer(write_config(tmp_path, config))
    assert run.returncode == 0, run.output[-3000:]
    assert run.of("levers")[0]["loraTargetExperts"] is True
    assert any("expert adapters" in e["message"] and "without dropout" in e["message"] for e in run.of("info"))
    losses = run.losses()
    assert losses[5] < losses[1] - 0.4, losses
    adapter = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert {"experts.gate_up_proj", "experts.down_proj"} <= set(adapter["target_parameters"])
