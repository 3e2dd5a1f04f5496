"""The export after training (FineTuneJob spec.export): a folder a serving stack loads as is.

``adapter`` (the default for LoRA and QLoRA) exports nothing more: the adapter the Trainer saved
in the output is the result. ``merged`` writes ``<output>/merged``: the base model with the LoRA
adapter merged into it; ``full`` (the default for full fine-tuning) writes ``<output>/full``: the
fine-tuned weights. Both are written the same way, in the training dtype (``precision``):

* safetensors shards of at most 2 GiB (``model-00001-of-0000N.safetensors``), always with
  ``model.safetensors.index.json``; ``config.json`` (the base's, with the dtype set, the
  quantisation config removed, and ``tie_word_embeddings`` false only when the merge had to untie
  them), ``generation_config.json`` when the base has one, and the tokenizer's files. vLLM, TGI and
  KServe's Hugging Face runtime load such a folder as they load a model from the Hub.
* Streaming: tensors are read from the base (or the Trainer's saved weights) one at a time, merged,
  cast and written at once under headers planned from the shapes beforehand (safetensors_io), so
  the host holds one tensor (and its fp32 working copy) at a time, never a copy of the model. No
  GPU: it runs on the CPU of rank 0's pod after training succeeded.
* Atomic: everything is written into ``<output>/.merged.staging-<pid>``, then renamed to
  ``<output>/merged``. A crash leaves no ``merged`` folder (a stale staging folder is removed by the
  next export); a failure raises ExportError and leaves the adapter (or the Trainer's weights) as
  they were.

The merge, for each weight W the adapter touches (peft's LoRA, as peft computes it in forward):
``W + scaling * B @ A`` with ``scaling = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), ``r`` the
rank of that module's A (so ``rank_pattern`` is honoured); transposed for ``fan_in_fan_out``
(GPT-2's Conv1D) and for embeddings (``(B @ A)^T``); computed in fp32, then cast. A module in
``modules_to_save`` replaces the base tensor with the adapter's trained copy. Tied weights (the
input embeddings and the output head sharing one tensor) stay tied when the adapter changes
neither; when it changes one of them (the head in ``modules_to_save``, say), the two are written
separately and untied in config.json: that is what the adapted model computes (peft's own
merge_and_unload would add the change to the shared tensor and change both).

QLoRA: the adapter was trained against the dequantised 4-bit base, not the 16-bit weights on disk.
The merge quantises every weight that transformers quantised for training (bitsandbytes NF4, double
quantisation, block size 64, as model_setup.qlora_quantization) and dequantises it again, then adds
the adapter: the merged model computes what the QLoRA model computed (up to the rounding of the
16-bit output). That needs bitsandbytes (which QLoRA training needs anyway). A base stored
pre-quantised (a quantization_config in its config.json) is refused.

Adapters that merge differently or not at all are refused, naming the adapter_config.json key:
DoRA, LoRA biases, trained biases, experts' fused parameters (``target_parameters``), trainable
token indices, layer replication, alpha patterns, initialisations that change the base (PiSSA,
OLoRA, LoftQ, CorDA), and other peft variants.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .checkpointing import fsync_dir
from .errors import ExportError
from .safetensors_io import FormatError, SafetensorsFile, TensorInfo, write_file

EXPORT_KINDS = ("adapter", "merged", "full")
MAX_SHARD_BYTES = 2 * 1024**3
WEIGHTS_INDEX = "model.safetensors.index.json"
SINGLE_WEIGHTS = "model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# The tokenizer's files, as transformers saves them for the tokenizers of causal language models.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "merges.txt",
                   "chat_template.jinja", "chat_template.json")
SAFETENSORS_METADATA = {"format": "pt"}  # transformers refuses a checkpoint whose format it cannot read


@dataclass(frozen=True)
class ExportResult:
    """What the export wrote (the success report and the log carry it)."""

    kind: str
    directory: str
    shards: int
    tensors: int
    total_bytes: int
    seconds: float
    peak_rss_bytes: int  # the process's resident set, sampled after every tensor
    untied: tuple[str, ...] = ()


# ------------------------------------------------------------------ the weights on disk


class WeightsFolder:
    """The safetensors weights of a model folder (an index and its shards, or one file)."""

    def __init__(self, directory: str | Path, what: str):
        self.directory = Path(directory)
        index = self.directory / WEIGHTS_INDEX
        try:
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                files = list(dict.fromkeys(weight_map.values()))
            elif (self.directory / SINGLE_WEIGHTS).is_file():
                files, weight_map = [SINGLE_WEIGHTS], None
            else:
                others = sorted(p.name for p in self.directory.glob("*.bin")) if self.directory.is_dir() else []
                raise ExportError(f"{what} {self.directory} holds no safetensors weights"
                                  + (f" (only {', '.join(others)}: the export reads safetensors only)" if others else ""))
            self.files = {name: SafetensorsFile(self.directory / name) for name in files}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ExportError(f"{what} {self.directory}: cannot read its weights: {exc}") from None
        self.where: dict[str, SafetensorsFile] = {}
        for name in files:
            for tensor in self.files[name].names():
                if weight_map is not None and weight_map.get(tensor) != name:
                    continue  # the index says where a tensor is; a stray duplicate is not read
                self.where[tensor] = self.files[name]
        if weight_map is not None and set(weight_map) != set(self.where):
            missing = sorted(set(weight_map) - set(self.where))
            raise ExportError(f"{what} {self.directory}: the index lists tensors its shards lack, e.g. {missing[:3]}")

    def names(self) -> list[str]:
        """Shard by shard, each in file order: every file is read front to back once."""
        return list(self.where)

    def info(self, name: str) -> TensorInfo:
        return self.where[name].info(name)

    def read(self, name: str) -> torch.Tensor:
        return self.where[name].read(name)


# ------------------------------------------------------------------ the adapter


@dataclass(frozen=True)
class LoraPair:
    a_key: str
    b_key: str
    scaling: float
    transpose: bool  # add (B @ A)^T: fan_in_fan_out layers and embeddings


@dataclass
class Change:
    """What the adapter does to one base tensor."""

    loras: list[LoraPair] = field(default_factory=list)
    replacement: str | None = None  # adapter key of a modules_to_save copy


def _truthy(value: Any) -> bool:
    return bool(value) and value != "none"


# adapter_config.json keys whose non-default values this merge cannot reproduce, and why.
UNSUPPORTED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("peft_type", lambda v: v not in (None, "LORA"), "only LoRA adapters are merged"),
    ("use_dora", _truthy, "DoRA rescales the merged weight per column; not merged here"),
    ("lora_bias", _truthy, "LoRA biases are not merged here"),
    ("bias", lambda v: v not in (None, "none"), "trained base biases are not merged here"),
    ("target_parameters", _truthy,
     "adapters on fused expert parameters (lora.targetExperts, or all-linear on a mixture-of-experts model) "
     "are not merged here"),
    ("trainable_token_indices", _truthy, "trainable tokens are not merged here"),
    ("layer_replication", _truthy, "replicated layers are not merged here"),
    ("alpha_pattern", _truthy, "per-module alphas are not merged here"),
    ("use_qalora", _truthy, "QA-LoRA is not merged here"),
    ("use_bdlora", _truthy, "BD-LoRA is not merged here"),
    ("ensure_weight_tying", _truthy, "peft's weight tying of modules_to_save is not merged here"),
    ("init_lora_weights", lambda v: v not in (None, True, False, "gaussian"),
     "this initialisation changes the base weights, which the base on disk does not have"),
    ("alora_invocation_tokens", _truthy, "activated LoRA is not merged here"),
    *((key, _truthy, f"{key} is not merged here") for key in
      ("arrow_config", "kasa_config", "monteclora_config", "velora_config", "megatron_config")),
)

_LINEAR = re.compile(r"(?P<module>.+)\.lora_A\.weight")
_EMBEDDING = re.compile(r"(?P<module>.+)\.lora_embedding_A")


class Adapter:
    """A peft LoRA adapter folder as the Trainer saved it, read into the changes it makes."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        try:
            self.config = json.loads((self.directory / ADAPTER_CONFIG).read_text())
            self.file = SafetensorsFile(self.directory / ADAPTER_WEIGHTS)
        except (OSError, ValueError) as exc:
            raise ExportError(f"the adapter in {self.directory} cannot be read: {exc}") from None
        for key, unsupported, why in UNSUPPORTED:
            if key in self.config and unsupported(self.config[key]):
                raise ExportError(f"{ADAPTER_CONFIG} {key}={self.config[key]!r}: {why}; the adapter stays in "
                                  f"{self.directory}")
        self.changes: dict[str, Change] = {}
        # Copies of frozen base layers peft saves beside an embedding adapter (shape-checked only).
        self.base_copies: dict[str, str] = {}
        self._read_keys()

    def _scaling(self, a_key: str) -> float:
        rank = self.file.info(a_key).shape[0]
        alpha = float(self.config["lora_alpha"])
        return alpha / math.sqrt(rank) if self.config.get("use_rslora") else alpha / rank

    def _change(self, base_name: str) -> Change:
        return self.changes.setdefault(base_name, Change())

    def _read_keys(self) -> None:
        names = set(self.file.tensors)
        used: set[str] = set()
        for key in sorted(names):
            if not key.startswith(PEFT_PREFIX):
                raise ExportError(f"adapter tensor {key!r} is not under {PEFT_PREFIX!r}: not a peft LoRA adapter")
            inner = key[len(PEFT_PREFIX):]
            if (m := _LINEAR.fullmatch(inner)) is not None:
                b_key = f"{PEFT_PREFIX}{m['module']}.lora_B.weight"
                transpose = bool(self.config.get("fan_in_fan_out"))
            elif (m := _EMBEDDING.fullmatch(inner)) is not None:
                b_key = f"{PEFT_PREFIX}{m['module']}.lora_embedding_B"
                transpose = True
            else:
                continue
            if b_key not in names:
                raise ExportError(f"adapter tensor {key!r} has no {b_key!r}")
            if len(self.file.info(key).shape) != 2:
                raise ExportError(f"adapter tensor {key!r} is {len(self.file.info(key).shape)}-D: only linear and "
                                  f"embedding adapters are merged here")
            self._change(f"{m['module']}.weight").loras.append(LoraPair(key, b_key, self._scaling(key), transpose))
            used |= {key, b_key}
        for key in sorted(names - used):
            inner = key[len(PEFT_PREFIX):]
            if re.search(r"\.lora_[A-Za-z_]+", inner):
                raise ExportError(f"adapter tensor {key!r} is of a LoRA variant not merged here")
            if ".base_layer." in inner:
                self.base_copies[inner.replace(".base_layer.", ".")] = key
                continue
            # modules_to_save: peft saves the trained copy under the base tensor's own name.
            change = self._change(inner)
            change.replacement = key

    def read(self, key: str) -> torch.Tensor:
        return self.file.read(key)

    def info(self, key: str) -> TensorInfo:
        return self.file.info(key)


# ------------------------------------------------------------------ the model's structure


def _model_skeleton(config_dir: Path, trust_remote_code: bool):
    """The model built on the meta device (no memory): which parameters are tied, which layers
    transformers' bitsandbytes integration quantises."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir, trust_remote_code=trust_remote_code, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return model


def tied_groups(model) -> list[list[str]]:
    """Parameter names that share one tensor (after the model's own tie_weights)."""
    by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    return [names for names in by_tensor.values() if len(names) > 1]


def quantised_weights(model) -> set[str]:
    """The weights transformers turns into bitsandbytes 4-bit layers when it loads this model for
    QLoRA (model_setup.load_model): its own rule (every nn.Linear and Conv1D but the output head,
    the tied and the keep-in-fp32 modules), asked of transformers itself."""
    try:
        from transformers.pytorch_utils import Conv1D
        from transformers.quantizers.base import HfQuantizer
        from transformers.quantizers.quantizers_utils import should_convert_module
    except ImportError as exc:
        raise ExportError(f"export merged of a qlora adapter needs transformers' quantizer helpers: {exc}") from None
    skip = HfQuantizer.get_modules_to_not_convert(model, None, getattr(model, "_keep_in_fp32_modules", None))
    return {f"{name}.weight" for name, module in model.named_modules()
            if (type(module) is torch.nn.Linear or isinstance(module, Conv1D)) and should_convert_module(name, skip)}


def nf4_roundtrip(compute_dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """W -> dequantise(quantise(W)) with the settings QLoRA trained with (model_setup.qlora_quantization:
    NF4, double quantisation, bitsandbytes' Linear4bit block size of 64), in the compute dtype."""
    try:
        import bitsandbytes.functional as bnb_functional
    except ImportError:
        raise ExportError("export merged of a qlora adapter needs the bitsandbytes package (to dequantise the "
                          "4-bit base it trained against), which this image lacks") from None

    def roundtrip(weight: torch.Tensor) -> torch.Tensor:
        packed, state = bnb_functional.quantize_4bit(weight.to(compute_dtype), blocksize=64, compress_statistics=True,
                                                     quant_type="nf4", quant_storage=torch.uint8)
        return bnb_functional.dequantize_4bit(packed, state).to(compute_dtype)

    return roundtrip


# ------------------------------------------------------------------ the plan


@dataclass
class ExportPlan:
    """Every output tensor with its source, change and shard, decided before anything is written."""

    infos: list[TensorInfo]
    sources: dict[str, str]  # output name -> the base tensor it starts from
    shards: list[list[TensorInfo]]
    untied: tuple[str, ...]


def plan_export(weights: WeightsFolder, adapter: Adapter | None, tied: list[list[str]], dtype: torch.dtype,
                max_shard_bytes: int) -> ExportPlan:
    changes = adapter.changes if adapter is not None else {}
    present = set(weights.names())
    aliases: dict[str, list[str]] = {}  # base tensor -> tied names the checkpoint does not store
    untied: list[str] = []
    for group in tied:
        stored = [n for n in group if n in present]
        if len(stored) != 1:
            continue  # every name stored (or none): written as stored
        source = stored[0]
        absent = [n for n in group if n != source]
        if any(n in changes for n in group):
            aliases[source] = absent
            untied += absent
    sources: dict[str, str] = {}
    for name in weights.names():
        sources[name] = name
        for alias in aliases.get(name, []):
            sources[alias] = name
    for name, change in changes.items():
        if name not in sources:
            raise ExportError(f"the adapter changes {name!r}, which the base checkpoint does not hold "
                              f"(its tensors are named like {weights.names()[:2]})")
        if change.replacement is not None and change.loras:
            raise ExportError(f"the adapter both replaces and adapts {name!r}")
        shape = weights.info(sources[name]).shape
        if change.replacement is not None and adapter.info(change.replacement).shape != shape:
            raise ExportError(f"adapter tensor {change.replacement!r} is {list(adapter.info(change.replacement).shape)}, "
                              f"the base's {name!r} {list(shape)}")
        for pair in change.loras:
            a, b = adapter.info(pair.a_key).shape, adapter.info(pair.b_key).shape
            delta = (a[1], b[0]) if pair.transpose else (b[0], a[1])
            if b[1] != a[0] or delta != shape:
                raise ExportError(f"adapter {pair.a_key!r} {list(a)} and {pair.b_key!r} {list(b)} do not fit the "
                                  f"base's {name!r} {list(shape)}")
    if adapter is not None:
        for name, key in adapter.base_copies.items():
            if name in sources and adapter.info(key).shape != weights.info(sources[name]).shape:
                raise ExportError(f"adapter tensor {key!r} is {list(adapter.info(key).shape)}, the base's {name!r} "
                                  f"{list(weights.info(sources[name]).shape)} (a resized vocabulary is not merged)")
    infos = []
    for name, source in sources.items():
        stored = weights.info(source)
        infos.append(TensorInfo(name, dtype if stored.dtype.is_floating_point else stored.dtype, stored.shape))
    shards: list[list[TensorInfo]] = [[]]
    size = 0
    for info in infos:
        # One tensor larger than a shard gets a shard of its own (as transformers shards).
        if shards[-1] and size + info.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(info)
        size += info.nbytes
    return ExportPlan(infos, sources, shards, tuple(untied))


# ------------------------------------------------------------------ writing


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class _Producer:
    """Makes each output tensor from its source, one at a time."""

    def __init__(self, weights: WeightsFolder, adapter: Adapter | None, plan: ExportPlan,
                 roundtrip: Callable[[torch.Tensor], torch.Tensor] | None, quantised: set[str]):
        self.weights, self.adapter, self.plan = weights, adapter, plan
        self.roundtrip, self.quantised = roundtrip, quantised
        self.changes = adapter.changes if adapter is not None else {}
        self.peak_rss = _rss_bytes()

    def tensor(self, info: TensorInfo) -> torch.Tensor:
        change = self.changes.get(info.name)
        source = self.plan.sources[info.name]
        if change is not None and change.replacement is not None:
            tensor = self.adapter.read(change.replacement)
        else:
            tensor = self.weights.read(source)
            if self.roundtrip is not None and source in self.quantised:
                tensor = self.roundtrip(tensor)
        if change is not None and change.loras:
            work = tensor.to(torch.float32, copy=True)
            del tensor  # one copy of the weight at a time: the fp32 one
            for pair in change.loras:
                a = self.adapter.read(pair.a_key).to(torch.float32)
                b = self.adapter.read(pair.b_key).to(torch.float32)
                if pair.transpose:
                    work.addmm_(a.T, b.T, alpha=pair.scaling)
                else:
                    work.addmm_(b, a, alpha=pair.scaling)
            tensor = work
        out = tensor.to(info.dtype)
        self.peak_rss = max(self.peak_rss, _rss_bytes())
        return out

    def stream(self, infos: list[TensorInfo]):
        for info in infos:
            yield self.tensor(info)
            self.peak_rss = max(self.peak_rss, _rss_bytes())


def shard_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def export_config(config_dir: Path, dtype: torch.dtype, untied: bool) -> dict[str, Any]:
    """The base's config.json for the exported weights."""
    config = json.loads((config_dir / "config.json").read_text())
    dtype_name = str(dtype).removeprefix("torch.")
    # Newer transformers write "dtype", older (and the serving stacks built on them) read "torch_dtype".
    for key in ("dtype", "torch_dtype"):
        if key in config or key == "torch_dtype":
            config[key] = dtype_name
    config.pop("quantization_config", None)
    if untied:
        config["tie_word_embeddings"] = False
        for sub in ("text_config",):
            if isinstance(config.get(sub), dict) and "tie_word_embeddings" in config[sub]:
                config[sub]["tie_word_embeddings"] = False
    config["use_cache"] = True  # training turns the KV cache off (model_setup); serving needs it
    return config


def _copy_tokenizer(tokenizer_dir: Path, target: Path) -> None:
    copied = [name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()]
    copied += [p.name for p in tokenizer_dir.glob("*.tiktoken") if p.is_file()]
    if not any(name in copied for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
        raise ExportError(f"the tokenizer folder {tokenizer_dir} holds no tokenizer files to export")
    for name in copied:
        shutil.copyfile(tokenizer_dir / name, target / name)


def clean_staging(output: Path) -> None:
    """Remove what an export that died left (a staging folder, or an old export being replaced)."""
    if output.is_dir():
        for entry in output.iterdir():
            if entry.is_dir() and re.fullmatch(r"\.(merged|full)\.(staging|old)-\d+", entry.name):
                shutil.rmtree(entry, ignore_errors=True)


def export_folder(*, kind: str, output: str | Path, base: str | Path, tokenizer: str | Path,
                  dtype: torch.dtype, qlora: bool = False, trust_remote_code: bool = False,
                  max_shard_bytes: int = MAX_SHARD_BYTES) -> ExportResult:
    """Write `<output>/<kind>` (merged: base + the adapter in `output`; full: the weights in `output`)."""
    if kind not in ("merged", "full"):
        raise ValueError(f"export {kind!r} writes no folder")
    started = time.time()
    output, base, tokenizer = Path(output), Path(base), Path(tokenizer)
    clean_staging(output)
    staging = output / f".{kind}.staging-{os.getpid()}"
    final = output / kind
    try:
        adapter = Adapter(output) if kind == "merged" else None
        weights = WeightsFolder(base if kind == "merged" else output,
                                "the base model" if kind == "merged" else "the trained weights in")
        base_config = json.loads((base / "config.json").read_text())
        if kind == "merged" and base_config.get("quantization_config"):
            raise ExportError(f"the base {base} is stored quantised (config.json quantization_config): merging into "
                              f"pre-quantised weights is not supported; give the 16-bit base")
        skeleton = _model_skeleton(base, trust_remote_code)
        roundtrip, quantised = None, set()
        if qlora and kind == "merged":
            roundtrip, quantised = nf4_roundtrip(dtype), quantised_weights(skeleton)
        plan = plan_export(weights, adapter, tied_groups(skeleton), dtype, max_shard_bytes)
        del skeleton
        producer = _Producer(weights, adapter, plan, roundtrip, quantised)
        staging.mkdir(parents=True)
        weight_map = {}
        count = len(plan.shards)
        for number, infos in enumerate(plan.shards, start=1):
            name = shard_name(number, count)
            write_file(staging / name, infos, producer.stream(infos), SAFETENSORS_METADATA)
            weight_map.update({info.name: name for info in infos})
        total = sum(info.nbytes for info in plan.infos)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (staging / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        config = export_config(base, dtype, bool(plan.untied))
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if (base / "generation_config.json").is_file():
            shutil.copyfile(base / "generation_config.json", staging / "generation_config.json")
        _copy_tokenizer(tokenizer, staging)
        fsync_dir(staging)
        # Publish: the finished folder replaces an earlier attempt's in two renames, so a reader
        # sees the old folder, none, or the new one, never half of one.
        old = output / f".{kind}.old-{os.getpid()}"
        if final.exists():
            os.rename(final, old)
        os.rename(staging, final)
        fsync_dir(output)
        shutil.rmtree(old, ignore_errors=True)
    except ExportError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    except (OSError, ValueError, KeyError, FormatError) as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise ExportError(f"export {kind} into {final} failed: {type(exc).__name__}: {exc}") from exc
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ExportResult(kind=kind, directory=str(final), shards=count, tensors=len(plan.infos), total_bytes=total,
                        seconds=round(time.time() - started, 3), peak_rss_bytes=producer.peak_rss,
                        untied=plan.untied)


def export_after_training(cfg) -> ExportResult | None:
    """The job's export, on rank 0 after the final save (run.main); None for `adapter`."""
    from .model_setup import compute_dtype

    if cfg.export_kind == "adapter":
        return None
    return export_folder(kind=cfg.export_kind, output=cfg.output_directory, base=cfg.model.path,
                         tokenizer=cfg.model.tokenizer_path or cfg.model.path, dtype=compute_dtype(cfg),
                         qlora=cfg.method == "qlora", trust_remote_code=cfg.model.trust_remote_code)
