"""A table of invalid FineTuneJobs: each is rejected with a message that names the field.

Each case breaks one thing in an otherwise valid job. `schema` says whether the CRD's
OpenAPI schema alone (types, enums, bounds, patterns, required) must also reject it;
the cross-field rules are CEL in the CRD and are checked against a real API server in
the e2e suite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jsonschema
import pytest

from finetune_operator import api, crd

Doc = dict[str, Any]


@dataclass(frozen=True)
class Case:
    id: str
    mutate: Callable[[Doc], None]
    path: str  # the field path the error must name
    says: str  # a phrase the message must contain (case-insensitive)
    schema: bool  # must the CRD's OpenAPI schema (without CEL) reject it too? (auto|int fields are CEL-checked)


def _set(path: str, value: Any) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        *parents, last = path.split(".")
        node = doc
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value

    return mutate


def _delete(path: str) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        *parents, last = path.split(".")
        node = doc
        for key in parents:
            node = node[key]
        del node[last]

    return mutate


def _both(*mutations: Callable[[Doc], None]) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        for m in mutations:
            m(doc)

    return mutate


CASES = [
    # wrong types
    Case("seq-as-string", _set("spec.training.sequenceLength", "long"), "spec.training.sequenceLength", "integer", True),
    Case("batch-as-float", _set("spec.training.globalBatchSize", 3.5), "spec.training.globalBatchSize", "integer", True),
    Case("regions-as-string", _set("spec.placement.regions", "eu-de-berlin"), "spec.placement.regions", "list", True),
    Case("suspend-as-string", _set("spec.suspend", "yes"), "spec.suspend", "bool", True),
    Case("lora-as-list", _set("spec.lora", [16]), "spec.lora", "dictionary", True),
    Case("gpus-bad-string", _set("spec.resources.gpus", "many"), "spec.resources.gpus", "auto", False),
    Case("micro-bad-string", _set("spec.training.microBatchSize", "max"), "spec.training.microBatchSize", "auto", False),
    # negative and huge numbers
    Case("negative-seq", _set("spec.training.sequenceLength", -1), "spec.training.sequenceLength", "greater than", True),
    Case("huge-seq", _set("spec.training.sequenceLength", 10**9), "spec.training.sequenceLength", "less than", True),
    Case("zero-batch", _set("spec.training.globalBatchSize", 0), "spec.training.globalBatchSize", "greater than", True),
    Case("negative-gpus", _set("spec.resources.gpus", -2), "spec.resources.gpus", "greater than", False),
    Case("huge-gpus", _set("spec.resources.maxGPUs", 10**7), "spec.resources.maxGPUs", "less than", True),
    Case("zero-lr", _set("spec.training.learningRate", 0), "spec.training.learningRate", "greater than", True),
    Case("lora-rank-zero", _set("spec.lora.rank", 0), "spec.lora.rank", "greater than", True),
    Case("dropout-one", _set("spec.lora.dropout", 1.0), "spec.lora.dropout", "less than", True),
    Case("headroom-huge", _set("spec.resources.memoryHeadroom", 0.9), "spec.resources.memoryHeadroom", "less than", True),
    Case("attempts-zero", _set("spec.recovery.maxAttempts", 0), "spec.recovery.maxAttempts", "greater than", True),
    # unknown enum values
    Case("method-unknown", _set("spec.method", "dora"), "spec.method", "'full', 'lora' or 'qlora'", True),
    Case("strategy-unknown", _set("spec.resources.strategy", "zero4"), "spec.resources.strategy", "zero3", True),
    Case("precision-unknown", _set("spec.training.precision", "fp8"), "spec.training.precision", "bf16", True),
    Case("optimizer-unknown", _set("spec.training.optimizer", "sgd"), "spec.training.optimizer", "adamw", True),
    Case("format-unknown", _set("spec.dataset.format", "csv"), "spec.dataset.format", "chat", True),
    Case("offload-unknown", _set("spec.resources.offload", "disk"), "spec.resources.offload", "optimizer", True),
    Case("adjustment-unknown", _set("spec.recovery.allowedAdjustments", ["prayer"]), "spec.recovery.allowedAdjustments[0]", "method", True),
    # A whole config.json is accepted (issue 16): another family is sized by the profile, not refused;
    # the keys that decide memory are still typed, and one a family needs is named when missing.
    Case("model-type-not-a-name", _set("spec.model.architecture", {"inline": {"model_type": "gpt 2", "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 8}}), "spec.model.architecture.inline.model_type", "pattern", True),
    Case("inline-hidden-size-string", _set("spec.model.architecture", {"inline": {"model_type": "qwen3", "hidden_size": "4096", "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 8}}), "spec.model.architecture.inline.hidden_size", "integer", True),
    Case("inline-text-config-heads-string", _set("spec.model.architecture", {"inline": {"model_type": "gemma3", "text_config": {"hidden_size": 64, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": "4"}}}), "spec.model.architecture.inline.text_config.num_attention_heads", "integer", True),
    Case("inline-text-config-missing-layers", _set("spec.model.architecture", {"inline": {"model_type": "gemma3", "text_config": {"hidden_size": 64, "intermediate_size": 8, "num_attention_heads": 4}}}), "spec.model.architecture.inline", "text_config.num_hidden_layers: missing", False),
    # missing required fields
    Case("missing-model", _delete("spec.model"), "spec.model", "required", True),
    Case("missing-placement", _delete("spec.placement"), "spec.placement", "required", True),
    Case("missing-method", _delete("spec.method"), "spec.method", "required", True),
    Case("missing-claim", _delete("spec.dataset.source.pvc.claimName"), "spec.dataset.source.pvc.claimName", "required", True),
    Case("missing-spec", _delete("spec"), "spec", "required", True),
    # unknown fields
    Case("unknown-spec-field", _set("spec.gpuCount", 4), "spec.gpuCount", "unknown field", False),
    Case("unknown-training-field", _set("spec.training.batchSize", 4), "spec.training.batchSize", "unknown field", False),
    # num_layers is no config.json key of Llama: kept like any other key, and the real one is named as missing.
    Case("typo-in-inline-arch", _set("spec.model.architecture", {"inline": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 100, "num_layers": 2}}), "spec.model.architecture.inline", "num_hidden_layers: missing", False),
    # conflicting fields
    Case("full-with-lora", _set("spec.method", "full"), "spec.lora", "not allowed with method full", False),
    Case("qlora-without-lora", _both(_set("spec.method", "qlora"), _delete("spec.lora")), "spec.lora", "required for method qlora", False),
    Case("qlora-fp32", _both(_set("spec.method", "qlora"), _set("spec.training.precision", "fp32")), "spec.training.precision", "fp32 is not allowed", False),
    Case("batch-not-multiple-of-micro", _set("spec.training.microBatchSize", 3), "spec.training.globalBatchSize", "multiple of microBatchSize", False),
    Case("batch-not-multiple-of-micro-x-gpus", _both(_set("spec.training.microBatchSize", 4), _set("spec.resources.gpus", 3)), "spec.training.globalBatchSize", "microBatchSize x gpus", False),
    Case("max-gpus-below-gpus", _both(_set("spec.resources.gpus", 8), _set("spec.resources.maxGPUs", 4)), "spec.resources.maxGPUs", "at least gpus", False),
    Case("steps-and-epochs", _set("spec.training.epochs", 2), "spec.training", "exactly one of maxSteps, epochs", False),
    Case("neither-steps-nor-epochs", _delete("spec.training.maxSteps"), "spec.training", "exactly one of maxSteps, epochs", False),
    Case("ddp-with-offload", _both(_set("spec.resources.strategy", "ddp"), _set("spec.resources.offload", "optimizer")), "spec.resources.offload", "sharded strategy", False),
    Case("zero2-offload-params", _both(_set("spec.resources.strategy", "zero2"), _set("spec.resources.offload", "optimizer+params")), "spec.resources.offload", "fsdp or zero3", False),
    Case("fsdp-offload-optimizer-only", _both(_set("spec.resources.strategy", "fsdp"), _set("spec.resources.offload", "optimizer")), "spec.resources.offload", "optimizer+params", False),
    Case("qlora-with-zero2", _both(_set("spec.method", "qlora"), _set("spec.resources.strategy", "zero2")), "spec.resources.strategy", "zero3", False),
    Case("modules-to-save-with-fsdp", _both(_set("spec.lora.modulesToSave", ["lm_head"]), _set("spec.resources.strategy", "fsdp")), "spec.resources.strategy", "modulesToSave runs with ddp, zero1 or zero2", False),
    Case("module-saved-and-adapted", _both(_set("spec.lora.targetModules", ["q_proj", "lm_head"]), _set("spec.lora.modulesToSave", ["lm_head"])), "spec.lora.modulesToSave", "adapted (targetModules) or trained in full", False),
    # the lean-trainer levers (combinations.py)
    Case("bf16-master-with-lora", _set("spec.training.masterWeights", "bf16"), "spec.training.masterWeights", "adapters always train in fp32", False),
    Case("kahan-with-fp32-master", _both(_set("spec.method", "full"), _delete("spec.lora"), _set("spec.training.masterWeights", "fp32"), _set("spec.training.updateRounding", "kahan")), "spec.training.updateRounding", "need bf16 master weights", False),
    Case("optimizer-in-backward-with-accumulation", _both(_set("spec.training.optimizerInBackward", True), _set("spec.training.microBatchSize", 1), _set("spec.resources.gpus", 1)), "spec.training.optimizerInBackward", "gradient accumulation 1", False),
    Case("optimizer-in-backward-with-zero", _both(_set("spec.training.optimizerInBackward", True), _set("spec.resources.strategy", "zero2")), "spec.training.optimizerInBackward", "ddp or fsdp", False),
    Case("activation-offloading-without-checkpointing", _both(_set("spec.training.activationOffloading", True), _set("spec.training.gradientCheckpointing", False)), "spec.training.activationOffloading", "needs gradient checkpointing", False),
    Case("loss-chunks-zero", _set("spec.training.lossChunks", 0), "spec.training.lossChunks", "auto", False),
    Case("two-model-sources", _set("spec.model.source.s3", {"endpoint": "https://s3.example", "bucket": "models", "credentialsSecretRef": {"name": "s3"}}), "spec.model.source", "exactly one of pvc, s3, hf", False),
    Case("two-data-sources", _set("spec.dataset.source.s3", {"endpoint": "https://s3.example", "bucket": "data", "credentialsSecretRef": {"name": "s3"}}), "spec.dataset.source", "exactly one of pvc, s3", False),
    Case("two-architectures", _set("spec.model.architecture.configMapRef", {"name": "cfg"}), "spec.model.architecture", "exactly one of preset, inline, configMapRef", False),
    Case("all-linear-with-names", _set("spec.lora.targetModules", ["all-linear", "q_proj"]), "spec.lora.targetModules", "stands alone", False),
    Case("duplicate-regions", _set("spec.placement.regions", ["eu-de-berlin", "eu-de-berlin"]), "spec.placement.regions", "unique", False),
    Case("heads-not-dividing-hidden", _set("spec.model.architecture", {"inline": {"model_type": "llama", "hidden_size": 100, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 3, "vocab_size": 100}}), "spec.model.architecture.inline", "do not divide hidden_size", False),
    # empty and malformed values
    Case("empty-regions", _set("spec.placement.regions", []), "spec.placement.regions", "at least 1", True),
    Case("region-with-space", _set("spec.placement.regions", ["eu de"]), "spec.placement.regions[0]", "pattern", True),
    Case("path-escapes-volume", _set("spec.dataset.source.pvc.path", "data/../../etc"), "spec.dataset.source.pvc.path", "'..'", False),
    Case("absolute-path", _set("spec.dataset.source.pvc.path", "/etc/passwd"), "spec.dataset.source.pvc.path", "pattern", True),
    # uri sources are refused as not supported yet (gs://, https://, and s3:// without an endpoint): CEL in the CRD
    Case("model-uri-unsupported", _both(_delete("spec.model.source.pvc"), _set("spec.model.source.uri", "gs://x/y")), "spec.model.source.uri", "not supported yet", False),
    Case("data-uri-unsupported", _set("spec.dataset.source", {"uri": "https://example.com/train.jsonl"}), "spec.dataset.source.uri", "not supported yet", False),
    Case("output-uri-unsupported", _set("spec.output", {"uri": "s3://bucket/out"}), "spec.output.uri", "not supported yet", False),
    # S3 locations
    Case("s3-endpoint-with-path", _set("spec.dataset.source", {"s3": {"endpoint": "https://s3.example/bucket", "bucket": "data", "credentialsSecretRef": {"name": "s3"}}}), "spec.dataset.source.s3.endpoint", "pattern", True),
    Case("s3-endpoint-ftp", _set("spec.dataset.source", {"s3": {"endpoint": "ftp://s3.example", "bucket": "data", "credentialsSecretRef": {"name": "s3"}}}), "spec.dataset.source.s3.endpoint", "pattern", True),
    Case("s3-bucket-upper-case", _set("spec.dataset.source", {"s3": {"endpoint": "https://s3.example", "bucket": "Data", "credentialsSecretRef": {"name": "s3"}}}), "spec.dataset.source.s3.bucket", "pattern", True),
    Case("s3-key-absolute", _set("spec.dataset.source", {"s3": {"endpoint": "https://s3.example", "bucket": "data", "key": "/etc/x", "credentialsSecretRef": {"name": "s3"}}}), "spec.dataset.source.s3.key", "must not start with '/'", True),
    Case("s3-key-escape", _set("spec.dataset.source", {"s3": {"endpoint": "https://s3.example", "bucket": "data", "key": "a\x1b[2Jb", "credentialsSecretRef": {"name": "s3"}}}), "spec.dataset.source.s3.key", "control characters", True),
    Case("s3-key-parent", _set("spec.dataset.source", {"s3": {"endpoint": "https://s3.example", "bucket": "data", "key": "a/../b", "credentialsSecretRef": {"name": "s3"}}}), "spec.dataset.source.s3.key", "'..'", False),
    Case("s3-without-credentials", _set("spec.output", {"s3": {"endpoint": "https://s3.example", "bucket": "out"}}), "spec.output.s3.credentialsSecretRef", "required", True),
    Case("s3-secret-key-invalid", _set("spec.output", {"s3": {"endpoint": "https://s3.example", "bucket": "out", "credentialsSecretRef": {"name": "s3", "accessKeyIdKey": "access key"}}}), "spec.output.s3.credentialsSecretRef.accessKeyIdKey", "pattern", True),
    Case("hf-without-revision", _set("spec.model.source", {"hf": {"repo": "meta-llama/Llama-3.1-8B"}}), "spec.model.source.hf.revision", "required", True),
    Case("queue-name-invalid", _set("spec.queueName", "team a/queue"), "spec.queueName", "pattern", True),
    # text that reaches terminals and command lines
    Case("model-name-newline", _set("spec.model.name", "Llama\nfake-row Succeeded"), "spec.model.name", "printable", True),
    Case("model-name-trailing-newline", _set("spec.model.name", "Llama\n"), "spec.model.name", "line breaks", False),
    Case("model-name-escape", _set("spec.model.name", "\x1b[2J\x1b[31mLlama"), "spec.model.name", "escape", True),
    Case("model-name-c1-csi", _set("spec.model.name", "Llama\x9b31m"), "spec.model.name", "control characters", True),
    Case("model-name-tab", _set("spec.model.name", "Llama\t8B"), "spec.model.name", "tabs", True),
    Case("hf-revision-option", _set("spec.model.source", {"hf": {"repo": "meta-llama/Llama-3.1-8B", "revision": "--local-dir=/etc"}}),
         "spec.model.source.hf.revision", "leading '-'", True),
    Case("hf-revision-space", _set("spec.model.source", {"hf": {"repo": "meta-llama/Llama-3.1-8B", "revision": "main --force"}}),
         "spec.model.source.hf.revision", "commit hash, tag or branch", True),
    Case("checkpoint-read-only", _set("spec.checkpoint", {"pvc": {"claimName": "ckpt", "readOnly": True}}),
         "spec.checkpoint.pvc.readOnly", "unknown field", False),
    Case("output-read-only", _set("spec.output", {"pvc": {"claimName": "out", "readOnly": False}}),
         "spec.output.pvc.readOnly", "unknown field", False),
    # names that are not DNS-1123
    Case("name-upper-case", _set("metadata.name", "Support-Bot"), "metadata.name", "DNS-1123", False),
    Case("name-underscore", _set("metadata.name", "support_bot"), "metadata.name", "DNS-1123", False),
    Case("name-trailing-dash", _set("metadata.name", "support-"), "metadata.name", "DNS-1123", False),
    Case("claim-name-invalid", _set("spec.checkpoint", {"pvc": {"claimName": "Ckpt!"}}), "spec.checkpoint.pvc.claimName", "pattern", True),
    Case("wrong-api-version", _set("apiVersion", "finetune.dev/v1"), "apiVersion", "finetune.dev/v1alpha1", False),
    # spec.evaluation: a held-out fraction or a separate eval dataset, never both
    Case("eval-fraction-too-large", _set("spec.evaluation", {"heldOutFraction": 0.6}),
         "spec.evaluation.heldOutFraction", "less than or equal to 0.5", True),
    Case("eval-fraction-zero", _set("spec.evaluation", {"heldOutFraction": 0.0}),
         "spec.evaluation.heldOutFraction", "greater than 0", True),
    Case("eval-without-source", _set("spec.evaluation", {"everySteps": 10}),
         "spec.evaluation.heldOutFraction", "exactly one of heldOutFraction, dataset", False),
    Case("eval-both-sources", _set("spec.evaluation", {"heldOutFraction": 0.1, "dataset": {"pvc": {"claimName": "e"}}}),
         "spec.evaluation.heldOutFraction", "exactly one of heldOutFraction, dataset", False),
    Case("eval-dataset-two-places", _set("spec.evaluation", {"dataset": {
         "pvc": {"claimName": "e"}, "s3": {"endpoint": "https://s3.x", "bucket": "evals", "key": "k",
                                           "credentialsSecretRef": {"name": "s"}}}}),
         "spec.evaluation.dataset", "exactly one of pvc, s3", False),
    Case("eval-early-stopping-without-cadence", _set("spec.evaluation", {"heldOutFraction": 0.1,
                                                                         "earlyStopping": {"patience": 2}}),
         "spec.evaluation.earlyStopping", "needs everySteps", False),
    Case("eval-patience-zero", _set("spec.evaluation", {"heldOutFraction": 0.1, "everySteps": 5,
                                                        "earlyStopping": {"patience": 0}}),
         "spec.evaluation.earlyStopping.patience", "greater than or equal to 1", True),
    Case("eval-keep-best-without-checkpoint", _set("spec.evaluation", {"heldOutFraction": 0.1, "keepBest": True}),
         "spec.evaluation.keepBest", "needs checkpoint", False),
    Case("eval-micro-batch-zero", _set("spec.evaluation", {"heldOutFraction": 0.1, "microBatchSize": 0}),
         "spec.evaluation.microBatchSize", "greater than or equal to 1", True),
    Case("eval-every-zero", _set("spec.evaluation", {"heldOutFraction": 0.1, "everySteps": 0}),
         "spec.evaluation.everySteps", "greater than or equal to 1", True),
    # spec.export: adapter | merged | full, each only with the methods it fits
    Case("export-unknown", _set("spec.export", "gguf"), "spec.export", "'adapter', 'merged' or 'full'", True),
    Case("export-merged-with-full", _both(_set("spec.method", "full"), _delete("spec.lora"), _set("spec.export", "merged")),
         "spec.export", "needs method lora or qlora", False),
    Case("export-full-with-lora", _set("spec.export", "full"), "spec.export", "needs method full", False),
    Case("export-full-with-qlora", _both(_set("spec.method", "qlora"), _set("spec.export", "full")),
         "spec.export", "needs method full", False),
    # spec.dataset's batching (issue 28)
    Case("packing-and-padding-free", _both(_set("spec.dataset.packing", True), _set("spec.dataset.paddingFree", True)),
         "spec.dataset.paddingFree", "at most one of packing, paddingFree", False),
    Case("micro-batch-tokens-with-packing", _both(_set("spec.dataset.packing", True),
                                                  _set("spec.dataset.microBatchTokens", [900, 1700])),
         "spec.dataset.microBatchTokens", "sizes unpacked examples", False),
    Case("micro-batch-tokens-zero", _set("spec.dataset.microBatchTokens", [0, 900]), "spec.dataset.microBatchTokens[0]",
         "greater than", True),
    Case("micro-batch-tokens-empty", _set("spec.dataset.microBatchTokens", []), "spec.dataset.microBatchTokens",
         "at least 1", True),
    Case("micro-batch-tokens-decreasing", _set("spec.dataset.microBatchTokens", [900, 800]),
         "spec.dataset.microBatchTokens", "must not decrease", False),
]


def test_the_table_is_big_enough():
    assert len(CASES) >= 30
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_rejected_with_the_field_named(case: Case, lora_job: Doc):
    case.mutate(lora_job)
    with pytest.raises(api.JobValidationError) as caught:
        api.parse_job(lora_job)
    problems = caught.value.problems
    named = [p for p in problems if p.path == case.path]
    assert named, f"no problem names {case.path}; got {[str(p) for p in problems]}"
    assert any(case.says.lower() in p.message.lower() for p in named), [str(p) for p in named]


@pytest.mark.parametrize("case", [c for c in CASES if c.schema], ids=lambda c: c.id)
def test_schema_rejects_too(case: Case, lora_job: Doc):
    case.mutate(lora_job)
    validator = jsonschema.Draft4Validator(crd.openapi_schema())
    errors = list(validator.iter_errors(lora_job))
    assert errors, f"the CRD schema accepts {case.id}"


def test_the_valid_base_job_is_valid(lora_job: Doc):
    job = api.parse_job(lora_job)
    assert job.spec.lora.target_modules == ["all-linear"]
    assert job.spec.resources.gpus == "auto"


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.1-8B-Instruct", "Qwen2.5 7B (Instruct) @ v2", "Modèle-FR ünï"])
@pytest.mark.parametrize("revision", ["main", "v1.0", "refs/pr/12", "0a1b2c3d4e5f", "release_2024-01+fix"])
def test_ordinary_names_and_revisions_pass(lora_job: Doc, name: str, revision: str):
    lora_job["spec"]["model"]["name"] = name
    lora_job["spec"]["model"]["source"] = {"hf": {"repo": "meta-llama/Llama-3.1-8B", "revision": revision}}
    job = api.parse_job(lora_job)
    assert (job.spec.model.name, job.spec.model.source.hf.revision) == (name, revision)
    errors = list(jsonschema.Draft4Validator(crd.openapi_schema()).iter_errors(lora_job))
    assert not errors, [e.message for e in errors]


def test_not_a_mapping():
    with pytest.raises(api.JobValidationError) as caught:
        api.parse_job(["not", "a", "job"])  # type: ignore[arg-type]
    assert "mapping" in str(caught.value)


def test_parse_spec_prefixes_paths(lora_job: Doc):
    spec = lora_job["spec"]
    spec["training"]["sequenceLength"] = -5
    with pytest.raises(api.JobValidationError) as caught:
        api.parse_spec(spec)
    assert caught.value.problems[0].path == "spec.training.sequenceLength"
