"""Sequence parallelism (training.sequenceParallel) measured on the CPU, beside the memory model's estimate.

    python bench/sequence_parallel_truth.py [--seqs 2048,4096] [--quick]

Each row runs DeepSpeed ZeRO-2 (the trainer's DeepSpeed config, contract.deepspeed_config) over two gloo
ranks on the CPU with real tensors: a Llama of 4 blocks (hidden 512, 8 heads of 64, grouped key/value
heads as given, vocabulary 8192) in bf16 with peft's LoRA adapters (rank 16 on q, k, v, o) and sdpa
attention, one sequence per rank and step, three steps, the third measured. With `sp` 2 DeepSpeed's
Ulysses (UlyssesSPAttentionHF, registered as accelerate registers it for the Trainer) splits each
sequence over both ranks, whose batch is its slice of one sequence (as UlyssesSPDataLoaderAdapter
slices it); with `sp` 1 each rank runs a whole sequence of its own. Each rank's allocated bytes are
counted by the trainer's PeakTracker (every storage the dispatcher creates, plus the model's own
parameters), and the fullest rank's peak is printed beside finetune_operator.sizing's estimate.

What the memory model says of the split is that a GPU of it holds what an unsplit run of its slice
holds (sequence s over 2 GPUs as a whole sequence of s/2), plus Ulysses' exchange in backward. So
each row runs three setups: the split (`split 2`), a whole sequence of half the length (`whole s/2`)
and a whole one of the full length (`whole s`); `excess` is what the split holds more than the
whole s/2, measured and estimated. The last columns are the model's error on the unsplit run: the baseline, which is not
the split's doing (the model counts 381 MiB of DeepSpeed's ZeRO-2 buckets here; these runs' backward
rises about 100 MiB above their forward at 1024 tokens, so most of that count is not seen on this
CPU with LoRA's few trainable values; the cause is not established).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))
sys.path.insert(0, str(ROOT / "images" / "trainer"))
sys.path.insert(0, str(ROOT / "bench"))

from cpu_ranks import run_ranks  # noqa: E402

RANK_SCRIPT = r'''
import json, os, sys
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch, deepspeed
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from finetune_trainer.contract import ZERO_SETTINGS, deepspeed_config
from finetune_trainer.peak_tracker import PeakTracker
sp, seq, ckpt, config = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", json.loads(sys.argv[5])
world = int(os.environ["WORLD_SIZE"])
rank = int(os.environ["RANK"])
deepspeed.init_distributed(dist_backend="gloo")
from transformers import LlamaConfig, LlamaForCausalLM
from peft import LoraConfig, get_peft_model

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(**config, attn_implementation="sdpa")).to(torch.bfloat16)
model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
if ckpt:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
cfg = deepspeed_config(2, "none", ZERO_SETTINGS)
cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=world // sp,
           gradient_clipping=1.0, bf16={"enabled": True}, fp16={"enabled": False})
mpu = None
if sp > 1:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=sp,
        micro_batch_size=1, seq_length_is_variable=True)
params = [p for p in model.parameters() if p.requires_grad]
optimizer = torch.optim.AdamW(params, lr=1e-4)
tracker = PeakTracker()
generator = torch.Generator().manual_seed(1 + (rank // sp))  # the ranks of one sequence share it
with tracker:
    for p in model.parameters():
        tracker.track(p)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg, mpu=mpu)
    for step in range(3):
        ids = torch.randint(0, config["vocab_size"], (1, seq), generator=generator)
        labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
        positions = torch.arange(seq).unsqueeze(0)
        part = slice((rank % sp) * seq // sp, (rank % sp + 1) * seq // sp)
        batch = {"input_ids": ids[:, part], "position_ids": positions[:, part], "shift_labels": labels[:, part]}
        phases = {"steady": tracker.current}
        tracker.reset_peak()
        tracker.mark("forward")
        loss = engine(**batch, labels=batch["shift_labels"]).loss
        tracker.mark("backward")
        engine.backward(loss)
        tracker.mark("step")
        engine.step()
        phases.update({k: tracker.phase_peaks[k] for k in ("forward", "backward", "step")})
print(json.dumps(phases))
'''

PHASES = ("steady", "forward", "backward", "step")


def llama_config(kv_heads: int) -> dict:
    return {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4,
            "num_attention_heads": 8, "num_key_value_heads": kv_heads, "max_position_embeddings": 16384,
            "tie_word_embeddings": False}


def measure(sp: int, seq: int, ckpt: bool, kv_heads: int, port: int) -> dict[str, int]:
    results = run_ranks(RANK_SCRIPT, [str(sp), str(seq), "1" if ckpt else "0", json.dumps(llama_config(kv_heads))],
                        2, port, f"sp {sp} seq {seq}")
    return {k: max(r[k] for r in results) for k in PHASES}  # the fullest rank per phase


def estimate(sp: int, seq: int, ckpt: bool, kv_heads: int) -> int:
    from finetune_operator.sizing import ModelArchitecture, TrainingSetup, estimate_memory
    from finetune_operator.sizing.hf_config import architecture_fields

    arch = ModelArchitecture(**architecture_fields(dict(llama_config(kv_heads), model_type="llama"), "bench-llama"))
    setup = TrainingSetup(architecture=arch, method="lora", lora_rank=16,
                          lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"), lora_dropout=0.0,
                          strategy="zero2", world_size=2, micro_batch_size=1, sequence_length=seq,
                          gradient_checkpointing=ckpt, attention="sdpa", precision="bf16", sequence_parallel=sp)
    return estimate_memory(setup).peak_allocated_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="2048,4096")
    parser.add_argument("--kv-heads", default="8,1", help="key/value heads (1: Ulysses repeats them)")
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args()
    rows = []
    port = 29610
    mib = 2 ** 20
    print(f"{'kv':>3} {'seq':>6} {'ckpt':>5} | {'split 2':>8} {'whole s/2':>9} {'excess':>7} | {'est split':>9}"
          f" {'est s/2':>8} {'excess':>7} | {'whole s':>8} {'est s':>8} {'error':>7}   (MiB, the fullest rank)")
    for kv in (int(k) for k in ns.kv_heads.split(",")):
        for seq in (int(s) for s in ns.seqs.split(",")):
            for ckpt in (False, True):
                measured = {}
                for sp, length in ((2, seq), (1, seq // 2), (1, seq)):
                    port += 1
                    phases = measure(sp, length, ckpt, kv, port)
                    measured[(sp, length)] = max(phases[k] for k in ("forward", "backward", "step"))
                estimated = {key: estimate(*key, ckpt, kv) for key in measured}
                split, half, whole = (2, seq), (1, seq // 2), (1, seq)
                rows.append({"kv_heads": kv, "seq": seq, "ckpt": ckpt,
                             "measured": {f"{sp}x{n}": v for (sp, n), v in measured.items()},
                             "estimated": {f"{sp}x{n}": v for (sp, n), v in estimated.items()}})
                error = (estimated[whole] - measured[whole]) / measured[whole]
                print(f"{kv:>3} {seq:>6} {str(ckpt):>5} | {measured[split] / mib:8.1f} {measured[half] / mib:9.1f}"
                      f" {(measured[split] - measured[half]) / mib:+7.1f} | {estimated[split] / mib:9.1f}"
                      f" {estimated[half] / mib:8.1f} {(estimated[split] - estimated[half]) / mib:+7.1f} |"
                      f" {measured[whole] / mib:8.1f} {estimated[whole] / mib:8.1f} {100 * error:+6.1f}%", flush=True)
    if ns.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
