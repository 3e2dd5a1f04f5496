"""bf16 master weights (`training.masterWeights`, with `training.updateRounding`): full
fine-tuning with bf16 weights, gradients and AdamW moments, no fp32 copy (the trainer's
bf16_adamw.py; the memory model's `static_state`, `_optimizer_bytes_per_param` and
`optimizer_step_temporaries`, sizing/states.py). It gives up the low bits of each update (stochastic or Kahan
rounding compensate in part), so the planner prefers fp32 at equal cost and recovery tries it
last, only when more GPUs cannot help."""

from __future__ import annotations

from typing import Literal

from ..optimizers import BNB, kind
from ..rules import ZERO, Rule, one_of
from .lever import Lever, LeverField, Setting

_Freedom = tuple[tuple[str, ...], "str | None"]  # (master weights to try, the rounding or None: auto)


def _ask(training, method: str, logit_transform: bool) -> tuple[_Freedom, bool]:
    rounding = None if training.update_rounding == "auto" else training.update_rounding
    if training.master_weights == "auto":
        full_bf16 = method == "full" and training.precision == "bf16"
        return (("fp32", "bf16") if full_bf16 else ("fp32",), rounding), False
    return ((training.master_weights,), rounding), True


def _auto_rounding(master: str, optimizer: str | None) -> str:
    # Stochastic rounding where the optimizer does it (optimizers.py); otherwise plain bf16 arithmetic.
    return "stochastic" if (master == "bf16" and optimizer is not None and kind(optimizer).stochastic_rounding) \
        else "nearest"


def _settings(freedom: _Freedom, base) -> tuple[Setting, ...]:
    masters, rounding = freedom
    return tuple({"master_weights": master,
                  "update_rounding": rounding if rounding is not None else _auto_rounding(master, base.optimizer)}
                 for master in masters)


def _sized(training, method: str, arch, notes: list) -> dict:
    master = training.master_weights
    if master == "auto":
        master = "fp32"
        if method == "full":
            notes.append("training.masterWeights is auto: sized with fp32 master weights")
    rounding = training.update_rounding
    if rounding == "auto":
        rounding = _auto_rounding(master, training.optimizer)
    return {"master_weights": master, "update_rounding": rounding}


def _words(setting: Setting) -> str:
    rounding = setting["update_rounding"]
    return "bf16 master weights" + ("" if rounding == "nearest" else f", {rounding} rounding")


def _describe_change(old: Setting, new: Setting) -> str:
    if new == old:
        return ""
    return (f"master weights {old['master_weights']} -> {new['master_weights']}"
            + (f" ({new['update_rounding']} rounding)" if new["master_weights"] == "bf16" else ""))


LEVER = Lever(
    name="master_weights",
    off={"master_weights": "fp32", "update_rounding": "nearest"},
    auto={"master_weights": "auto", "update_rounding": "auto"},
    schema={
        "master_weights": LeverField(
            Literal["fp32", "bf16"], "Master weights: fp32, or bf16 (weights, gradients and optimizer states all bf16)."),
        "update_rounding": LeverField(
            Literal["nearest", "stochastic", "kahan"], "How bf16 master weights round their updates."),
    },
    spec={
        "master_weights": LeverField(Literal["auto", "fp32", "bf16"], """
            Full fine-tuning: the dtype of the weights the optimizer updates. `fp32`: fp32 weights, gradients and
            AdamW states, computing in `precision` under autocast (16 bytes per parameter, plus the compute copies).
            `bf16`: weights, gradients and optimizer states all in bf16, as torchtune and lit-gpt run it (8 bytes per
            parameter with AdamW, no autocast copies); needs precision bf16 and strategy ddp or fsdp. `auto`: the
            planner chooses, fp32 unless only bf16 makes the plan cheaper. LoRA adapters always train in fp32."""),
        "update_rounding": LeverField(Literal["auto", "nearest", "stochastic", "kahan"], """
            With bf16 master weights, how each update is rounded into the weight: `nearest` (plain bf16),
            `stochastic` (stochastic rounding, no extra memory) or `kahan` (Kahan summation with a bf16 compensation
            buffer, 2 bytes per parameter). `auto`: stochastic. Not allowed with fp32 master weights."""),
    },
    ask=_ask,
    settings=_settings,
    rules=(
        Rule("bf16-master-adapters", {"master_weights": one_of("bf16"), "method": one_of("lora", "qlora")},
             "master_weights", "bf16 master weights apply to full fine-tuning; LoRA adapters always train in fp32"),
        Rule("bf16-master-precision", {"master_weights": one_of("bf16"), "precision": one_of("fp16", "fp32")},
             "master_weights", "bf16 master weights need precision bf16"),
        Rule("bf16-master-zero", {"master_weights": one_of("bf16"), "strategy": ZERO}, "master_weights",
             "DeepSpeed ZeRO keeps fp32 master weights; bf16 master weights need ddp or fsdp"),
        Rule("rounding-bnb", {"update_rounding": one_of("stochastic", "kahan"), "optimizer": BNB},
             "update_rounding",
             "stochastic and kahan rounding are done by the trainer's bf16 AdamW; bitsandbytes 8-bit optimizers"
             " round their own updates: use nearest (or optimizer adamw)"),
        Rule("rounding-fp32-master", {"update_rounding": one_of("stochastic", "kahan"),
                                      "master_weights": one_of("fp32")},
             "update_rounding", "stochastic and kahan rounding compensate bf16 updates: they need bf16 master weights"),
    ),
    quality_cost=4,  # the low bits of each update (rounding compensates in part)
    sized=_sized,
    rung="masterWeights",
    rung_after="moreGPUs",
    keeps_explicit=True,
    label="bf16 master weights",
    phrase="bf16 master weights",
    words=_words,
    change="bf16 master weights",
    describe_change=_describe_change,
)
