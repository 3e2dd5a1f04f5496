"""Images are the platform's to choose: `allowedImages` bounds `spec.image`, profile pods run the
policy's trainer image, and the cluster-wide profile cache and calibration hold only the trainer
image's plausible figures."""

from __future__ import annotations

import logging

import pytest

from finetune_operator import api, calibration, lifecycle
from finetune_operator.planning.policy import PolicyError, load_policy
from finetune_operator.profiling.cache import cache_entries, implausible, read_cache, weights_bytes
from finetune_operator.profiling.pod import render_profile_pod
from finetune_operator.profiling.setups import config_hash
from finetune_trainer.contract import PROFILE_PHASES, ProfileMeasurement, ProfileReport, ProfileRequest, ProfileSetup
from test_lifecycle import POOLS, T0, example

TRAINER = "registry.eu.example/finetune/trainer:0.1.0"
DIGEST = "@sha256:" + "ab" * 32


def _policy(**extra) -> object:
    return load_policy({"allowedRegions": ["eu-de-berlin", "eu-fr-paris"], "trainerImage": TRAINER, **extra})


def _step(job: api.FineTuneJob, policy) -> lifecycle.Decision:
    return lifecycle.step(lifecycle.Observed(job=job, now=T0, policy=policy, pools=POOLS))


def _validated(decision: lifecycle.Decision) -> api.Condition:
    return next(c for c in decision.status.conditions if c.type == "Validated")


@pytest.mark.parametrize("image, allowed", [
    (TRAINER, True),  # the trainer image itself, always
    ("registry.eu.example/ml/trainer:2", True),
    ("registry.eu.example/ml/sub/trainer" + DIGEST, True),
    ("registry.eu.example/ml-evil/trainer:2", False),  # a prefix ends at a path boundary
    ("registry.eu.example/mlx:2", False),
    ("registry.eu.example/pinned/trainer:2", False),  # requireDigest
    ("registry.eu.example/pinned/trainer" + DIGEST, True),
    ("registry.eu.example/pinned/trainer:2" + DIGEST, True),
    ("docker.io/someone/trainer:latest", False),
    ("registry.eu.example/finetune/trainer:0.2.0", False),  # only the trainer image, not its repository
])
def test_allowed_images_bound_spec_image(image, allowed):
    policy = _policy(allowedImages=[{"prefix": "registry.eu.example/ml/"},
                                    {"prefix": "registry.eu.example/pinned/trainer", "requireDigest": True}])
    assert (policy.image_problem(image) is None) == allowed


def test_a_job_naming_an_image_the_policy_does_not_allow_is_invalid_naming_spec_image():
    job = example("llama-8b-lora.yaml", image="docker.io/someone/trainer:latest")
    decision = _step(job, _policy())
    validated = _validated(decision)
    assert decision.status.phase == "Failed" and decision.create == []
    assert validated.reason == "Invalid" and "spec.image" in validated.message
    assert "allowedImages: none" in validated.message

    # Allowed by prefix: the attempt runs it, in every container.
    allowed = _step(job, _policy(allowedImages=[{"prefix": "docker.io/someone/"}]))
    assert allowed.status.phase == "Launching"
    [training] = [o for o in allowed.create if o["kind"] == "PyTorchJob"]
    for replica in training["spec"]["pytorchReplicaSpecs"].values():
        containers = replica["template"]["spec"]["containers"] + replica["template"]["spec"].get("initContainers", [])
        assert {c["image"] for c in containers} == {"docker.io/someone/trainer:latest"}

    # A digest required and missing: Invalid, and the message says so.
    pinned = _step(job, _policy(allowedImages=[{"prefix": "docker.io/someone/", "requireDigest": True}]))
    assert "spec.image" in _validated(pinned).message and "digest" in _validated(pinned).message


def test_a_bad_allowed_images_entry_is_a_policy_error_naming_it():
    with pytest.raises(PolicyError, match="allowedImages.0.requireDigest"):
        _policy(allowedImages=[{"prefix": "registry.eu.example/", "requireDigest": "sometimes"}])
    with pytest.raises(PolicyError, match="allowedImages.0.prefix"):
        _policy(allowedImages=[{"prefix": ""}])


def _setup(**changes) -> ProfileSetup:
    fields = dict(method="full", sequence_length=512, micro_batch_size=1, gradient_checkpointing=True,
                  strategy="ddp", world_size=1)
    fields.update(changes)
    return ProfileSetup(**fields)


def test_the_profile_pod_runs_the_trainer_image_whatever_the_job_names():
    job = example("llama-8b-lora.yaml", image="registry.eu.example/ml/trainer:2")
    policy = _policy(allowedImages=[{"prefix": "registry.eu.example/ml/"}])
    request = ProfileRequest(config={"model_type": "x"}, setups=[_setup()])
    pod = render_profile_pod(job, request, "abc", policy, "finetune-system")
    assert [c["image"] for c in pod["spec"]["containers"]] == [TRAINER]


def test_the_profile_pod_takes_the_policys_tolerations_and_node_selector_beside_the_regions():
    job = example("llama-8b-lora.yaml")
    request = ProfileRequest(config={"model_type": "x"}, setups=[_setup()])
    plain = render_profile_pod(job, request, "abc", _policy(), "finetune-system")["spec"]
    assert "tolerations" not in plain and "nodeSelector" not in plain
    gpu = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    spec = render_profile_pod(job, request, "abc", _policy(profilePod={"tolerations": [gpu],
                                                                       "nodeSelector": {"example.com/pool": "cpu"}}),
                              "finetune-system")["spec"]
    assert spec["tolerations"] == [gpu] and spec["nodeSelector"] == {"example.com/pool": "cpu"}
    assert spec["affinity"] == plain["affinity"]  # still only in the job's regions


def test_the_profile_cache_is_keyed_by_the_trainer_image():
    config = {"model_type": "falcon", "hidden_size": 128}
    assert config_hash(config, TRAINER) != config_hash(config, "registry.eu.example/finetune/trainer:0.2.0")
    assert config_hash(config, TRAINER) == config_hash(dict(reversed(list(config.items()))), TRAINER)


def _measured(setup: ProfileSetup, peak: int) -> ProfileMeasurement:
    return ProfileMeasurement(key=setup.key, peaks={phase: peak for phase in PROFILE_PHASES}, trainable_params=10)


def test_a_peak_below_the_weights_own_size_is_refused_when_written_and_when_read(caplog):
    total = 10**6
    full, sharded, lora = _setup(), _setup(strategy="fsdp", world_size=4), _setup(method="lora")
    assert weights_bytes(total, full) == 4 * total
    assert weights_bytes(total, sharded) == total
    assert weights_bytes(total, lora) == 2 * total
    assert implausible(_measured(full, 4 * total), full, total) is None
    assert "below" in implausible(_measured(full, 4 * total - 1), full, total)

    report = ProfileReport(ok=True, params={"total": total},
                           measurements=[_measured(full, 5 * total), _measured(sharded, total // 2)])
    with caplog.at_level(logging.WARNING, logger="finetune_operator.profiling"):
        entries = cache_entries("abc", report, "2026-12-01T00:00:00Z", [full, sharded])
    assert "refused" in caplog.text and sharded.key in caplog.text
    cached = read_cache(entries, "abc", [full, sharded])
    assert set(cached.measurements) == {full.key} and cached.missing == [sharded]

    # Written by something else (a forged ConfigMap): refused when read, and profiled again.
    forged = cache_entries("abc", ProfileReport(ok=True, params={"total": 10}, measurements=[_measured(sharded, 10)]),
                           "2026-12-01T00:00:00Z", [sharded])
    forged["abc.model"] = entries["abc.model"]  # the model's true size
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="finetune_operator.profiling"):
        assert read_cache(forged, "abc", [sharded]).missing == [sharded]
    assert "refused" in caplog.text


def test_implausible_calibration_ratios_are_refused_and_logged(caplog):
    kind = calibration.Kind("H100-80GB", "llama", "lora", "ddp", TRAINER)
    other_image = calibration.Kind("H100-80GB", "llama", "lora", "ddp", "registry.eu.example/ml/trainer:2")
    assert kind.key != other_image.key and kind.key.endswith(kind.image_hash)
    seen = [calibration.Observation(kind, 0.01, 1), calibration.Observation(other_image, 9.0, 1)]
    with caplog.at_level(logging.WARNING, logger="finetune_operator.calibration"):
        assert calibration.learn({}, seen) == {}
    assert caplog.text.count("not learned") == 2
    learned = calibration.learn({}, [calibration.Observation(kind, 1.3, 2)])
    assert learned == {kind.key: calibration.Learned(1.3, 1, 1.3)}
    # A stored factor outside [1.0, 1.5] is refused when read, not clamped into use.
    assert calibration.Learned.from_json('{"factor": 0.5, "runs": 3}') is None
    assert calibration.Learned.from_json('{"factor": 7, "runs": 3}') is None
    assert calibration.Learned.from_json('{"factor": 1.2, "runs": 3}') == calibration.Learned(1.2, 3, 1.2)
