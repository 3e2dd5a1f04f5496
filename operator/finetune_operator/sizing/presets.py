"""Architectures of public models, with the numbers of their published config.json files."""

from __future__ import annotations

from .architecture import ModelArchitecture


def _llama(name, hidden, inter, layers, heads, kv, tie, head_dim=None, vocab=128256, max_pos=131072):
    return ModelArchitecture(
        family="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, tie_word_embeddings=tie,
        max_position_embeddings=max_pos, rope_theta=500000.0, rms_norm_eps=1e-5, name=name,
    )


def _qwen(name, hidden, inter, layers, heads, kv, tie, vocab=152064, max_pos=131072):
    return ModelArchitecture(
        family="qwen2", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tie,
        max_position_embeddings=max_pos, rope_theta=1000000.0, rms_norm_eps=1e-6, name=name,
    )


def _gemma2(name, hidden, inter, layers, heads, kv, head_dim):
    return ModelArchitecture(
        family="gemma2", vocab_size=256000, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, tie_word_embeddings=True,
        max_position_embeddings=8192, sliding_window=4096, final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0, rope_theta=10000.0, rms_norm_eps=1e-6, name=name,
    )


PRESETS: dict[str, ModelArchitecture] = {
    "llama-3.2-1b": _llama("meta-llama/Llama-3.2-1B", 2048, 8192, 16, 32, 8, True, head_dim=64),
    "llama-3.2-3b": _llama("meta-llama/Llama-3.2-3B", 3072, 8192, 28, 24, 8, True, head_dim=128),
    "llama-3.1-8b": _llama("meta-llama/Llama-3.1-8B", 4096, 14336, 32, 32, 8, False),
    "llama-3.1-70b": _llama("meta-llama/Llama-3.1-70B", 8192, 28672, 80, 64, 8, False),
    "llama-3.1-405b": _llama("meta-llama/Llama-3.1-405B", 16384, 53248, 126, 128, 8, False),
    "mistral-7b-v0.3": ModelArchitecture(
        family="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
        rope_theta=1000000.0, name="mistralai/Mistral-7B-v0.3",
    ),
    "mixtral-8x7b": ModelArchitecture(
        family="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_experts=8, experts_per_token=2,
        max_position_embeddings=32768, rope_theta=1000000.0, name="mistralai/Mixtral-8x7B-v0.1",
    ),
    "qwen2.5-0.5b": _qwen("Qwen/Qwen2.5-0.5B", 896, 4864, 24, 14, 2, True, vocab=151936, max_pos=32768),
    "qwen2.5-7b": _qwen("Qwen/Qwen2.5-7B", 3584, 18944, 28, 28, 4, False),
    "qwen2.5-14b": _qwen("Qwen/Qwen2.5-14B", 5120, 13824, 48, 40, 8, False),
    "qwen2.5-32b": _qwen("Qwen/Qwen2.5-32B", 5120, 27648, 64, 40, 8, False),
    "qwen2.5-72b": _qwen("Qwen/Qwen2.5-72B", 8192, 29568, 80, 64, 8, False),
    "gemma-2-2b": _gemma2("google/gemma-2-2b", 2304, 9216, 26, 8, 4, 256),
    "gemma-2-9b": _gemma2("google/gemma-2-9b", 3584, 14336, 42, 16, 8, 256),
    "gemma-2-27b": _gemma2("google/gemma-2-27b", 4608, 36864, 46, 32, 16, 128),
    "phi-3-mini": ModelArchitecture(
        family="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, sliding_window=2047,
        rope_theta=10000.0, name="microsoft/Phi-3-mini-4k-instruct",
    ),
}
