"""The families of 2026 on tiny configs (2-3 blocks) traced with fake tensors: the estimate must
match the tracker within the benchmark's tolerance (15% over, 5% under).

One case per family and lever that the family's specific terms touch: q/k norms (Qwen3,
OLMo 2), grouped-matmul experts with and without expert adapters (Qwen3-MoE), sliding
windows under sdpa with a 5:1 pattern (Gemma 3), eager attention with sinks and biased
experts (gpt-oss); LayerNorm, gelu_new, partial rotary and dropout (phi, gpt_neox, issue 28); packed examples
under sdpa (issue 28);
full and LoRA, checkpointing on and off, FSDP. Granite (Llama with multipliers that save
nothing) and the real sizes are in bench/sizing_accuracy.py.
"""

import os
import sys
from dataclasses import replace

import pytest

from finetune_operator.sizing import ModelArchitecture, TrainingSetup, estimate_memory

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, os.path.abspath(BENCH))


def _arch(family, layers=2, **kw):
    base = dict(family=family, vocab_size=8192, hidden_size=256, intermediate_size=768, num_layers=layers,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
    base.update(kw)
    return ModelArchitecture(**base)


QWEN3 = _arch("qwen3", head_dim=32)
QWEN3_MOE = _arch("qwen3_moe", head_dim=32, num_experts=8, experts_per_token=2, moe_intermediate_size=128)
GEMMA3 = _arch("gemma3_text", 2, head_dim=32, tie_word_embeddings=True, sliding_window=128,
               layer_types=("sliding_attention", "full_attention"))
GPT_OSS = _arch("gpt_oss", head_dim=32, num_experts=8, experts_per_token=2, intermediate_size=256,
                attention_bias=True, sliding_window=64, layer_types=("sliding_attention", "full_attention"))
OLMO2 = _arch("olmo2")
# Issue 28: LayerNorm (fp32 under CUDA autocast, as the tracer runs it), gelu_new's fp32 pow,
# partial rotary, phi-2's residual dropout, gpt_neox's fused query_key_value.
PHI = _arch("phi", intermediate_size=1024, num_key_value_heads=8, residual_dropout=0.1)
GPT_NEOX = _arch("gpt_neox", intermediate_size=1024, num_key_value_heads=8, attention_bias=True)
LLAMA = _arch("llama")

CASES = {
    "qwen3-full": TrainingSetup(architecture=QWEN3, method="full", micro_batch_size=2, sequence_length=512),
    "qwen3_moe-full": TrainingSetup(architecture=QWEN3_MOE, method="full", micro_batch_size=2, sequence_length=512),
    "qwen3_moe-lora-experts": TrainingSetup(architecture=QWEN3_MOE, method="lora", lora_dropout=0.0,
                                            micro_batch_size=2, sequence_length=1024),
    "gemma3-lora-sdpa-window": TrainingSetup(architecture=GEMMA3, method="lora", lora_dropout=0.0,
                                             micro_batch_size=1, sequence_length=1024),
    "gemma3-full-fsdp2-gc": TrainingSetup(architecture=GEMMA3, method="full", micro_batch_size=2, sequence_length=512,
                                          gradient_checkpointing=True, strategy="fsdp", world_size=2),
    "gpt_oss-lora": TrainingSetup(architecture=GPT_OSS, method="lora", lora_dropout=0.0, micro_batch_size=2,
                                  sequence_length=512),
    "olmo2-lora-gc": TrainingSetup(architecture=OLMO2, method="lora", lora_dropout=0.0, micro_batch_size=2,
                                   sequence_length=1024, gradient_checkpointing=True),
    "phi-lora": TrainingSetup(architecture=PHI, method="lora", lora_dropout=0.0, micro_batch_size=2, sequence_length=512),
    "phi-full": TrainingSetup(architecture=PHI, method="full", micro_batch_size=2, sequence_length=512),
    "phi-lora-fsdp2": TrainingSetup(architecture=PHI, method="lora", lora_dropout=0.0, micro_batch_size=2,
                                    sequence_length=512, strategy="fsdp", world_size=2),
    "gpt_neox-full-eager": TrainingSetup(architecture=GPT_NEOX, method="full", micro_batch_size=1, sequence_length=512,
                                         attention="eager"),
    # Packed examples (spec.dataset.packing): every block's sdpa gets the block-diagonal mask.
    "llama-lora-packed": TrainingSetup(architecture=LLAMA, method="lora", lora_dropout=0.0, micro_batch_size=2,
                                       sequence_length=1024, packing=True),
    "gemma3-lora-packed": TrainingSetup(architecture=GEMMA3, method="lora", lora_dropout=0.0, micro_batch_size=1,
                                        sequence_length=1024, packing=True),
    # spec.dataset.paddingFree: a micro-batch's examples in one row, traced as that row (its sdpa mask);
    # spec.dataset.microBatchTokens: padded to the longest declared example, not to sequenceLength.
    "llama-lora-padding-free": TrainingSetup(architecture=LLAMA, method="lora", lora_dropout=0.0, micro_batch_size=3,
                                             sequence_length=1024, padding_free=True, micro_batch_tokens=(700, 1100, 1190)),
    "qwen3-full-padded-declared": TrainingSetup(architecture=QWEN3, method="full", micro_batch_size=2,
                                                sequence_length=1024, micro_batch_tokens=(300,)),
    "gpt_neox-lora-gc-dropout": TrainingSetup(architecture=GPT_NEOX, method="lora", lora_dropout=0.05,
                                              micro_batch_size=2, sequence_length=1024, gradient_checkpointing=True),
}

# The whole-step check cannot see a term of a few percent; one more block can. These cases are
# traced again with one more decoder block, and the estimate's growth per block must match the
# tracker's within PER_BLOCK_TOLERANCE (each family term below is 10% or more of a tiny block:
# leaving it out fails this check, tried by hand).
PER_BLOCK = {
    "qwen3-full": "q/k norms",
    "qwen3_moe-lora-experts": "grouped experts and peft's merged expert weights",
    "gemma3-lora-sdpa-window": "the sdpa mask of the sliding layers",
    "gpt_oss-lora": "eager softmax with sinks, biased experts",
    "phi-lora": "fp32 LayerNorm input, gelu_new's fp32 tensors, residual dropout masks",
    "phi-full": "each linear's bf16 copy of the fp32 LayerNorm output, the attention output's copy",
    "phi-lora-fsdp2": "peft's cast of the fp32 LayerNorm output per adapter under FSDP",
    "gpt_neox-full-eager": "the whole query_key_value output kept alive by the value view",
    "llama-lora-packed": "the packed mask's bias and repeat_kv's key/value copies in every block",
    "gemma3-lora-packed": "the packed and sliding masks' biases and repeat_kv's copies in every block",
}
PER_BLOCK_TOLERANCE = (-0.04, 0.08)  # (under, over): 5-25% terms stand out either way
# phi and gpt_neox blocks are traced to within 0.1%; their smaller terms (the attention output's
# copy is 1.6% of a tiny phi block, the residual dropout masks 2%) need a tighter check to be seen
# (leaving the copy out passes the tolerance above and fails this one, tried by hand).
PER_BLOCK_TIGHT = {name: (-0.01, 0.01) for name in ("phi-lora", "phi-full", "phi-lora-fsdp2", "gpt_neox-full-eager")}

def _truth(setup: TrainingSetup) -> int:
    from sizing_truth import peak_bytes

    return peak_bytes(setup)


def _deeper(setup: TrainingSetup) -> TrainingSetup:
    arch = setup.architecture
    types = None if arch.layer_types is None else arch.layer_types + ("sliding_attention",)
    return replace(setup, architecture=replace(arch, num_layers=arch.num_layers + 1, layer_types=types))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_family_estimate_matches_tracker(name):
    setup = CASES[name]
    truth = _truth(setup)
    est = estimate_memory(setup).peak_allocated_bytes
    err = (est - truth) / truth
    assert -0.05 <= err <= 0.15, f"{name}: estimate {est} vs tracker {truth} ({err:+.1%})"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PER_BLOCK))
def test_family_block_matches_tracker(name):
    setup, deeper = CASES[name], _deeper(CASES[name])
    truth = _truth(deeper) - _truth(setup)
    est = estimate_memory(deeper).peak_allocated_bytes - estimate_memory(setup).peak_allocated_bytes
    err = (est - truth) / truth
    under, over = PER_BLOCK_TIGHT.get(name, PER_BLOCK_TOLERANCE)
    assert under <= err <= over, f"{name} ({PER_BLOCK[name]}): one more block costs {est} estimated, {truth} traced ({err:+.2%})"
