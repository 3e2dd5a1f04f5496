"""spec.model: the model's name, where its weights come from and its architecture, which sizing
needs: a preset, or the keys of a Hugging Face config.json that decide memory, typed and bounded."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..sizing.architecture import ModelArchitecture
from ..sizing.errors import SizingError, UnknownArchitecture
from .schema import PRINTABLE_LINE, ApiModel, ShortName, Text, require_exactly_one, text_matching
from .sources import ModelSource


_ModelTypeName = Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")]
_LayerType = Annotated[str, Field(min_length=1, max_length=100)]


def _config_keys_nullable(schema: dict[str, Any]) -> None:
    """Real config.json files write null for unset keys (Mistral's sliding_window: null means no
    window, not the default). The API server prunes nulls of fields that are not nullable, so
    every typed key is nullable: the stored config is the one pasted."""
    schema["x-kubernetes-preserve-unknown-fields"] = True
    for prop in schema.get("properties", {}).values():
        if "anyOf" in prop and {"type": "null"} in prop["anyOf"]:
            prop["nullable"] = True


# The keys are those sizing.hf_config.MEMORY_KEYS names (tests/sizing/test_architecture_configs.py
# checks that both list the same). Written out twice on purpose: here each key needs its type, bounds
# and CRD description, and sizing cannot derive its list from these models (the API imports sizing).
class _ConfigKeys(BaseModel):
    """The keys of a Hugging Face `config.json` that decide memory, typed and bounded.

    Any other key of the file is accepted and kept as it is (rope scaling, token ids,
    quantization settings, a vision tower's config ...): the trainer and the pre-flight
    profile read the same config. Which keys a family needs, and the defaults of those it
    may leave out, are sizing's (finetune_operator.sizing.hf_config); a missing one is named.
    """

    model_config = ConfigDict(
        extra="allow",
        strict=True,
        use_attribute_docstrings=True,
        json_schema_extra=_config_keys_nullable,
    )

    model_type: _ModelTypeName | None = None
    """Model family, as `model_type` in config.json (e.g. llama, qwen3, qwen3_moe, gemma3, gpt_oss).
    Families the analytic memory model does not know are sized by a pre-flight profile."""
    vocab_size: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    """Vocabulary size (rows of the embedding and of the output head)."""
    hidden_size: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    """Width of the residual stream."""
    intermediate_size: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    """Width of the dense MLP (of each expert for Mixtral and gpt-oss)."""
    num_hidden_layers: Annotated[int, Field(ge=1, le=10_000)] | None = None
    """Number of transformer blocks."""
    num_attention_heads: Annotated[int, Field(ge=1, le=10_000)] | None = None
    """Number of query heads."""
    num_key_value_heads: Annotated[int, Field(ge=1, le=10_000)] | None = None
    """Number of key/value heads (grouped-query attention); equals num_attention_heads when omitted."""
    head_dim: Annotated[int, Field(ge=1, le=100_000)] | None = None
    """Width of one head; the family's default (hidden_size / num_attention_heads for most) when omitted."""
    tie_word_embeddings: bool | None = None
    """Whether the output head shares the embedding matrix (the family's default when omitted)."""
    max_position_embeddings: Annotated[int, Field(ge=1, le=100_000_000)] | None = None
    """Longest context the model was trained for; longer sequences give a note."""
    attention_bias: bool | None = None
    """Biases on q/k/v/o (Qwen2 has q/k/v biases whatever this says)."""
    mlp_bias: bool | None = None
    """Biases on the MLP (Llama, Granite)."""
    num_local_experts: Annotated[int, Field(ge=1, le=4096)] | None = None
    """MoE: experts per layer (Mixtral, gpt-oss)."""
    num_experts: Annotated[int, Field(ge=1, le=4096)] | None = None
    """MoE: experts per layer (Qwen3-MoE)."""
    num_experts_per_tok: Annotated[int, Field(ge=1, le=4096)] | None = None
    """MoE: experts each token is routed to."""
    moe_intermediate_size: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    """MoE: width of each expert (Qwen3-MoE)."""
    decoder_sparse_step: Annotated[int, Field(ge=1, le=10_000)] | None = None
    """MoE: every n-th layer has experts (Qwen3-MoE)."""
    mlp_only_layers: Annotated[list[Annotated[int, Field(ge=0, le=10_000)]], Field(max_length=10_000)] | None = None
    """MoE: layers that keep a dense MLP (Qwen3-MoE)."""
    sliding_window: Annotated[int, Field(ge=1, le=100_000_000)] | None = None
    """Tokens a sliding-window layer attends to (null: no window)."""
    use_sliding_window: bool | None = None
    """Qwen: whether any layer slides."""
    max_window_layers: Annotated[int, Field(ge=0, le=10_000)] | None = None
    """Qwen: layers from this index on slide."""
    layer_types: Annotated[list[_LayerType], Field(max_length=10_000)] | None = None
    """Per layer full_attention or sliding_attention (Gemma 3, gpt-oss)."""
    sliding_window_pattern: Annotated[int, Field(ge=1, le=10_000)] | None = None
    """Gemma 3 (older configs): every n-th layer attends globally."""
    final_logit_softcapping: float | None = None
    """tanh capping of the output logits (Gemma 2)."""
    attn_logit_softcapping: float | None = None
    """tanh capping of the attention scores (Gemma 2; needs eager attention)."""
    partial_rotary_factor: Annotated[float, Field(gt=0, le=1)] | None = None
    """phi: share of each head that rotary rotates (rope_parameters.partial_rotary_factor wins where set)."""
    rotary_pct: Annotated[float, Field(gt=0, le=1)] | None = None
    """gpt_neox (Pythia): share of each head that rotary rotates."""
    hidden_act: Annotated[str, Field(min_length=1, max_length=100)] | None = None
    """The MLP activation (phi and gpt_neox: gelu, gelu_new or gelu_pytorch_tanh are modelled)."""
    resid_pdrop: Annotated[float, Field(ge=0, lt=1)] | None = None
    """phi: dropout on the attention and MLP outputs (training keeps a mask of each)."""
    embd_pdrop: Annotated[float, Field(ge=0, lt=1)] | None = None
    """phi: dropout on the embeddings."""
    hidden_dropout: Annotated[float, Field(ge=0, lt=1)] | None = None
    """gpt_neox: dropout on the embeddings and the attention and MLP outputs."""
    attention_dropout: Annotated[float, Field(ge=0, lt=1)] | None = None
    """Dropout on the attention probabilities (phi and gpt_neox: only 0 is sized)."""
    use_parallel_residual: bool | None = None
    """gpt_neox: attention and MLP both read the block input."""
    qk_layernorm: bool | None = None
    """phi: LayerNorms on q and k (not sized; the published checkpoints have none)."""

    def config_json(self) -> dict[str, Any]:
        """The config as given: every key, explicit nulls kept (a null sliding_window means no window)."""
        return self.model_dump(exclude_unset=True)


class TextConfig(_ConfigKeys):
    """The decoder's config inside a multimodal config.json (Gemma 3's `text_config`)."""


class InlineArchitecture(_ConfigKeys):
    """A whole Hugging Face `config.json`, as it is published.

    The keys listed here decide memory and are checked; all others are kept for the trainer.
    """

    model_type: _ModelTypeName
    """Model family, as `model_type` in config.json (e.g. llama, qwen3, qwen3_moe, gemma3, gpt_oss).
    Families the analytic memory model does not know are sized by a pre-flight profile."""
    text_config: TextConfig | None = None
    """The decoder of a multimodal config (Gemma 3: model_type gemma3); sized from here."""

    @model_validator(mode="after")
    def _sizable(self) -> "InlineArchitecture":
        # One rule, sizing's: what a family needs, its defaults, how the numbers fit together.
        try:
            ModelArchitecture.from_hf_config(self.config_json())
        except UnknownArchitecture:
            pass  # another family: sized by the pre-flight profile, not refused
        except SizingError as error:
            raise ValueError(str(error)) from None
        return self


class ConfigMapKeyRef(ApiModel):
    """A key of a ConfigMap in the job's namespace."""

    name: ShortName
    """Name of the ConfigMap."""
    key: Text = "config.json"
    """Key holding the Hugging Face config.json."""


class ArchitectureSource(ApiModel):
    """The model's architecture, which sizing needs. Set exactly one of `preset`, `inline`, `configMapRef`."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "[has(self.preset), has(self.inline), has(self.configMapRef)].filter(x, x).size() == 1",
                    "message": "set exactly one of preset, inline, configMapRef",
                }
            ]
        }
    )

    preset: Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[a-z0-9][a-z0-9.\-]*$")] | None = None
    """A known architecture, e.g. `llama-3.1-8b`, `qwen2.5-7b`, `mixtral-8x7b` (`finetune-operator presets` lists them)."""
    inline: InlineArchitecture | None = None
    """The numbers themselves, with the keys of a Hugging Face config.json."""
    config_map_ref: ConfigMapKeyRef | None = None
    """A ConfigMap holding the model's config.json."""

    @model_validator(mode="after")
    def _exactly_one(self) -> "ArchitectureSource":
        require_exactly_one(self, ("preset", "inline", "config_map_ref"))
        return self


class ModelSpec(ApiModel):
    """The model to fine-tune."""

    name: text_matching(
        PRINTABLE_LINE, "must be one line of printable text: no line breaks, tabs, escape or other control characters", 200
    )
    """Human-readable model name, e.g. `meta-llama/Llama-3.1-8B-Instruct` (shown in `kubectl get`): one line of printable text."""
    architecture: ArchitectureSource
    """Architecture used to size GPU memory."""
    source: ModelSource
    """Where the weights come from."""
