"""The profile's pure core: which setups, the estimate from measured corners, the lifecycle's
decisions about the profile pod, and the cache encoding. No torch, no cluster."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from finetune_operator import lifecycle
from finetune_operator.profiling import pod as ps_pod
from finetune_operator.profiling import state as ps
from finetune_operator.profiling.cache import cache_entries, read_cache, setup_entry
from finetune_operator.profiling.estimate import profiled_architecture
from finetune_operator.profiling.setups import JobProfile, NotProfilable, job_profile
from finetune_operator.shell.profiling import pod_state
from finetune_operator.planning.policy import load_policy
from finetune_operator.sizing import TrainingSetup, estimate_memory
from finetune_trainer.contract import PROFILE_PHASES, ProfileMeasurement, ProfileReport, ProfileSetup, ProfileShape

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))
from test_lifecycle import POLICY, POOLS, T0, example  # noqa: E402

CONFIG = {"model_type": "falcon", "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 512,
          "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 4096}
WRITTEN = "2026-11-30T12:00:00Z"  # when the shell wrote a model's entries (orders evictions)
IMAGE = POLICY.trainer_image  # the policy's trainer image: profile pods run it, the cache is keyed by it
SHAPE = ProfileShape(model_type="falcon", hidden_size=128, num_layers=2, vocab_size=1024, num_attention_heads=4,
                     num_key_value_heads=4, head_dim=32, intermediate_size=512)


def job(**training):
    return example("llama-8b-lora.yaml", model={"name": "m", "architecture": {"configMapRef": {"name": "cfg"}},
                                                "source": {"pvc": {"claimName": "models"}}},
                   training={"sequenceLength": 512, "globalBatchSize": 8, "maxSteps": 10, **training},
                   resources={"gpus": "auto", "maxGPUs": 4})


def test_setups_are_the_corners_of_what_the_planner_can_ask():
    profile = job_profile(job().spec)
    assert profile.strategies == ("ddp", "fsdp") and profile.checkpointing == (False, True)
    assert profile.micro_batches == (1, 2, 4, 8) and profile.worlds == (1, 2, 4)
    # ddp: W=1 only (4 b x 2 gc); fsdp: 3 W x 4 b x 2 gc
    assert len(profile.setups()) == 8 + 24
    fixed = job_profile(job(microBatchSize=2, gradientCheckpointing=True).spec)
    assert fixed.micro_batches == (2,) and len(fixed.setups()) == 1 + 3
    # One pod traces at most MAX_SETUPS_PER_POD, and its report fits the termination message even with
    # the longest keys (a list of LoRA targets).
    from finetune_operator.profiling.setups import MAX_SETUPS_PER_POD, profile_request

    long = job(gradientCheckpointing=None)
    long_spec = long.spec.model_copy(update={"lora": long.spec.lora.model_copy(update={"target_modules": [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]})})
    setups = job_profile(long_spec).setups()
    request = profile_request(long_spec, CONFIG, setups)
    assert len(request.setups) == MAX_SETUPS_PER_POD < len(setups)
    big = _report(JobProfile(request.setups[0], ("fsdp",), (True,), (1,), (1,)), lambda *a: 10**12)
    big = big.model_copy(update={"measurements": [big.measurements[0].model_copy(update={
        "key": s.key, "seconds": 12345.67, "trainable_params": 10**11, "ddp_bucket_bytes": 10**12}) for s in request.setups]})
    assert len(big.to_termination_message().encode()) <= 4096


def test_a_packed_job_is_profiled_packed_under_keys_of_their_own():
    """The profile traces packed examples as the trainer runs them (the block-diagonal mask); an
    unpacked setup's key is what it was, so the figures already cached stay valid."""
    plain = job_profile(job().spec).setups()
    packed_job = job()
    packed_job.spec.dataset.packing = True
    packed = job_profile(packed_job.spec).setups()
    assert all(s.packing for s in packed) and not any(s.packing for s in plain)
    assert [s.key + ".packed" for s in plain] == [s.key for s in packed]


@pytest.mark.parametrize("change, field", [
    (dict(method="qlora"), "spec.method"),
    (dict(training={"sequenceLength": 512, "globalBatchSize": 8, "maxSteps": 10, "optimizer": "adamw-8bit"}),
     "spec.training.optimizer"),
    (dict(resources={"gpus": "auto", "strategy": "zero3"}), "spec.resources.strategy"),
    (dict(dataset={"source": {"pvc": {"claimName": "data", "path": "d.jsonl"}}, "paddingFree": True}),
     "spec.dataset.paddingFree"),
])
def test_what_the_trace_cannot_run_is_refused_naming_the_field(change, field):
    spec = job().spec.model_copy(update={k: (type(getattr(job().spec, k)).model_validate(v) if isinstance(v, dict)
                                             else v) for k, v in change.items()})
    with pytest.raises(NotProfilable) as error:
        job_profile(spec)
    assert error.value.field == field


def _report(profile: JobProfile, peak, total: int = 100) -> ProfileReport:
    """Synthetic peaks; `total` parameters small enough that they are plausible (above the weights)."""
    ms = []
    for s in profile.setups():
        ms.append(ProfileMeasurement(key=s.key, peaks={ph: peak(ph, s.world_size, s.micro_batch_size, s)
                                                      for ph in PROFILE_PHASES},
                                     trainable_params=1000, ddp_bucket_bytes=4096))
    return ProfileReport(ok=True, shape=SHAPE, params={"total": total, "embedding": total // 10, "lmHead": total // 10},
                         measurements=ms)


affine = st.tuples(st.integers(0, 10**9), st.integers(0, 10**10), st.integers(0, 10**8))


@settings(max_examples=60, deadline=None)
@given(pieces=st.lists(affine, min_size=1, max_size=4), world=st.integers(1, 4), micro=st.integers(1, 8),
       gc=st.booleans(), strategy=st.sampled_from(["ddp", "fsdp"]))
def test_the_estimate_never_under_estimates_a_convex_piecewise_affine_peak(pieces, world, micro, gc, strategy):
    """Each phase's peak is the largest of a few moments, each affine in 1/W and b: the bilinear
    interpolation between the measured corners is exact there and never below inside."""
    profile = job_profile(job().spec)

    def truth(ph, w, b, setup=None):
        x = 1.0 / w if (setup is None or setup.strategy == "fsdp") and strategy == "fsdp" else 1.0
        scale = {"forward": 1.0, "backward": 1.2, "optimizer": 0.7}[ph]
        return int(max(a + c * x + k * b for a, c, k in pieces) * scale)

    report = _report(profile, truth)
    arch = profiled_architecture(report, profile, {m.key: m for m in report.measurements}, "h")
    setup = TrainingSetup(architecture=arch, method="lora", lora_rank=16, sequence_length=512, lora_dropout=0.05,
                          micro_batch_size=micro, gradient_checkpointing=gc, strategy=strategy, world_size=world)
    est = estimate_memory(setup)
    extra = 4096 if strategy == "ddp" and world > 1 else 0
    true_peak = max(truth(ph, world, micro) for ph in PROFILE_PHASES) + extra
    assert est.peak_allocated_bytes >= true_peak
    if micro in profile.micro_batches and (world in profile.worlds or strategy == "ddp"):
        assert est.peak_allocated_bytes - true_peak <= 1
    assert est.required_bytes > est.peak_allocated_bytes


def test_a_setup_the_profile_did_not_measure_is_a_sizing_error():
    profile = job_profile(job(gradientCheckpointing=True).spec)
    report = _report(profile, lambda ph, w, b, s: 1000 * b + 10**6 // w)
    arch = profiled_architecture(report, profile, {m.key: m for m in report.measurements}, "h")
    from finetune_operator.sizing import SizingError

    for change, field in ((dict(gradient_checkpointing=False), "gradient_checkpointing"),
                          (dict(strategy="zero3"), "strategy"), (dict(sequence_length=1024), "sequence_length")):
        kwargs = dict(architecture=arch, method="lora", sequence_length=512, lora_dropout=0.05,
                      gradient_checkpointing=True, strategy="fsdp", world_size=2)
        kwargs.update(change)
        with pytest.raises(SizingError) as error:
            estimate_memory(TrainingSetup(**kwargs))
        assert error.value.field == field


def test_cache_round_trip_and_what_is_missing():
    profile = job_profile(job(gradientCheckpointing=True).spec)
    report = _report(profile, lambda ph, w, b, s: 1000 * b)
    setups = profile.setups()
    data = cache_entries("abc", report.model_copy(update={"measurements": report.measurements[:-1]}), WRITTEN, setups)
    assert all(k.replace(".", "").replace("-", "").replace("_", "").isalnum() for k in data)
    cached = read_cache(data, "abc", setups)
    assert cached.model is not None and [s.key for s in cached.missing] == [setups[-1].key]
    data[setup_entry("abc", setups[0].key)] = "{not json"
    assert setups[0] in read_cache(data, "abc", setups).missing


# --- the lifecycle ------------------------------------------------------------


OPERATOR_NS = "finetune-system"  # where the shell runs profile pods


def _observe(spec, data, pod=None):
    seen = ps.observation(spec, CONFIG, lambda digest, setups: read_cache(data, digest, setups), IMAGE)
    return dataclasses.replace(seen, pod=pod, pod_namespace=OPERATOR_NS)


def _step(j, data, pod=None, policy=POLICY):
    return lifecycle.step(lifecycle.Observed(job=j, now=T0, policy=policy, pools=POOLS, model_config=CONFIG,
                                             profile=_observe(j.spec, data, pod)))


def _conditions(decision):
    return {c.type: (c.status, c.reason, c.message) for c in decision.status.conditions}


def _finished(manifest, report: ProfileReport | None, phase="Succeeded", terminated=None):
    pod = dict(manifest)
    term = terminated or {"exitCode": 0 if report is None or report.ok else 78}
    if report is not None:  # a pod reports at most MAX_SETUPS_PER_POD setups
        from finetune_operator.profiling.setups import MAX_SETUPS_PER_POD

        term["message"] = report.model_copy(update={"measurements": report.measurements[:MAX_SETUPS_PER_POD]}) \
            .to_termination_message()
    pod["status"] = {"phase": phase, "containerStatuses": [{"name": "profile", "state": {"terminated": term}}]}
    return pod_state(pod)


def test_an_unknown_family_is_profiled_once_then_planned_from_the_figures():
    j = job(gradientCheckpointing=True)
    first = _step(j, {})
    assert first.status.phase == "Pending" and not first.status.plan
    assert _conditions(first)["Profiled"][:2] == ("Unknown", "Profiling")
    [pod] = first.create
    # In the operator's namespace, not the tenant's: no ownerReference (none can cross namespaces), the
    # job's uid as a label, the policy's trainer image whatever the job's spec.image says.
    assert pod["kind"] == "Pod" and pod["metadata"]["namespace"] == OPERATOR_NS
    assert "ownerReferences" not in pod["metadata"] and pod["metadata"]["labels"][ps_pod.PROFILE_UID_LABEL] == "uid-1"
    assert ps_pod.is_profile_pod_of(pod, "uid-1") and not ps_pod.is_profile_pod_of(pod, "uid-2")
    assert pod["metadata"]["annotations"][ps_pod.JOB_NAMESPACE_ANNOTATION] == j.metadata.namespace
    assert pod["spec"]["containers"][0]["image"] == POLICY.trainer_image
    spec = pod["spec"]
    assert spec["automountServiceAccountToken"] is False and spec["activeDeadlineSeconds"] > 0
    assert spec["securityContext"]["runAsNonRoot"] is True
    container = spec["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["values"] == ["eu-de-berlin"]
    j = j.model_copy(update={"status": first.status})

    running = dataclasses.replace(_finished(pod, None), phase="Running", report=None)
    again = _step(j, {}, running)
    assert not again.create and again.requeue_after == ps.PROFILE_POLL_SECONDS

    profile = job_profile(j.spec)
    report = _report(profile, lambda ph, w, b, s: 10**8 * b + 10**9 // w)
    done = _finished(pod, report)
    data = cache_entries(done.config_hash, report, WRITTEN, profile.setups())  # every pod's, as the shell writes them before the step
    planned = _step(j, data, done)
    assert planned.status.phase == "Launching"
    assert _conditions(planned)["Profiled"][:2] == ("True", "Profiled")
    assert [(ref.name, ref.namespace) for ref in planned.delete if ref.kind == "Pod"] == [
        (pod["metadata"]["name"], OPERATOR_NS)]
    assert planned.status.plan.breakdown and "measured" in planned.status.plan.breakdown
    # Another job of the same model: the cache answers, no pod.
    other = _step(job(gradientCheckpointing=True), data)
    assert other.status.phase == "Launching" and not any(o["kind"] == "Pod" for o in other.create)


def test_a_profile_pod_no_node_takes_says_so_and_waits_naming_the_policy():
    """A tainted cluster without policy.profilePod tolerations: the scheduler leaves the pod Pending;
    the job waits (a node may come) with Profiled Unknown, reason ProfilePodUnschedulable, the
    scheduler's words and the policy fields that decide, and creates nothing more."""
    j = job(gradientCheckpointing=True)
    [pod] = _step(j, {}).create
    pending = {**pod, "status": {"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/3 nodes are available: 3 node(s) had untolerated taint {nvidia.com/gpu: }."}]}}
    seen = pod_state(pending)
    assert seen.phase == "Pending" and "untolerated taint" in seen.unschedulable
    d = _step(j.model_copy(update={"status": _step(j, {}).status}), {}, seen)
    status, reason, message = _conditions(d)["Profiled"]
    assert (d.status.phase, status, reason) == ("Pending", "Unknown", "ProfilePodUnschedulable")
    assert "untolerated taint" in message and "profilePod" in message and not d.create and not d.delete
    assert pod_state({**pod, "status": {"phase": "Pending"}}).unschedulable == ""
    # The platform adds the toleration (helm upgrade): the pending pod, placed by the old policy, is
    # replaced by one that tolerates the taint; a running one would be left to finish.
    tolerant = POLICY.model_copy(update={"profile_pod": load_policy({"profilePod": {"tolerations": [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}}).profile_pod})
    replaced = _step(j, {}, seen, policy=tolerant)
    assert [ref.name for ref in replaced.delete if ref.kind == "Pod"] == [pod["metadata"]["name"]]
    [new] = replaced.create
    assert new["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    running = pod_state({**pod, "status": {"phase": "Running"}})
    assert not _step(j, {}, running, policy=tolerant).delete


def test_the_planner_sizes_the_jobs_own_lora_dropout_so_a_profile_of_it_plans():
    """The planner once sized every candidate at the API's default dropout (0.05): a job with
    lora.dropout 0 was profiled at 0, and then no candidate matched the profile (NoFit, "setup not
    supported"); the analytic model counted dropout masks the job never saves."""
    from finetune_operator.planning import plan_job

    j = job(gradientCheckpointing=True)
    j = j.model_copy(update={"spec": j.spec.model_copy(update={"lora": j.spec.lora.model_copy(update={"dropout": 0.0})})})
    first = _step(j, {})
    [pod] = first.create
    profile = job_profile(j.spec)
    report = _report(profile, lambda ph, w, b, s: 10**8 * b + 10**9 // w)
    done = _finished(pod, report)
    data = cache_entries(done.config_hash, report, WRITTEN, profile.setups())
    planned = _step(j.model_copy(update={"status": first.status}), data, done)
    assert planned.status.phase == "Launching", _conditions(planned).get("Planned")
    # The analytic model: no dropout, no masks.
    spec = example("llama-8b-lora.yaml").spec
    peaks = []
    for dropout in (0.0, 0.05):
        lora = spec.lora.model_copy(update={"dropout": dropout})
        peaks.append(plan_job(spec.model_copy(update={"lora": lora}), POOLS, POLICY).predicted_peak_bytes)
    assert peaks[0] < peaks[1], peaks


def test_a_model_that_cannot_be_built_fails_naming_the_reason():
    j = job(gradientCheckpointing=True)
    [pod] = _step(j, {}).create
    bad = ProfileReport(ok=False, error="peft: Target modules {'q_proj'} not found", error_field="spec.lora.targetModules")
    d = _step(j, {}, _finished(pod, bad, phase="Failed"))
    assert d.status.phase == "Failed"
    failed = _conditions(d)["Failed"]
    assert failed[1] == "ProfileFailed" and "spec.lora.targetModules" in _conditions(d)["Validated"][2]
    assert "Target modules" in failed[2]
    killed = _finished(pod, None, phase="Failed", terminated={"exitCode": 137, "reason": "OOMKilled"})
    d = _step(j, {}, killed)
    assert d.status.phase == "Failed" and "OOMKilled" in _conditions(d)["Failed"][2]


def test_a_job_the_profile_cannot_trace_is_invalid_naming_the_field():
    j = example("llama-8b-lora.yaml", model={"name": "m", "architecture": {"configMapRef": {"name": "cfg"}},
                                              "source": {"pvc": {"claimName": "models"}}},
                method="qlora")
    seen = ps.observation(j.spec, CONFIG, lambda digest, setups: read_cache({}, digest, setups), IMAGE)
    d = lifecycle.step(lifecycle.Observed(job=j, now=T0, policy=POLICY, pools=POOLS, model_config=CONFIG, profile=seen))
    assert d.status.phase == "Failed" and "spec.method" in _conditions(d)["Validated"][2]
    assert not d.create


def test_a_job_may_ask_for_the_profile_of_a_family_the_analytic_model_knows():
    j = example("llama-8b-lora.yaml", training={"sequenceLength": 512, "globalBatchSize": 8, "maxSteps": 10,
                                               "gradientCheckpointing": True})
    j = j.model_copy(update={"metadata": j.metadata.model_copy(update={"annotations": {ps.PROFILE_ANNOTATION: "true"}})})
    config = ps.needs_profile(j.spec, None, asked=True)
    assert config is not None and config["model_type"] == "llama"
    assert ps.needs_profile(j.spec, None) is None  # not asked: the analytic model sizes it

    def step(data, pod=None):
        seen = dataclasses.replace(ps.observation(j.spec, config, lambda d, s: read_cache(data, d, s), IMAGE), pod=pod,
                                   pod_namespace=OPERATOR_NS)
        return lifecycle.step(lifecycle.Observed(job=j, now=T0, policy=POLICY, pools=POOLS, profile=seen))

    first = step({})
    assert first.status.phase == "Pending" and "asks for a measured profile" in _conditions(first)["Profiled"][2]
    [pod] = first.create
    profile = job_profile(j.spec)
    report = _report(profile, lambda ph, w, b, s: 10**9 * b + 10**10 // w)
    done = _finished(pod, report)
    planned = step(cache_entries(done.config_hash, report, WRITTEN, profile.setups()), done)  # every pod's, as the shell cached them
    assert planned.status.phase == "Launching" and "measured" in planned.status.plan.breakdown
