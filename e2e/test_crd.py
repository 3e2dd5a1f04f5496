"""The FineTuneJob CRD (crds/finetunejob.yaml) on a real API server."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from e2e.lab.waiting import wait_for

pytestmark = pytest.mark.e2e

def _finetunejob_examples() -> list[Path]:
    # examples/ also holds other files a user copies (e.g. a pool catalog): only FineTuneJobs here.
    paths = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))
    return [p for p in paths if any((d or {}).get("kind") == "FineTuneJob" for d in yaml.safe_load_all(p.read_text()))]


EXAMPLES = _finetunejob_examples()


def _example(name: str | None = None) -> dict:
    if not EXAMPLES:
        pytest.skip("no examples/*.yaml yet")
    path = next((p for p in EXAMPLES if name and p.stem == name), EXAMPLES[0])
    return yaml.safe_load(path.read_text())


def test_crd_is_established_with_its_names(lab, ftj_crd):
    api = client.ApiextensionsV1Api(lab.api_client())
    crd = api.read_custom_resource_definition("finetunejobs.finetune.dev")
    conditions = {c.type: c.status for c in crd.status.conditions}
    assert conditions["Established"] == "True" and conditions["NamesAccepted"] == "True"
    assert "ftj" in crd.spec.names.short_names
    resources = lab.kubectl("api-resources", "--api-group=finetune.dev", "-o", "name").stdout.split()
    assert resources == ["finetunejobs.finetune.dev"]


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_applies(lab, ftj_crd, namespace, example):
    out = lab.kubectl("apply", "-n", namespace, "-f", str(example))
    assert "created" in out.stdout, out.stdout
    name = yaml.safe_load(example.read_text())["metadata"]["name"]
    got = lab.kubectl("get", "ftj", name, "-n", namespace, "-o", "yaml").stdout
    assert yaml.safe_load(got)["spec"]["model"]["name"]
    # Server-side dry run of the same file is clean too (what `kubectl diff` and helm rely on).
    lab.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(example))


def test_invalid_finetunejob_is_rejected_with_the_crd_message(lab, ftj_crd, namespace):
    bad = copy.deepcopy(_example("llama-8b-lora"))
    bad["metadata"]["name"] = "bad-method"
    bad["spec"]["method"] = "full"  # keeps spec.lora: the CRD's CEL rule forbids that
    proc = lab.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(bad), check=False)
    assert proc.returncode != 0
    assert "lora is required for methods lora and qlora, and not allowed for full" in proc.stderr, proc.stderr

    enum_bad = copy.deepcopy(_example("llama-8b-lora"))
    enum_bad["metadata"]["name"] = "bad-enum"
    enum_bad["spec"]["method"] = "prompt-tuning"
    proc = lab.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(enum_bad), check=False)
    assert proc.returncode != 0
    assert "spec.method" in proc.stderr and "Unsupported value" in proc.stderr, proc.stderr


def test_the_dataset_batching_rules_run_in_the_api_server(lab, ftj_crd, namespace):
    """spec.dataset's CEL (issue 28): packing with paddingFree, and microBatchTokens that decrease (the
    Kubernetes list library's isSorted), are refused with the CRD's messages; a padding-free job with
    its tokens is taken."""
    def apply(name: str, **dataset):
        job = copy.deepcopy(_example("llama-8b-lora"))
        job["metadata"]["name"] = name
        job["spec"]["dataset"].update(dataset)
        return lab.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-", input=yaml.safe_dump(job),
                           check=False)

    both = apply("both", packing=True, paddingFree=True)
    assert both.returncode != 0 and "set at most one of packing, paddingFree" in both.stderr, both.stderr
    down = apply("down", paddingFree=True, microBatchTokens=[900, 800])
    assert down.returncode != 0 and "microBatchTokens must not decrease" in down.stderr, down.stderr
    packed = apply("packed", packing=True, microBatchTokens=[900])
    assert packed.returncode != 0 and "microBatchTokens sizes unpacked examples" in packed.stderr, packed.stderr
    ok = apply("ok", paddingFree=True, microBatchTokens=[900, 1500, 1500])
    assert ok.returncode == 0, ok.stderr


def test_get_ftj_shows_the_printer_columns(lab, ftj_crd, namespace):
    example = _example("llama-8b-lora")
    lab.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(example))
    api = client.ApiextensionsV1Api(lab.api_client())
    printer = api.read_custom_resource_definition("finetunejobs.finetune.dev").spec.versions[0].additional_printer_columns
    header = wait_for(lambda: lab.kubectl("get", "ftj", "-n", namespace).stdout.splitlines()[0], 10, "kubectl get ftj")
    wide = lab.kubectl("get", "ftj", "-n", namespace, "-o", "wide").stdout.splitlines()[0]
    assert header.split()[0] == "NAME"
    for column in printer:
        # Priority 0 columns always; priority 1 only with -o wide.
        assert (column.name.upper() in header) == (not column.priority), (column.name, header)
        assert column.name.upper() in wide, (column.name, wide)
    row = lab.kubectl("get", "ftj", "-n", namespace).stdout.splitlines()[1]
    assert example["metadata"]["name"] in row and example["spec"]["model"]["name"] in row


def test_kubectl_explain_prints_the_docs(lab, ftj_crd):
    out = wait_for(
        lambda: lab.kubectl("explain", "finetunejob.spec", check=False).stdout, 30, "kubectl explain (OpenAPI published)"
    )
    assert "KIND:" in out and "FineTuneJob" in out
    assert "DESCRIPTION:" in out and "FIELDS:" in out
    for field in ("model", "method", "placement", "resources"):
        assert f"  {field}\t" in out or f"  {field} " in out, field
    placement = lab.kubectl("explain", "finetunejob.spec.placement.regions").stdout
    assert len(placement.split("DESCRIPTION:")[1].strip()) > 20, placement


def test_fake_gpu_reads_rules_from_the_finetunejob(lab, ftj_crd, namespace):
    """A test can set the fake GPU's rule on the FineTuneJob the pods belong to."""
    from e2e.helpers import GIB, terminated_state, training_pod

    example = copy.deepcopy(_example("llama-8b-lora"))
    example["metadata"]["annotations"] = {"lab.finetune.dev/outcome": "host-oom"}
    lab.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(example))
    core = client.CoreV1Api(lab.api_client())
    core.create_namespaced_pod(namespace, training_pod("attempt-1", example["metadata"]["name"], 10 * GIB))
    _, term = terminated_state(core, namespace, "attempt-1")
    assert (term.exit_code, term.reason) == (137, "OOMKilled")
