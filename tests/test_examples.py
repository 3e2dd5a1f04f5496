"""Every example validates against the pydantic models and against the CRD's OpenAPI schema."""

from __future__ import annotations

import jsonschema
import pytest
import yaml

from finetune_operator import api, crd

from repo_files import example_jobs


def _validator() -> jsonschema.Draft4Validator:
    # OpenAPI v3.0 schemas are draft-4 shaped (boolean exclusiveMinimum); x-kubernetes-* keys are ignored.
    return jsonschema.Draft4Validator(crd.openapi_schema())


def test_there_are_the_three_promised_examples():
    names = {p.name for p in example_jobs()}
    assert {"llama-8b-lora.yaml", "llama-70b-qlora.yaml", "llama-8b-full.yaml"} <= names


@pytest.mark.parametrize("path", example_jobs(), ids=lambda p: p.name)
def test_example_validates(path):
    document = yaml.safe_load(path.read_text())
    job = api.parse_job(document)
    assert job.metadata.name
    errors = sorted(_validator().iter_errors(document), key=str)
    assert not errors, [f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors]


def test_examples_cover_the_three_methods():
    methods = {api.parse_job(yaml.safe_load(p.read_text())).spec.method for p in example_jobs()}
    assert methods == {"full", "lora", "qlora"}
