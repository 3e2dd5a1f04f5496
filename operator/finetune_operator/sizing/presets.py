"""Architectures of public models, with the numbers of their published config.json files."""

from __future__ import annotations

from .architecture import ModelArchitecture
from .errors import SizingError


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


def _qwen3(name, hidden, inter, layers, heads, kv, tie, **moe):
    family = "qwen3_moe" if moe else "qwen3"
    return ModelArchitecture(
        family=family, vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=128, tie_word_embeddings=tie,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, name=name, **moe,
    )


def _gemma3(name, hidden, inter, layers, heads, kv, head_dim, vocab=262208, window=1024, max_pos=131072):
    """Gemma 3's decoder (model_type gemma3_text): five sliding-window layers to one global."""
    return ModelArchitecture(
        family="gemma3_text", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, tie_word_embeddings=True,
        max_position_embeddings=max_pos, sliding_window=window,
        layer_types=tuple("sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)),
        rope_theta=1000000.0, rms_norm_eps=1e-6, name=name,
    )


def _gpt_oss(name, layers, experts):
    """gpt-oss, sized as training runs it: the MXFP4 expert weights dequantised to bf16 (see README)."""
    return ModelArchitecture(
        family="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_layers=layers,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_experts=experts, experts_per_token=4,
        attention_bias=True, max_position_embeddings=131072, sliding_window=128,
        layer_types=tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)),
        rope_theta=150000.0, name=name,
    )


def _olmo2(name, hidden, inter, layers, heads, vocab=100352, max_pos=4096):
    return ModelArchitecture(
        family="olmo2", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_pos,
        rope_theta=500000.0, rms_norm_eps=1e-6, name=name,
    )


def _granite(name, hidden, inter, layers, heads, kv):
    return ModelArchitecture(
        family="granite", vocab_size=49155, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=True,
        max_position_embeddings=131072, rope_theta=10000000.0, rms_norm_eps=1e-5, name=name,
    )


def _phi(name, hidden, inter, layers, rotary, resid_pdrop):
    """phi-1.5 / phi-2 (model_type phi): resid_pdrop is the published config's (phi-2 trains with 0.1)."""
    return ModelArchitecture(
        family="phi", vocab_size=51200, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048, partial_rotary_factor=rotary,
        hidden_act="gelu_new", residual_dropout=resid_pdrop, rope_theta=10000.0, name=name,
    )


def _pythia(name, hidden, layers, heads, vocab):
    """Pythia (model_type gpt_neox): MLP 4 x hidden, a quarter of each head rotary, parallel residual."""
    return ModelArchitecture(
        family="gpt_neox", vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=2048, attention_bias=True,
        partial_rotary_factor=0.25, hidden_act="gelu", rope_theta=10000.0, name=name,
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
    # The families of 2026 (issue 16), from their published config.json files.
    "qwen3-0.6b": _qwen3("Qwen/Qwen3-0.6B", 1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": _qwen3("Qwen/Qwen3-1.7B", 2048, 6144, 28, 16, 8, True),
    "qwen3-4b": _qwen3("Qwen/Qwen3-4B", 2560, 9728, 36, 32, 8, True),
    "qwen3-8b": _qwen3("Qwen/Qwen3-8B", 4096, 12288, 36, 32, 8, False),
    "qwen3-14b": _qwen3("Qwen/Qwen3-14B", 5120, 17408, 40, 40, 8, False),
    "qwen3-32b": _qwen3("Qwen/Qwen3-32B", 5120, 25600, 64, 64, 8, False),
    "qwen3-30b-a3b": _qwen3("Qwen/Qwen3-30B-A3B", 2048, 6144, 48, 32, 4, False,
                            num_experts=128, experts_per_token=8, moe_intermediate_size=768),
    "qwen3-235b-a22b": _qwen3("Qwen/Qwen3-235B-A22B", 4096, 12288, 94, 64, 4, False,
                              num_experts=128, experts_per_token=8, moe_intermediate_size=1536),
    "gemma-3-1b": _gemma3("google/gemma-3-1b-pt", 1152, 6912, 26, 4, 1, 256, vocab=262144, window=512, max_pos=32768),
    "gemma-3-4b-text": _gemma3("google/gemma-3-4b-pt (text decoder)", 2560, 10240, 34, 8, 4, 256),
    "gemma-3-12b-text": _gemma3("google/gemma-3-12b-pt (text decoder)", 3840, 15360, 48, 16, 8, 256),
    "gemma-3-27b-text": _gemma3("google/gemma-3-27b-pt (text decoder)", 5376, 21504, 62, 32, 16, 128),
    "gpt-oss-20b": _gpt_oss("openai/gpt-oss-20b", 24, 32),
    "gpt-oss-120b": _gpt_oss("openai/gpt-oss-120b", 36, 128),
    "olmo-2-1b": _olmo2("allenai/OLMo-2-0425-1B", 2048, 8192, 16, 16),
    "olmo-2-7b": _olmo2("allenai/OLMo-2-1124-7B", 4096, 11008, 32, 32),
    "olmo-2-13b": _olmo2("allenai/OLMo-2-1124-13B", 5120, 13824, 40, 40),
    "granite-3.1-2b": _granite("ibm-granite/granite-3.1-2b-base", 2048, 8192, 40, 32, 8),
    "granite-3.1-8b": _granite("ibm-granite/granite-3.1-8b-base", 4096, 12800, 40, 32, 8),
    # Issue 28: phi and gpt_neox (Pythia), from their published config.json files.
    "phi-1_5": _phi("microsoft/phi-1_5", 2048, 8192, 24, 0.5, 0.0),
    "phi-2": _phi("microsoft/phi-2", 2560, 10240, 32, 0.4, 0.1),
    "pythia-1b": _pythia("EleutherAI/pythia-1b", 2048, 16, 8, 50304),
    "pythia-2.8b": _pythia("EleutherAI/pythia-2.8b", 2560, 32, 32, 50304),
    "pythia-6.9b": _pythia("EleutherAI/pythia-6.9b", 4096, 32, 32, 50432),
    "pythia-12b": _pythia("EleutherAI/pythia-12b", 5120, 36, 40, 50688),
}


def preset(name: str) -> ModelArchitecture:
    """The architecture of a named preset; SizingError names the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise SizingError("preset", f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None
