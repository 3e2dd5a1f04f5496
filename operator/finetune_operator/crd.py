"""Generate the FineTuneJob CustomResourceDefinition from the pydantic models.

Kubernetes wants a *structural* OpenAPI v3 schema: no `$ref`, a `type` on every node,
`anyOf` only in the int-or-string form, `exclusiveMinimum` as a boolean beside `minimum`.
pydantic emits JSON Schema 2020-12, so this module inlines references, drops what
Kubernetes does not accept (titles, `additionalProperties: false`, null branches of
optional fields) and translates the rest. `crds/finetunejob.yaml` is this module's output;
`tests/test_crd.py` fails when they drift.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from . import api

# A column is one JSONPath, no logic: `Reason` reads `status.reason`, which the operator keeps as the
# reason of the condition that matters now (summary.status_reason). Priority 1: only with `-o wide`.
PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Lifecycle phase"},
    {"name": "Reason", "type": "string", "jsonPath": ".status.reason",
     "description": "Why the job is in its phase: the reason of the condition that matters now"},
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name", "description": "Model being fine-tuned"},
    {"name": "Method", "type": "string", "jsonPath": ".spec.method", "description": "full, lora or qlora"},
    {"name": "GPUs", "type": "integer", "jsonPath": ".status.plan.gpus", "description": "GPUs of the current plan"},
    {"name": "Pool", "type": "string", "jsonPath": ".status.plan.nodePool", "description": "Node pool of the current plan"},
    {"name": "Region", "type": "string", "jsonPath": ".status.plan.region", "description": "Region of the current plan"},
    {"name": "Attempt", "type": "integer", "jsonPath": ".status.currentAttempt", "description": "Current attempt"},
    # status.progress.summary is "step/totalSteps (percent%)", written with the figures (a column cannot compute).
    {"name": "Progress", "type": "string", "jsonPath": ".status.progress.summary",
     "description": "Optimizer steps done of the current attempt's total, from the trainer's log"},
    {"name": "Strategy", "type": "string", "jsonPath": ".status.plan.strategy", "priority": 1,
     "description": "Strategy of the current plan: ddp, fsdp, zero1, zero2 or zero3"},
    {"name": "Predicted", "type": "string", "jsonPath": ".status.plan.predictedPeak", "priority": 1,
     "description": "Predicted peak GPU memory per GPU of the current plan"},
    {"name": "GPU Memory", "type": "string", "jsonPath": ".status.plan.gpuMemory", "priority": 1,
     "description": "GPU memory per GPU of the plan's GPU type"},
    {"name": "Loss", "type": "number", "jsonPath": ".status.progress.loss", "priority": 1,
     "description": "Training loss at the last step read from the trainer's log"},
    {"name": "Eval Loss", "type": "number", "jsonPath": ".status.progress.evalLoss", "priority": 1,
     "description": "Loss on the held-out split at its last evaluation (spec.evaluation)"},
    {"name": "ETA", "type": "string", "jsonPath": ".status.progress.eta", "priority": 1,
     "description": "When training should reach its last step at the current rate"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

# Keys of JSON Schema that Kubernetes' structural schema accepts and we keep as they are.
_KEPT_KEYS = {
    "type",
    "description",
    "enum",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "pattern",
    "format",
    "required",
    "default",
    "x-kubernetes-validations",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-map-type",
    "nullable",
}


class _Converter:
    def __init__(self, definitions: dict[str, Any]) -> None:
        self.definitions = definitions

    def _deref(self, node: dict[str, Any]) -> dict[str, Any]:
        """Inline a `$ref` (keeping sibling keys such as the field's own description)."""
        if "$ref" not in node:
            return node
        name = node["$ref"].rsplit("/", 1)[-1]
        target = copy.deepcopy(self.definitions[name])
        siblings = {k: v for k, v in node.items() if k != "$ref"}
        target.update(siblings)
        return self._deref(target)

    def convert(self, node: dict[str, Any], *, keep_defaults: bool = True) -> dict[str, Any]:
        node = self._deref(node)
        if "allOf" in node and len(node["allOf"]) == 1:
            merged = self._deref(node["allOf"][0])
            merged.update({k: v for k, v in node.items() if k != "allOf"})
            node = merged

        # Optional[X]: drop the null branch; absence already means "not set".
        if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
            branches = [b for b in node["anyOf"] if b.get("type") != "null"]
            if len(branches) != 1:
                raise ValueError(f"union not expressible in a structural schema: {node['anyOf']}")
            merged = self._deref(branches[0])
            merged.update({k: v for k, v in node.items() if k != "anyOf"})
            if merged.get("default", "unset") is None:
                del merged["default"]
            return self.convert(merged, keep_defaults=keep_defaults)

        out: dict[str, Any] = {}
        if node.get("x-kubernetes-int-or-string"):
            out["x-kubernetes-int-or-string"] = True
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        if "const" in node:
            out["enum"] = [node["const"]]
        for key, value in node.items():
            if key in _KEPT_KEYS:
                out[key] = copy.deepcopy(value)
        if api.ACCEPTS_KEY in node:
            # kubectl explain calls an int-or-string field <Object>: the description says what it takes.
            described = (out.get("description") or "").rstrip()
            out["description"] = f"{described}\nAccepts {node[api.ACCEPTS_KEY]}.".lstrip()
        if "exclusiveMinimum" in node:
            out["minimum"] = node["exclusiveMinimum"]
            out["exclusiveMinimum"] = True
        if "exclusiveMaximum" in node:
            out["maximum"] = node["exclusiveMaximum"]
            out["exclusiveMaximum"] = True
        if "enum" in out and "type" not in out:
            out["type"] = "string"

        if node.get("type") == "object" or "properties" in node:
            out["type"] = "object"
            props = node.get("properties") or {}
            if props:
                out["properties"] = {
                    name: self.convert(child, keep_defaults=keep_defaults) for name, child in props.items()
                }
            extra = node.get("additionalProperties")
            if isinstance(extra, dict) and not props:
                out["additionalProperties"] = self.convert(extra, keep_defaults=keep_defaults)
            elif not props and extra is not False and "x-kubernetes-preserve-unknown-fields" not in out:
                out["x-kubernetes-preserve-unknown-fields"] = True
        if node.get("type") == "array":
            out["items"] = self.convert(node["items"], keep_defaults=keep_defaults)

        if "default" in out:
            if not keep_defaults:
                del out["default"]
            elif isinstance(out["default"], dict):
                # The whole default object, spelled out: the API server checks a default
                # against the CEL rules as it is, without filling its nested defaults first.
                out["default"] = _without_nulls(out["default"])
        if "required" in out and not out["required"]:
            del out["required"]
        return _ordered(out)


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


_FIRST_KEYS = ("type", "description", "default", "enum", "x-kubernetes-int-or-string", "anyOf")


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    """type and description first, properties last: the order a person reads a schema in."""
    head = {k: node[k] for k in _FIRST_KEYS if k in node}
    tail = {k: node[k] for k in ("required", "properties", "additionalProperties", "items") if k in node}
    middle = {k: v for k, v in node.items() if k not in head and k not in tail}
    return {**head, **middle, **tail}


def openapi_schema() -> dict[str, Any]:
    """The structural openAPIV3Schema of FineTuneJob."""
    raw = api.FineTuneJob.model_json_schema(by_alias=True, mode="validation")
    converter = _Converter(raw.get("$defs", {}))
    spec = converter.convert(raw["properties"]["spec"])
    status = converter.convert(raw["properties"]["status"], keep_defaults=False)
    schema: dict[str, Any] = {
        "type": "object",
        "description": (raw.get("description") or "").strip(),
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "finetune.dev/v1alpha1"},
            "kind": {"type": "string", "description": "FineTuneJob"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }
    return schema


def crd() -> dict[str, Any]:
    """The whole CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{api.PLURAL}.{api.GROUP}",
            "labels": {"app.kubernetes.io/name": "finetune-operator", "app.kubernetes.io/part-of": "finetune-operator"},
        },
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": list(api.SHORT_NAMES),
                "categories": ["all", "finetune"],
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings as literal blocks so the CRD diff reads well."""


def _str_presenter(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str_presenter)


def crd_yaml() -> str:
    """The CRD as YAML, exactly as `crds/finetunejob.yaml` holds it."""
    header = "# Generated by `finetune-operator crd` from operator/finetune_operator/api/. Do not edit.\n"
    return header + yaml.dump(crd(), Dumper=_BlockDumper, sort_keys=False, width=100, allow_unicode=True)
