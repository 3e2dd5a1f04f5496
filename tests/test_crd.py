"""The CRD is generated from the API models, is structural, and is in sync with crds/."""

from __future__ import annotations

from typing import Any, Iterator

import yaml

from finetune_operator import crd
from finetune_operator.cli import main

from repo_files import REPO


def _nodes(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for name, child in (schema.get("properties") or {}).items():
        yield from _nodes(child, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from _nodes(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _nodes(schema["additionalProperties"], f"{path}{{}}")


def test_checked_in_crd_matches_the_generator():
    checked_in = (REPO / "crds" / "finetunejob.yaml").read_text()
    assert checked_in == crd.crd_yaml(), "crds/finetunejob.yaml is stale: run `finetune-operator crd > crds/finetunejob.yaml`"


def test_cli_prints_the_crd(capsys):
    assert main(["crd"]) == 0
    assert capsys.readouterr().out == crd.crd_yaml()


def test_identity_of_the_crd():
    obj = yaml.safe_load(crd.crd_yaml())
    assert obj["metadata"]["name"] == "finetunejobs.finetune.dev"
    spec = obj["spec"]
    assert spec["group"] == "finetune.dev"
    assert spec["names"]["kind"] == "FineTuneJob"
    assert spec["names"]["plural"] == "finetunejobs"
    assert spec["names"]["shortNames"] == ["ftj"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["storage"] and version["served"]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == ["Phase", "Reason", "Model", "Method", "GPUs", "Pool", "Region", "Attempt", "Progress", "Age"]
    wide = [c["name"] for c in version["additionalPrinterColumns"] if c.get("priority") == 1]
    assert wide == ["Strategy", "Predicted", "GPU Memory", "Loss", "Eval Loss", "ETA"]


def test_printer_columns_read_fields_the_status_has():
    """Each column's JSONPath names a field of the status schema (a typo prints an empty column forever)."""
    schema = crd.openapi_schema()
    for column in crd.PRINTER_COLUMNS:
        *parents, leaf = column["jsonPath"].lstrip(".").split(".")
        node = schema
        for key in parents:
            node = node["properties"][key] if key != "metadata" else {"properties": {}}
        if parents[0] != "metadata":
            assert leaf in node["properties"], column
            kind = node["properties"][leaf]["type"]
            assert kind == column["type"] or (kind, column["type"]) == ("integer", "number"), column


def test_conditions_are_a_map_keyed_by_type():
    conditions = crd.openapi_schema()["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert "type" in conditions["items"]["required"]


def test_checkpoint_and_output_volumes_have_no_read_only_field():
    """They are always mounted read-write: a readOnly field there (defaulted to true) would lie."""
    spec = crd.openapi_schema()["properties"]["spec"]["properties"]
    assert "readOnly" not in spec["checkpoint"]["properties"]["pvc"]["properties"]
    assert "readOnly" not in spec["output"]["properties"]["pvc"]["properties"]
    assert spec["model"]["properties"]["source"]["properties"]["pvc"]["properties"]["readOnly"]["default"] is True


def test_schema_is_structural():
    schema = crd.openapi_schema()
    for path, node in _nodes(schema):
        assert "$ref" not in node, path
        assert "$defs" not in node, path
        assert "title" not in node, path
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
            assert "type" not in node, path
            continue
        assert "anyOf" not in node and "oneOf" not in node and "allOf" not in node, path
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
        if "properties" in node:
            assert "additionalProperties" not in node, path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


def test_every_spec_field_has_a_description():
    schema = crd.openapi_schema()
    missing = [path for path, node in _nodes(schema["properties"]["spec"], ".spec") if not node.get("description") and not path.endswith("[]")]
    assert not missing, f"fields without a description: {missing}"


def test_preserve_unknown_fields_only_where_free_form():
    schema = crd.openapi_schema()
    free = [path for path, node in _nodes(schema) if node.get("x-kubernetes-preserve-unknown-fields")]
    # A pasted config.json keeps every key (issue 16); its keys that decide memory are still typed.
    assert free == [".spec.model.architecture.inline", ".spec.model.architecture.inline.text_config"], free


def test_auto_or_int_fields_are_int_or_string_with_a_rule():
    spec = crd.openapi_schema()["properties"]["spec"]["properties"]
    for node in (spec["training"]["properties"]["microBatchSize"], spec["resources"]["properties"]["gpus"]):
        assert node["x-kubernetes-int-or-string"] is True
        assert node["default"] == "auto"
        (rule,) = node["x-kubernetes-validations"]
        assert "self == 'auto'" in rule["rule"]
        # kubectl explain shows an int-or-string field as <Object>: the description says what it takes.
        assert "Accepts `auto` or an integer from 1 to " in node["description"], node["description"]
        assert "x-finetune-accepts" not in node


def test_cel_rules_name_their_field_in_the_message_or_path():
    schema = crd.openapi_schema()
    for path, node in _nodes(schema):
        for rule in node.get("x-kubernetes-validations", []):
            assert rule["message"], path
            assert rule["rule"].strip(), path
