"""Small models (2-4 blocks) traced with fake tensors: the estimate must match the tracker.

Same tolerance as the accuracy benchmark: within 15%, never under by more than 5%.
"""

import os
import sys

import pytest

from finetune_operator.sizing import ModelArchitecture, TrainingSetup, estimate_memory

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")
sys.path.insert(0, os.path.abspath(BENCH))


def _arch(family, layers, **kw):
    base = dict(family=family, vocab_size=32000, hidden_size=512, intermediate_size=1536, num_layers=layers,
                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192)
    base.update(kw)
    return ModelArchitecture(**base)


CASES = {
    "llama-full": TrainingSetup(architecture=_arch("llama", 2), method="full", micro_batch_size=2, sequence_length=512),
    "llama-full-gc": TrainingSetup(architecture=_arch("llama", 4), method="full", micro_batch_size=2,
                                   sequence_length=1024, gradient_checkpointing=True),
    "qwen2-lora": TrainingSetup(architecture=_arch("qwen2", 3, tie_word_embeddings=True), method="lora",
                                lora_rank=8, micro_batch_size=4, sequence_length=512),
    "qwen2-lora-dropout-gc": TrainingSetup(architecture=_arch("qwen2", 3), method="lora", lora_rank=8,
                                           lora_dropout=0.05, micro_batch_size=2, sequence_length=1024,
                                           gradient_checkpointing=True),
    "phi3-lora": TrainingSetup(architecture=_arch("phi3", 2, num_key_value_heads=8), method="lora",
                               micro_batch_size=2, sequence_length=512),
    "llama-lora-eager": TrainingSetup(architecture=_arch("llama", 2), method="lora", micro_batch_size=1,
                                      sequence_length=512, attention="eager"),
    "llama-full-fsdp4": TrainingSetup(architecture=_arch("llama", 2), method="full", micro_batch_size=2,
                                      sequence_length=512, strategy="fsdp", world_size=4),
    "llama-lora-fsdp2-gc": TrainingSetup(architecture=_arch("llama", 3), method="lora", micro_batch_size=2,
                                         sequence_length=1024, gradient_checkpointing=True, strategy="fsdp",
                                         world_size=2, lora_dropout=0.0),
    "llama-full-ddp2": TrainingSetup(architecture=_arch("llama", 2), method="full", micro_batch_size=1,
                                     sequence_length=512, strategy="ddp", world_size=2),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_estimate_matches_tracker(name):
    from sizing_truth import measure

    setup = CASES[name]
    truth = measure(setup)
    est = estimate_memory(setup)
    err = (est.peak_allocated_bytes - truth.peak_bytes) / truth.peak_bytes
    assert -0.05 <= err <= 0.15, f"{name}: estimate {est.peak_allocated_bytes} vs tracker {truth.peak_bytes} ({err:+.1%})"


@pytest.mark.slow
def test_tracker_counts_a_known_tensor():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from peak_tracker import PeakTracker

    with FakeTensorMode(), PeakTracker() as tracker:
        a = torch.empty(1000, dtype=torch.float32)  # 4000 bytes -> 4096 in 512-byte blocks
        b = torch.empty(10, dtype=torch.bfloat16)  # 20 bytes -> 512
        assert tracker.current == 4096 + 512
        del b
        assert tracker.current == 4096
        a.untyped_storage().resize_(0)
        assert tracker.current == 0
        c = torch.empty(256, dtype=torch.float32)
        assert tracker.peak == 4096 + 512
        del a, c
