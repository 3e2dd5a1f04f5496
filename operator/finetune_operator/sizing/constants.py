"""Documented constants of the memory model. Every number here has a reason beside it.

Terms that the truth harness measures (peak allocated bytes, what
`torch.cuda.max_memory_allocated` reports) are derived from shapes in memory.py and the modules it assembles.
The constants below cover what that figure leaves out, and the settings of the
libraries our trainer uses.
"""

from finetune_trainer import contract as _contract

GIB = 1 << 30
MIB = 1 << 20

# ---- from peak allocated to what the GPU must hold ------------------------------
# The caching allocator keeps freed blocks cached and splits large segments; the reserved
# figure (what the device sees) runs above the allocated peak by a factor that depends on the
# setup: sizing/allocator.py's reserved_bytes (resident + transient x a replayed factor)
# (bench/allocator_replay.py) and checked on a GPU by bench/sizing_gpu.py.

# Outside the allocator entirely: the CUDA context and loaded kernels (~500-700 MiB
# on Hopper with torch + NCCL), cuBLAS/cuBLASLt workspaces (32 MiB per handle and
# stream), flash-attention backward scratch, NCCL channel buffers (~200-400 MiB at
# 8 ranks). 1.5 GiB covers them with a margin; calibrated by bench/sizing_gpu.py
# (device-level used memory minus max_memory_reserved).
CUDA_CONTEXT_RESERVE_BYTES = 3 * GIB // 2
NCCL_RESERVE_BYTES = 512 * MIB  # added when world_size > 1

# ---- library settings our trainer uses -----------------------------------------
# DDP (accelerate default gradient_as_bucket_view=False): the reducer holds flat
# bucket tensors as large as all trainable gradients, in the gradient dtype.
DDP_BUCKETS_COPY_GRADIENTS = True

# The low-bit optimizers' states (bitsandbytes, torchao): finetune_trainer/optimizers.py.

# bitsandbytes NF4 with double quantisation (the trainer's BitsAndBytesConfig: nf4,
# bnb_4bit_use_double_quant): 4 bits per weight, packed (what FSDP shards). Each quantised
# weight's quant_state beside it (states.nf4_quant_state_bytes): one 8-bit absmax per block of
# 64 weights, one fp32 second-level absmax per 256 of those blocks, the fp32 offset, the 16-entry
# NF4 code and the 256-entry dynamic code of the absmax quantisation (fp32 each). Checked against
# bitsandbytes.functional.quantize_4bit in tests/sizing/test_memory_levers.py.
NF4_PACKED_BYTES_PER_PARAM = 0.5
NF4_BLOCKSIZE = 64
NF4_ABSMAX_BLOCKSIZE = 256
NF4_CODE_ENTRIES = 16
NF4_ABSMAX_CODE_ENTRIES = 256

# DeepSpeed ZeRO settings (elements): the ones the trainer's DeepSpeed config writes
# (contract.ZERO_SETTINGS, read by contract.deepspeed_config), so the model and the config
# cannot disagree. Stage 3's buffers are replayed from them in zero3.py.
ZERO_SETTINGS = _contract.ZERO_SETTINGS
ZERO_REDUCE_BUCKET_ELEMENTS = ZERO_SETTINGS.reduce_bucket_size

# The trainer's bf16 AdamW (bf16_adamw.py) computes one parameter's step in fp32: the
# gradient, both moments and the old weight (4 x 4 bytes per element), and for the
# rounding: stochastic adds the random bits, their sum (int32) and the bf16 result; kahan
# the new weight and the re-read one (fp32). Figures from the trainer's author (H2) and
# bf16_adamw.py: stochastic rounding's transient int32 bits and fp32 sum, 8 bytes.
BF16_ADAMW_STEP_TEMP_BYTES = 16
BF16_ADAMW_ROUNDING_TEMP_BYTES = {"nearest": 0, "stochastic": 8, "kahan": 8}
# Elements one step handles at once: bf16_adamw.STEP_SLICE_ELEMENTS (the trainer updates each
# parameter in slices of at most this many; tests/sizing/test_memory_levers.py checks they agree).
BF16_ADAMW_STEP_SLICE_ELEMENTS: int | None = 1 << 24

# ---- host RAM per training process ------------------------------------------------
# Python + torch + CUDA libraries resident set of one training process.
HOST_PROCESS_BYTES = 3 * GIB
# Dataloader workers, tokenised batches and pinned staging buffers.
HOST_DATALOADER_BYTES = 2 * GIB
# safetensors shards are read one at a time when a model is quantised or sharded on load.
HOST_SHARD_BYTES = 5 * GIB
