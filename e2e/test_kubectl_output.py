"""What a person reads with the real kubectl against the real API server (issue 18): `get ftj`
says why a job waits or failed and `-o wide` shows the plan's memory; `explain` says what an
`auto`-or-number field accepts; status conditions are a map keyed by type; text fields that
reach terminals and command lines are refused by the CRD itself."""

from __future__ import annotations

import copy
import json
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

from e2e.lab.waiting import wait_for
from finetune_operator import api
from finetune_operator.summary import status_reason

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "llama-8b-lora.yaml"
NOW = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)


def _job(name: str) -> dict:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"] = {"name": name}
    return doc


def _condition(type_: str, state: str, reason: str, message: str = "") -> api.Condition:
    return api.Condition(type=type_, status=state, reason=reason, message=message, last_transition_time=NOW,
                         observed_generation=1)


def _write_status(lab, namespace: str, name: str, status: api.FineTuneJobStatus | dict, check: bool = True):
    """Through the status subresource, serialised as the operator does (shell/job_status.status_json)."""
    body = status if isinstance(status, dict) else status.model_dump(mode="json", by_alias=True, exclude_none=True)
    return lab.kubectl("patch", "ftj", name, "-n", namespace, "--subresource=status", "--type=merge",
                       "-p", json.dumps({"status": body}), check=check)


def _table(lab, namespace: str, *args: str) -> tuple[list[str], list[str]]:
    lines = lab.kubectl("get", "ftj", "-n", namespace, *args).stdout.splitlines()
    return lines[0].split(), lines[1].split()


PLAN = {
    "nodePool": "h100-berlin", "region": "eu-de-berlin", "gpuType": "H100-80GB", "nodes": 1, "gpusPerNode": 2,
    "gpus": 2, "method": "lora", "strategy": "fsdp", "offload": "none", "optimizer": "adamw", "microBatchSize": 2,
    "gradientAccumulation": 16, "gradientCheckpointing": True, "predictedPeak": "61.3Gi", "required": "66.1Gi",
    "gpuMemory": "79.6Gi", "hostMemory": "128Gi",
}


def test_get_says_why_and_wide_shows_the_plan(lab, ftj_crd, namespace):
    lab.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(_job("waiting")))
    # Pending because nothing fits: the reason comes from Planned=False, chosen by status_reason.
    pending = api.FineTuneJobStatus(phase="Pending", observed_generation=1, conditions=[
        _condition("Validated", "True", "Valid"), _condition("Planned", "False", "NoFit", "nothing fits")])
    pending.reason = status_reason(pending)
    _write_status(lab, namespace, "waiting", pending)

    def table_with_reason():
        header, row = _table(lab, namespace)
        return (header, row) if "REASON" in header else None

    header, row = wait_for(table_with_reason, 30, "the REASON column (the CRD's printer columns are served)")
    assert header[:4] == ["NAME", "PHASE", "REASON", "MODEL"], header
    assert row[:3] == ["waiting", "Pending", "NoFit"], row
    assert "STRATEGY" not in header, "strategy is a wide column"

    # Running with a plan: -o wide adds strategy, predicted peak and GPU memory.
    running = api.FineTuneJobStatus(phase="Running", observed_generation=1, current_attempt=1,
                                    plan=api.PlanStatus.model_validate(PLAN), conditions=[
        _condition("Validated", "True", "Valid"), _condition("Planned", "True", "Planned"),
        _condition("Running", "True", "Running")])
    running.reason = status_reason(running)
    # A whole-status PUT as the operator does it, so the reason of the Pending status goes.
    current = json.loads(lab.kubectl("get", "ftj", "waiting", "-n", namespace, "-o", "json").stdout)
    current["status"] = running.model_dump(mode="json", by_alias=True, exclude_none=True)
    lab.kubectl("replace", "--subresource=status", "-f", "-", input=json.dumps(current))
    out = lab.kubectl("get", "ftj", "-n", namespace, "-o", "wide").stdout.splitlines()
    assert "STRATEGY" in out[0] and "PREDICTED" in out[0] and "GPU MEMORY" in out[0], out[0]
    columns = _columns(out)
    assert columns["STRATEGY"] == "fsdp" and columns["PREDICTED"] == "61.3Gi" and columns["GPU MEMORY"] == "79.6Gi", out
    assert columns["PHASE"] == "Running" and columns["REASON"] in ("", "<none>"), out

    # Failed: the Failed condition's reason, even with Running=False beside it.
    failed = running.model_copy(deep=True)
    failed.phase = "Failed"
    failed.conditions[2] = _condition("Running", "False", "Failed", "gave up")
    failed.conditions.append(_condition("Failed", "True", "GPUOutOfMemory", "all 4 attempts are used"))
    failed.reason = status_reason(failed)
    _write_status(lab, namespace, "waiting", failed)
    assert _columns(lab.kubectl("get", "ftj", "-n", namespace).stdout.splitlines())["REASON"] == "GPUOutOfMemory"


def _columns(lines: list[str]) -> dict[str, str]:
    """One row of kubectl's table by header, cutting at the header's column starts (names hold spaces)."""
    header, row = lines[0], lines[1]
    starts, names, i = [], [], 0
    for part in [p for p in header.split("   ") if p.strip()]:
        i = header.index(part.strip(), i)
        starts.append(i)
        names.append(part.strip())
        i += len(part.strip())
    bounds = starts[1:] + [len(row) + 1]
    return {name: row[start:end].strip() for name, start, end in zip(names, starts, bounds)}


def test_conditions_are_a_map_the_api_server_keeps_unique(lab, ftj_crd, namespace):
    lab.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(_job("dupes")))
    condition = _condition("Validated", "True", "Valid").model_dump(mode="json", by_alias=True, exclude_none=True)
    proc = _write_status(lab, namespace, "dupes", {"phase": "Pending", "conditions": [condition, condition]}, check=False)
    assert proc.returncode != 0 and "Duplicate value" in proc.stderr, proc.stderr
    _write_status(lab, namespace, "dupes", {"phase": "Pending", "conditions": [condition]})
    schema = json.loads(lab.kubectl("get", "crd", "finetunejobs.finetune.dev", "-o", "json").stdout)
    conditions = schema["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map" and conditions["x-kubernetes-list-map-keys"] == ["type"]


def test_explain_says_what_auto_or_number_fields_accept(lab, ftj_crd):
    for field, maximum in (("resources.gpus", api.MAX_GPUS), ("training.microBatchSize", 4096)):
        out = wait_for(lambda: lab.kubectl("explain", f"finetunejob.spec.{field}", check=False).stdout, 30,
                       f"kubectl explain {field}")
        # kubectl calls every int-or-string field <Object>; the description says what it really takes.
        assert f"Accepts `auto` or an integer from 1 to {maximum}." in out, out


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d["spec"]["model"].update(name="Llama\nfake-row   Succeeded"), "spec.model.name"),
    (lambda d: d["spec"]["model"].update(name="Llama\n"), "spec.model.name"),
    (lambda d: d["spec"]["model"].update(name="\x1b[2J\x1b[31mLlama"), "spec.model.name"),
    (lambda d: d["spec"]["model"]["source"].update(pvc=None, hf={"repo": "meta-llama/Llama-3.1-8B", "revision": "--local-dir=/etc"}),
     "spec.model.source.hf.revision"),
], ids=["name-newline", "name-trailing-newline", "name-escape", "revision-option"])
def test_the_api_server_refuses_text_that_would_reach_terminals_or_commands(lab, ftj_crd, namespace, mutate, field):
    doc = copy.deepcopy(_job("hostile"))
    mutate(doc)
    doc["spec"]["model"]["source"] = {k: v for k, v in doc["spec"]["model"]["source"].items() if v is not None}
    proc = lab.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(doc), check=False)
    assert proc.returncode != 0 and field in proc.stderr, proc.stderr
    assert lab.kubectl("get", "ftj", "-n", namespace, "-o", "name").stdout.strip() == ""


def test_checkpoint_volume_has_no_read_only_that_would_lie(lab, ftj_crd, namespace):
    doc = _job("ckpt")
    doc["spec"]["checkpoint"]["pvc"]["readOnly"] = True
    proc = lab.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert proc.returncode != 0 and 'unknown field "spec.checkpoint.pvc.readOnly"' in proc.stderr, proc.stderr
    del doc["spec"]["checkpoint"]["pvc"]["readOnly"]
    lab.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    described = lab.kubectl("describe", "ftj", "ckpt", "-n", namespace).stdout
    checkpoint = _section(described, "Checkpoint:")
    assert "Claim Name:  checkpoints" in checkpoint and "Read Only" not in checkpoint, checkpoint
    assert "Read Only:" in _section(described, "Model:"), "the model volume keeps its readOnly"


def _section(described: str, title: str) -> str:
    """The lines of `kubectl describe` under `title`, up to the next line indented no deeper."""
    lines = described.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == title)
    depth = len(lines[start]) - len(lines[start].lstrip())
    body = []
    for line in lines[start + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= depth:
            break
        body.append(line)
    return "\n".join(body)
