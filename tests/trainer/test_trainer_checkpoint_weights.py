"""Weights-only resume from a torch.distributed.checkpoint folder (the path a DDP/FSDP
checkpoint takes into a DeepSpeed attempt), in one process without a process group."""

from __future__ import annotations

import pytest

from finetune_trainer import checkpointing
from finetune_trainer.checkpointing import Checkpoint, CheckpointMeta

pytestmark = pytest.mark.slow


def _meta(step: int) -> CheckpointMeta:
    return CheckpointMeta(step=step, samples_consumed=step * 8, world_size=1, strategy="ddp", method="full",
                          format="dcp", micro_batch_size=4, gradient_accumulation=2, attempt=1)


def test_dcp_checkpoint_loads_weights_into_a_fresh_model(assets, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, get_constant_schedule

    trained = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    with torch.no_grad():
        for param in trained.parameters():
            param.add_(0.5)
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-3)
    scheduler = get_constant_schedule(optimizer)
    path = checkpointing.save_checkpoint(root=tmp_path, meta=_meta(6), model=trained, optimizer=optimizer,
                                         scheduler=scheduler, deepspeed_engine=None, lora=False, keep_last=1)
    checkpoint = checkpointing.newest_checkpoint(tmp_path)
    assert checkpoint.path == path and checkpoint.meta.step == 6
    assert checkpointing.can_restore_optimizer(checkpoint, "fsdp", world_size=4)
    assert not checkpointing.can_restore_optimizer(checkpoint, "zero2", world_size=1)

    fresh = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    name, expected = next(iter(trained.state_dict().items()))
    assert not torch.equal(fresh.state_dict()[name], expected)
    checkpointing.load_weights(checkpoint, fresh, lora=False)
    for key, value in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key

    # What a ZeRO-3 attempt reads: the whole state consolidated on the host.
    full = checkpointing._dcp_full_state(Checkpoint(path, checkpoint.meta))
    assert set(full) == set(trained.state_dict())
    assert torch.equal(full[name], expected)
