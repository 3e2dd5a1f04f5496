"""The provenance record: every attempt's nodes, images and GPU-hours, what the model was trained on."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import yaml

from finetune_operator import api, provenance
from finetune_operator.cli import main
from finetune_trainer import contract

from test_lifecycle import T0, World, example

FACTS = contract.TrainingFacts(base_config_sha256="c" * 64, dataset_sha256="d" * 64, dataset_files=3,
                               dataset_bytes=12345, records=800, examples=640, tokens=1_310_720, final_loss=1.234,
                               held_out=32, eval_loss=1.5)


def _running(world: World, node: str, started_after: timedelta, image_id: str) -> None:
    """The attempt's pod scheduled to `node`, its trainer container running `image_id`."""
    world.pods = [world.pod({"phase": "Running", "startTime": (T0 + started_after).isoformat().replace("+00:00", "Z"),
                             "containerStatuses": [{"name": "pytorch", "image": "trainer:dev", "imageID": image_id,
                                                    "state": {"running": {}}}]})]
    world.pods[0]["spec"] = {"nodeName": node}
    world.set_condition("Running")


def _oom_then_success(export: contract.ExportFacts | None = None) -> World:
    world = World(example("llama-8b-lora.yaml"))
    world.step()
    _running(world, "gpu-node-1", timedelta(minutes=5), "docker.io/trainer@sha256:" + "1" * 64)
    world.now = T0 + timedelta(minutes=6)
    world.step()
    world.now = T0 + timedelta(hours=1, minutes=5)
    world.oom()  # the pod that failed: still on its node, its image the same
    world.pods[0]["spec"] = {"nodeName": "gpu-node-1"}
    world.step()
    world.wait_backoff()
    world.step()
    started = world.now - T0 + timedelta(minutes=1)
    _running(world, "gpu-node-7", started, "docker.io/trainer@sha256:" + "1" * 64)
    world.step()
    world.now += timedelta(hours=2)
    report = contract.SuccessReport(steps=500, rank=0, facts=FACTS, export=export)
    world.pods[0]["status"] = {"phase": "Succeeded", "containerStatuses": [
        {"name": "pytorch", "imageID": "docker.io/trainer@sha256:" + "1" * 64,
         "state": {"terminated": {"exitCode": 0, "message": report.to_termination_message()}}}]}
    world.set_condition("Succeeded")
    world.step()
    return world


def test_both_attempts_of_a_recovered_job_are_recorded_with_their_nodes_images_and_gpu_hours():
    world = _oom_then_success()
    status = world.job.status
    assert status.phase == "Succeeded"
    first, second = status.attempts
    assert (first.outcome, second.outcome) == ("GPUOutOfMemory", "Succeeded")
    assert first.nodes == ["gpu-node-1"] and second.nodes == ["gpu-node-7"]
    assert first.images == ["docker.io/trainer@sha256:" + "1" * 64]
    assert first.running_since == T0 + timedelta(minutes=5)
    # GPUs x (end - first pod start): the first attempt ran 1 h on its GPUs.
    assert provenance.attempt_gpu_hours(first, world.now) == pytest.approx(first.plan.gpus * 1.0, rel=1e-3)
    summary = status.provenance
    assert summary is not None
    expected = provenance.attempt_gpu_hours(first, world.now) + provenance.attempt_gpu_hours(second, world.now)
    assert summary.gpu_hours == pytest.approx(expected, abs=1e-3) and summary.gpu_hours > first.plan.gpus
    watts = {"H100-80GB": 700, "A100-80GB": 400, "L40S-48GB": 350}
    energy = sum(provenance.attempt_gpu_hours(a, world.now) * watts[a.plan.gpu_type] / 1000 for a in status.attempts)
    assert summary.energy_kwh_estimate == pytest.approx(energy, abs=1e-3)
    assert (summary.dataset_sha256, summary.records, summary.tokens_last_attempt, summary.steps) == (
        "d" * 64, 800, 1_310_720, 500)
    assert summary.attempts == 2 and summary.regions == ["eu-de-berlin"]
    assert (summary.held_out, summary.final_loss, summary.eval_loss) == (32, 1.234, 1.5)
    assert summary.base_model.startswith(world.job.spec.model.name)


def test_where_the_export_went_is_in_the_summary_and_the_record():
    export = contract.ExportFacts(kind="merged", directory="/output/merged", shards=8, total_bytes=16_060_522_496)
    world = _oom_then_success(export)
    summary = world.job.status.provenance
    assert summary.export == provenance.output_location(world.job.spec) + "/merged"
    assert summary.export_bytes == 16_060_522_496
    assert provenance.build_record(world.job, world.now).export == summary.export
    assert _oom_then_success().job.status.provenance.export is None  # an adapter: nothing beyond the output


def test_the_record_lists_every_attempt_and_is_complete_only_once_succeeded():
    world = _oom_then_success()
    record = provenance.build_record(world.job, world.now)
    assert record.complete and [a.outcome for a in record.attempts] == ["GPUOutOfMemory", "Succeeded"]
    assert [a.nodes for a in record.attempts] == [["gpu-node-1"], ["gpu-node-7"]]
    # How the first attempt ended and what the next one changed.
    assert record.attempts[0].message.startswith("GPU OOM in backward") and "next:" in record.attempts[0].message
    assert record.dataset.sha256 == "d" * 64 and record.base_model.config_sha256 == "c" * 64
    assert (record.dataset.held_out, record.eval_loss) == (32, 1.5)
    assert record.trainer_records.endswith("/provenance/")
    assert record.energy_note.startswith("estimate")
    running = World(example("llama-8b-lora.yaml"))
    running.step()
    partial = provenance.build_record(running.job, running.now)
    assert not partial.complete and partial.dataset.sha256 is None and len(partial.attempts) == 1


def test_an_attempt_that_never_had_a_pod_on_a_node_holds_no_gpu_time():
    world = World(example("llama-8b-lora.yaml"))
    world.step()
    record = world.job.status.attempts[0]
    pending = record.model_copy(update={"start_time": None})
    assert provenance.attempt_gpu_hours(pending, world.now + timedelta(hours=3)) == 0.0
    ended = record.model_copy(update={"end_time": record.start_time, "outcome": "Unschedulable"})
    assert provenance.attempt_gpu_hours(ended, world.now + timedelta(hours=3)) == 0.0


def test_an_unknown_gpu_type_has_no_energy_figure_rather_than_a_wrong_one():
    assert provenance.energy_kwh("H100-80GB", 2.0) == pytest.approx(1.4)
    assert provenance.energy_kwh("Quantum-GPU-9000", 2.0) is None


def test_record_prints_a_saved_object_and_refuses_both_or_neither_source(tmp_path, capsys):
    world = _oom_then_success()
    saved = tmp_path / "job.yaml"
    saved.write_text(yaml.safe_dump(world.job.model_dump(mode="json", by_alias=True, exclude_none=True)))
    assert main(["record", "-f", str(saved), "-o", "json"]) == 0
    out = capsys.readouterr().out
    printed = json.loads(out)
    assert printed["complete"] is True and len(printed["attempts"]) == 2
    assert printed["attempts"][1]["nodes"] == ["gpu-node-7"] and printed["gpuHours"] > 0
    assert main(["record"]) == 2
    assert main(["record", "x", "-f", str(saved)]) == 2
    assert "one of them" in capsys.readouterr().err


def test_status_round_trips_through_the_crd_shape():
    world = _oom_then_success()
    body = world.job.model_dump(mode="json", by_alias=True, exclude_none=True)
    again = api.parse_job(body)
    assert again.status.provenance == world.job.status.provenance
    assert again.status.attempts[1].nodes == ["gpu-node-7"]
