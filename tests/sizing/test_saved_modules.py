"""lora.modulesToSave and LoRA on the output head (issue 28), from the job to the estimate: the counts
match what peft builds, what cannot run or is not sized is refused naming the field, and each term
the memory model adds is what sizing/saved_modules.py says. The terms against fake-tensor truth are in
test_saved_modules_tracker.py; the trainer running them in tests/trainer/test_trainer_saved_modules.py."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest

from finetune_operator.sizing import ModelArchitecture, SizingError, TrainingSetup, estimate_memory
from finetune_operator.sizing.export import estimate_export
from finetune_operator.sizing.presets import preset
from finetune_operator.sizing.saved_modules import SavedModules, saved_modules


def _small(family, **kw):
    base = dict(family=family, vocab_size=512, hidden_size=96, intermediate_size=160, num_layers=2,
                num_attention_heads=6, num_key_value_heads=6)
    base.update(kw)
    return ModelArchitecture(**base)


SMALL = {
    "llama": _small("llama", num_key_value_heads=2),
    "llama-tied": _small("llama", num_key_value_heads=2, tie_word_embeddings=True),
    "phi": _small("phi"),  # the head has a bias, which its copy trains too
    "gpt_neox": _small("gpt_neox", attention_bias=True),  # embed_in
}


def _peft_trainable(arch: ModelArchitecture, targets, saved) -> int:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.AutoConfig.for_model(**arch.to_hf_config())
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets,
                                                           modules_to_save=list(saved) or None))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_the_trained_copies_and_the_head_adapter_are_what_peft_trains(name):
    arch = SMALL[name]
    both = (arch.traits.embedding_module, arch.traits.head_module)
    saved = saved_modules(arch, both)
    assert saved.params == _peft_trainable(arch, "all-linear", both) - arch.lora_trainable_params(4, "all-linear")
    # Tied or not, each saved module is its own copy: two vocabulary matrices (phi's head with its bias).
    assert saved.embedding == arch.vocab_size * arch.hidden_size
    assert saved.head == arch.vocab_size * arch.hidden_size + (arch.vocab_size if name == "phi" else 0)
    targets = tuple(arch.traits.lora_targets[:2]) + (arch.traits.head_module,)
    assert arch.lora_trainable_params(4, targets) == _peft_trainable(arch, list(targets), ())
    assert arch.lora_trainable_params(4, targets) - arch.lora_trainable_params(4, targets[:2]) == \
        4 * (arch.hidden_size + arch.vocab_size)


@pytest.mark.parametrize("names,targets,field,words", [
    (("norm",), "all-linear", "lora_modules_to_save", "only llama's input embedding .'embed_tokens'. and output head"),
    (("embed_in",), "all-linear", "lora_modules_to_save", "'embed_in' cannot be trained in full"),
    (("lm_head", "lm_head"), "all-linear", "lora_modules_to_save", "names a module twice"),
    (("lm_head",), ("q_proj", "lm_head"), "lora_modules_to_save", "adapted or trained in full, not both"),
    ((), ("lm_head",), "lora_targets", "names no linear layer of llama's blocks"),
    (("lm_head",), ("lm_head_x",), "lora_targets", "nor its output head 'lm_head'"),
])
def test_what_is_not_sized_is_refused_naming_the_field(names, targets, field, words):
    with pytest.raises(SizingError, match=words) as error:
        TrainingSetup(architecture=SMALL["llama"], lora_modules_to_save=names, lora_targets=targets)
    assert error.value.field == field


def test_the_head_alone_is_sized_once_the_embedding_trains_before_the_blocks():
    # The embedding's copy needs the gradient through every block: they save for backward as usual.
    TrainingSetup(architecture=SMALL["llama"], lora_modules_to_save=("embed_tokens",), lora_targets=("lm_head",))


def test_full_fine_tuning_and_the_sharded_strategies_refuse_saved_modules():
    with pytest.raises(SizingError, match="method full trains every module") as error:
        TrainingSetup(architecture=SMALL["llama"], method="full", lora_modules_to_save=("lm_head",))
    assert error.value.field == "lora_modules_to_save"
    for strategy in ("fsdp", "zero3"):
        with pytest.raises(SizingError, match="runs with ddp, zero1 or zero2") as error:
            TrainingSetup(architecture=SMALL["llama"], strategy=strategy, world_size=2,
                          lora_modules_to_save=("lm_head",))
        assert error.value.field == "strategy"
    TrainingSetup(architecture=SMALL["llama"], strategy="zero2", world_size=2, lora_modules_to_save=("lm_head",))


L8 = preset("llama-3.1-8b")


def test_each_saved_copy_costs_its_fp32_weight_gradient_and_adamw_state():
    plain = TrainingSetup(architecture=L8, micro_batch_size=1, sequence_length=2048, gradient_checkpointing=True)
    head = replace(plain, lora_modules_to_save=("lm_head",))
    both = replace(plain, lora_modules_to_save=("embed_tokens", "lm_head"))
    p = 128256 * 4096
    step = {s: estimate_memory(s).phase_peaks["optimizer"] for s in (plain, head, both)}
    assert step[head] - step[plain] == pytest.approx(16 * p, abs=4096)  # 4 weight + 4 gradient + 8 AdamW
    assert step[both] - step[plain] == pytest.approx(32 * p, abs=4096)
    # The head's copy is cast by autocast for the forward (2 bytes a value), until its backward.
    forward = {s: estimate_memory(s).breakdown for s in (plain, head)}
    assert forward[head]["weight_copies"] - forward[plain]["weight_copies"] == 2 * p


def test_the_trained_embedding_makes_the_residual_stream_fp32_outside_deepspeed():
    plain = TrainingSetup(architecture=L8, micro_batch_size=1, sequence_length=4096, gradient_checkpointing=True)
    embed = replace(plain, lora_modules_to_save=("embed_tokens",))
    # The copy and its AdamW state at the end of the forward (12 bytes a value; no gradient yet), and
    # with checkpointing each of the 32 blocks keeps its input: 4 bytes a value now, not 2.
    kept = estimate_memory(embed).phase_peaks["forward"] - estimate_memory(plain).phase_peaks["forward"]
    assert kept == pytest.approx(12 * 128256 * 4096 + 2 * 32 * 4096 * 4096, rel=0.01)


def test_the_head_backward_moment_wins_for_short_sequences():
    """The head copy's weight gradient is a vocabulary matrix whatever the tokens: with few tokens its
    backward (the fp32 gradient made while the compute-dtype one still exists) is the step's peak."""
    setup = TrainingSetup(architecture=L8, micro_batch_size=1, sequence_length=64, lora_modules_to_save=("lm_head",))
    estimate = estimate_memory(setup)
    assert estimate.peak_phase == "backward"
    assert estimate.breakdown["gradients"] == 4 * 128256 * 4096


def test_8bit_adamw_keeps_the_embedding_copys_state_in_32_bits():
    plain = TrainingSetup(architecture=L8, optimizer="adamw-8bit", lora_modules_to_save=("lm_head",))
    embed = replace(plain, lora_modules_to_save=("embed_tokens",))
    states = {s: estimate_memory(s).phase_peaks["optimizer"] for s in (plain, embed)}
    # transformers keeps nn.Embedding's states in 32 bits: 8 bytes a value, not about 2.
    assert states[embed] - states[plain] == pytest.approx((8 - 2.03) * 128256 * 4096, rel=0.01)


def test_the_merged_export_reads_the_fp32_copies_and_writes_a_tied_head_apart():
    tied = preset("llama-3.2-1b")
    plain = estimate_export(tied, export="merged", method="lora", precision="bf16")
    saved = estimate_export(tied, export="merged", method="lora", precision="bf16", modules_to_save=("lm_head",))
    matrix = tied.vocab_size * tied.hidden_size
    assert saved.disk_bytes - plain.disk_bytes == 2 * matrix  # the untied head, in bf16
    assert saved.working_set_bytes == 6 * matrix  # the fp32 copy and its bf16 cast
    adapted = estimate_export(tied, export="merged", method="lora", precision="bf16",
                              lora_targets=("q_proj", "lm_head"))
    assert adapted.disk_bytes == saved.disk_bytes and adapted.working_set_bytes == 6 * matrix


def test_a_profiled_family_leaves_the_names_to_its_profile():
    assert saved_modules(type("Profiled", (), {"profiled": object()})(), ("anything",)) == SavedModules()


def test_zero3_fetches_the_head_adapter_with_the_head():
    from finetune_operator.sizing import zero3

    arch = SMALL["llama-tied"]
    plain = zero3.decoder_trace(arch, "lora", 4, ("q_proj",), False, False)
    head = zero3.decoder_trace(arch, "lora", 4, ("q_proj", "lm_head"), False, False)
    added = [p for p in head.params if p.trainable][len([p for p in plain.params if p.trainable]):]
    assert [p.numel for p in added] == [4 * arch.hidden_size, 4 * arch.vocab_size]  # lora_A, lora_B
    # Three more fetches (the adapter's wrapper, lora_A, lora_B), and backward begins at the head:
    # its wrapper, then lora_B, lora_A and the base head.
    assert len(head.forward) == len(plain.forward) + 3
    b_param, a_param = len(head.params) - len(added) + 1, len(head.params) - len(added)
    assert [head.modules[m] for m in head.backward[2:4]] == [(b_param,), (a_param,)]
    TrainingSetup(architecture=arch, strategy="zero3", world_size=2, lora_targets=("q_proj", "lm_head"))
