"""The export's host memory and disk (sizing/export.py), and the pod memory the plan gives it."""

from __future__ import annotations

import pytest

from finetune_operator.planning import Infeasible
from finetune_operator.sizing import PRESETS
from finetune_operator.sizing.constants import GIB, HOST_PROCESS_BYTES
from finetune_operator.sizing.export import MERGE_OVERHEAD_BYTES, estimate_export

from .test_search import plan, pool, spec


def test_an_adapter_export_writes_nothing_to_size():
    assert estimate_export(PRESETS["llama-3.1-8b"], export="adapter", method="lora", precision="bf16") is None


def test_the_merge_of_llama_8b_holds_its_largest_tensor_once_beside_the_runtime():
    arch = PRESETS["llama-3.1-8b"]
    merged = estimate_export(arch, export="merged", method="lora", precision="bf16")
    embedding = 128256 * 4096
    # The embedding matrix (bf16 on disk and out: no cast copy) outweighs the largest adapted matrix
    # (4096 x 14336, bf16 read + fp32 copy = 6 bytes each).
    assert merged.largest_tensor_elements == embedding
    assert merged.working_set_bytes == max(2 * embedding, 6 * 4096 * 14336)
    assert merged.host_bytes == HOST_PROCESS_BYTES + merged.working_set_bytes + MERGE_OVERHEAD_BYTES
    assert merged.disk_bytes == 2 * arch.total_params
    # An fp32 export doubles the disk and the cast copies.
    fp32 = estimate_export(arch, export="merged", method="lora", precision="fp32")
    assert fp32.disk_bytes == 4 * arch.total_params and fp32.working_set_bytes == 6 * embedding


def test_qlora_costs_at_least_what_lora_costs():
    arch = PRESETS["llama-3.2-1b"]
    lora = estimate_export(arch, export="merged", method="lora", precision="bf16", lora_targets=("down_proj",))
    qlora = estimate_export(arch, export="merged", method="qlora", precision="bf16", lora_targets=("down_proj",))
    # The 4-bit round trip of the largest adapted matrix: bf16 read, bf16 cast, packed, dequantised.
    assert qlora.working_set_bytes >= lora.working_set_bytes
    assert qlora.disk_bytes == lora.disk_bytes


def test_a_full_export_reads_fp32_master_weights():
    arch = PRESETS["llama-3.1-8b"]
    fp32 = estimate_export(arch, export="full", method="full", precision="bf16", trained_bytes=4)
    bf16 = estimate_export(arch, export="full", method="full", precision="bf16", trained_bytes=2)
    assert fp32.working_set_bytes == 6 * 128256 * 4096 and bf16.working_set_bytes == 2 * 128256 * 4096
    assert fp32.disk_bytes == bf16.disk_bytes == 2 * arch.total_params


def test_the_pod_memory_covers_the_merge_where_training_needs_less():
    """QLoRA 70B on one GPU: the test estimator's 4 GiB per rank is less than the merge needs (the
    runtime plus 128256 x 8192 bf16 embeddings), so the plan's pod memory is the merge's."""
    pools = [pool("h100", gpu="H100-80GB")]
    job = spec(**{"model.architecture": {"preset": "llama-3.1-70b"}, "method": "qlora", "resources.gpus": 1,
                  "training.globalBatchSize": 8, "training.sequenceLength": 512, "export": "merged"})
    merged = plan(job, pools)
    need = estimate_export(PRESETS["llama-3.1-70b"], export="merged", method="qlora", precision="bf16").host_bytes
    assert need > 4 * GIB and merged.host_memory_bytes == need
    adapter = plan(spec(**{"model.architecture": {"preset": "llama-3.1-70b"}, "method": "qlora", "resources.gpus": 1,
                           "training.globalBatchSize": 8, "training.sequenceLength": 512}), pools)
    assert adapter.host_memory_bytes == 4 * GIB


def test_a_pool_without_the_host_memory_for_the_merge_is_not_planned():
    job = spec(**{"model.architecture": {"preset": "llama-3.1-70b"}, "method": "qlora", "resources.gpus": 1,
                  "training.globalBatchSize": 8, "training.sequenceLength": 512, "export": "merged"})
    result = plan(job, [pool("small", gpu="H100-80GB", hostMemory="4Gi")])
    assert isinstance(result, Infeasible) and "host" in result.message.lower()


@pytest.mark.parametrize("lora", [{"rank": 16}, {"rank": 16, "targetExperts": True}])
def test_merged_on_a_mixture_of_experts_model_with_adapted_experts_is_refused_before_training(lora):
    job = spec(**{"model.architecture": {"preset": "mixtral-8x7b"}, "lora": lora, "export": "merged"})
    result = plan(job, [pool("h100")])
    assert isinstance(result, Infeasible) and result.message.startswith("spec.export: merged does not merge")
    # Attention-only adapters on the same model merge.
    ok = plan(spec(**{"model.architecture": {"preset": "mixtral-8x7b"}, "export": "merged",
                      "lora": {"rank": 16, "targetModules": ["q_proj", "v_proj"]}}), [pool("h100")])
    assert not isinstance(ok, Infeasible)
