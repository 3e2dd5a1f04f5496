"""A tiny Llama, a locally built tokenizer and small JSONL datasets, made from nothing.

No downloads: the model is a 2-layer Llama with random weights built from a config,
the tokenizer a word-level ``tokenizers`` model wrapped in PreTrainedTokenizerFast with
a chat template.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
SPECIAL = ["<pad>", "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
COLOURS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple"]
THINGS = ["apple", "sky", "grass", "sun", "night", "snow", "carrot", "grape"]
WORDS = ["what", "colour", "is", "the", "a", "it", "answer", "tell", "me", "of", "and", "please"]
PAIRS = dict(zip(THINGS, COLOURS))


def build_tokenizer(path: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + COLOURS + THINGS + WORDS + ["?", "."])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def build_model(path: Path, vocab_size: int, hidden: int = 64, layers: int = 2, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    return model


def chat_lines(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        thing = rng.choice(THINGS)
        out.append(
            {
                "messages": [
                    {"role": "user", "content": f"what colour is the {thing} ?"},
                    {"role": "assistant", "content": f"the {thing} is {PAIRS[thing]} ."},
                ]
            }
        )
    return out


def instruction_lines(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        thing = rng.choice(THINGS)
        out.append({"instruction": f"tell me the colour of the {thing}", "response": f"{PAIRS[thing]} ."})
    return out


def text_lines(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"text": " ".join(f"the {t} is {PAIRS[t]} ." for t in rng.sample(THINGS, 4))} for _ in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build_assets(root: Path) -> dict[str, Path]:
    """Model dir (weights + tokenizer) and datasets under ``root``."""
    model_dir = root / "tiny-llama"
    tok = build_tokenizer(model_dir)
    build_model(model_dir, vocab_size=len(tok))
    return {
        "model": model_dir,
        "chat": write_jsonl(root / "chat.jsonl", chat_lines(64)),
        "instruction": write_jsonl(root / "instruction.jsonl", instruction_lines(64)),
        "text": write_jsonl(root / "text.jsonl", text_lines(64)),
    }
