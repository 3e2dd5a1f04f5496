"""The process runner's parts without a cluster: $(VAR) expansion, the lab GPU's rule for real
processes (fate.lab_gpu_environment) and the trainer's side of it (finetune_trainer.faults), the
runner pool's nodes, and one container run for real (mount namespace, cgroup, CRI log, exit code,
OOMKilled, termination message) where this machine allows it (root, cgroup v1 memory)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from e2e.lab import fate
from e2e.lab.nodes import RUNNER_LABEL, RUNNER_TAINT, load_pools, node_manifest
from e2e.lab.podrunner import ContainerRun, expand
from finetune_trainer import faults
from finetune_trainer.errors import ConfigError

GIB = 1024**3


# ---- $(VAR) expansion ---------------------------------------------------------------------------
def test_expand_replaces_known_variables_and_keeps_the_rest():
    env = {"A": "1", "MASTER_PORT": "23456"}
    assert expand("--port=$(MASTER_PORT)", env) == "--port=23456"
    assert expand("$(UNKNOWN)-$(A)", env) == "$(UNKNOWN)-1"
    assert expand("$$(A)", env) == "$(A)"  # $$ is a literal $ (the kubelet's rule)


@given(st.text(alphabet=st.characters(blacklist_characters="$"), max_size=30))
def test_expand_leaves_text_without_references_alone(text):
    assert expand(text, {"A": "x"}) == text


# ---- the lab GPU's rule for real processes ----------------------------------------------------------
def _pod(attempt=1, predicted=50 * GIB, gpu_mib=81559):
    return fate.TrainingPod("ns/p", predicted, gpu_mib, attempt=attempt)


def _rule(**values):
    return fate.resolve_rule([fate.RuleSource("test", values)])


def test_the_plan_that_does_not_fit_gets_a_peak_over_the_gpu():
    env = fate.lab_gpu_environment(_pod(), _rule(**{"true-peak-factor": "1.7", "oom-step": "10"}))
    assert int(env[fate.LAB_PEAK_ENV]) == int(50 * GIB * 1.7) > int(env[fate.LAB_GPU_MEMORY_ENV]) == 81559 * 1024**2
    assert env[fate.LAB_OOM_STEP_ENV] == "10" and env[fate.LAB_OOM_PHASE_ENV] == "backward"
    fits = fate.lab_gpu_environment(_pod(), _rule())
    assert int(fits[fate.LAB_PEAK_ENV]) <= int(fits[fate.LAB_GPU_MEMORY_ENV])


def test_forced_gpu_oom_by_attempt():
    rule = _rule(**{"outcome-by-attempt": "gpu-oom,auto"})
    first = fate.lab_gpu_environment(_pod(attempt=1, predicted=GIB), rule)
    second = fate.lab_gpu_environment(_pod(attempt=2, predicted=GIB), rule)
    assert int(first[fate.LAB_PEAK_ENV]) > int(first[fate.LAB_GPU_MEMORY_ENV])
    assert int(second[fate.LAB_PEAK_ENV]) == GIB


@pytest.mark.parametrize("outcome", ["host-oom", "evicted", "fail", "succeed"])
def test_fake_only_outcomes_are_refused_for_real_processes(outcome):
    with pytest.raises(fate.RuleError, match="process runner takes only auto, gpu-oom"):
        fate.lab_gpu_environment(_pod(), _rule(outcome=outcome))


@pytest.mark.parametrize("key,value,why", [("oom-step", "0", "integer step >= 1"), ("oom-step", "x", "integer"),
                                           ("host-memory-scale", "0", r"\(0, 1\]"), ("host-memory-scale", "2", r"\(0, 1\]")])
def test_bad_runner_rule_values_name_the_key(key, value, why):
    with pytest.raises(fate.RuleError, match=f"lab.finetune.dev/{key}.*{why}"):
        _rule(**{key: value})


def test_the_checkpoint_oom_phase_is_refused():
    with pytest.raises(fate.RuleError, match="oom-phase 'checkpoint'"):
        fate.lab_gpu_environment(_pod(), _rule(**{"oom-phase": "checkpoint"}))


# ---- the trainer's side: finetune_trainer.faults.lab_gpu_oom -----------------------------------------
def _env(peak, total=80 * GIB, **more):
    return {faults.LAB_GPU_MEMORY_ENV: str(total), faults.LAB_PEAK_ENV: str(peak), **more}


def test_the_trainer_raises_at_the_rule_step_or_its_first_step_after_a_resume():
    fault, message = faults.lab_gpu_oom(0, _env(81 * GIB, **{faults.LAB_OOM_STEP_ENV: "10"}))
    assert (fault.kind, fault.step, fault.phase) == ("gpu-oom", 10, "backward")
    assert "CUDA out of memory" in message and "finetune lab GPU" in message
    resumed, _ = faults.lab_gpu_oom(12, _env(81 * GIB, **{faults.LAB_OOM_STEP_ENV: "10"}))
    assert resumed.step == 13
    first, _ = faults.lab_gpu_oom(8, _env(81 * GIB))
    assert first.step == 9


def test_the_trainer_runs_normally_where_the_peak_fits_or_no_lab_gpu_is_there():
    assert faults.lab_gpu_oom(0, _env(80 * GIB)) is None
    assert faults.lab_gpu_oom(0, {}) is None


@pytest.mark.parametrize("env,name", [({faults.LAB_GPU_MEMORY_ENV: "1"}, faults.LAB_PEAK_ENV),
                                      (_env("lots"), faults.LAB_PEAK_ENV),
                                      (_env(81 * GIB, **{faults.LAB_OOM_PHASE_ENV: "checkpoint"}), faults.LAB_OOM_PHASE_ENV)])
def test_bad_lab_variables_are_config_errors_naming_the_variable(env, name):
    with pytest.raises(ConfigError, match=name):
        faults.lab_gpu_oom(0, env)


def test_the_lab_and_the_trainer_agree_on_the_variable_names():
    assert (fate.LAB_GPU_MEMORY_ENV, fate.LAB_PEAK_ENV, fate.LAB_OOM_STEP_ENV, fate.LAB_OOM_PHASE_ENV) == (
        faults.LAB_GPU_MEMORY_ENV, faults.LAB_PEAK_ENV, faults.LAB_OOM_STEP_ENV, faults.LAB_OOM_PHASE_ENV)


# ---- the runner pool ------------------------------------------------------------------------------------
def test_only_the_runner_pool_is_marked_for_the_runner():
    catalog = load_pools()
    kwok_pools = [p for p in catalog.pools if p.runner != "kubelet"]  # the real node registers itself
    marked = {m["metadata"]["name"] for p in kwok_pools for i in range(p.nodes)
              if RUNNER_LABEL in (m := node_manifest(p, i))["metadata"]["labels"]}
    assert marked == set(catalog.runner_nodes()) and marked
    for pool in kwok_pools:
        tainted = [node_manifest(pool, i)["spec"]["taints"] for i in range(pool.nodes)]
        assert all((RUNNER_TAINT in t) == (pool.runner == "process") for t in tainted), pool.name
    assert all(p.region not in ("eu-de-berlin", "eu-fr-paris") for p in catalog.pools if p.runner)


# ---- one container, for real ---------------------------------------------------------------------------
def _can_run_containers() -> bool:
    from finetune_trainer.launch import memory_cgroup_dir

    own = memory_cgroup_dir()
    return os.geteuid() == 0 and own is not None and (own / "memory.oom_control").is_file()


needs_root_cgroup_v1 = pytest.mark.skipif(not _can_run_containers(), reason="needs root and the cgroup v1 memory controller")


def _container(tmp_path: Path, name: str, script: str, limit: int | None, policy: str = "FallbackToLogsOnError"):
    import json

    from e2e.lab.podrunner import memory_cgroup_root

    root = memory_cgroup_root()
    root.mkdir(exist_ok=True)
    run = ContainerRun(name=name, spec={"name": name, "terminationMessagePolicy": policy},
                       log_file=tmp_path / f"{name}.log", message_file=tmp_path / f"{name}.msg",
                       cgroup=root / f"unit-{os.getpid()}-{name}")
    volume = tmp_path / "vol"
    volume.mkdir(exist_ok=True)
    (volume / "key").write_text("from-the-volume")
    spec = {"cgroup": str(run.cgroup), "workingDir": "/etc/unit-lab-vol",
            "mounts": [{"source": str(volume), "target": "/etc/unit-lab-vol", "readOnly": True},
                       {"source": str(run.message_file), "target": "/dev/termination-log"}],
            "argv": [sys.executable, "-c", script], "env": {"PATH": "/usr/bin:/bin", "X": "y"}}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(spec))
    run.start(path, limit)
    run.wait()
    return run


@needs_root_cgroup_v1
def test_a_container_sees_its_volume_env_and_message_file(tmp_path):
    script = ("import os; print(open('key').read(), os.environ['X'], sorted(os.environ));"
              "open('/dev/termination-log', 'w').write('bye')")
    run = _container(tmp_path, "ok", script, 256 * 1024**2)
    assert (run.exit_code, run.reason, run.message) == (0, "Completed", "bye")
    lines = run.log_file.read_text().splitlines()
    # CRI format: timestamp, stream, full-line tag, text.
    stamp, stream, tag, text = lines[0].split(" ", 3)
    assert stamp.endswith("Z") and stream == "stdout" and tag == "F"
    # Exactly the given environment (Python itself adds LC_CTYPE under the C locale), none of the runner's.
    assert text.startswith("from-the-volume y [") and "'HOME'" not in text and "'PYTHONPATH'" not in text, text
    assert not (Path("/etc/unit-lab-vol") / "key").exists()  # the mount was the container's alone


@needs_root_cgroup_v1
def test_a_failing_container_falls_back_to_its_log_tail(tmp_path):
    run = _container(tmp_path, "bad", "import sys; print('one'); sys.exit(3)", None)
    assert (run.exit_code, run.reason, run.message) == (3, "Error", "one")
    run = _container(tmp_path, "bad2", "import sys; print('one'); sys.exit(3)", None, policy="File")
    assert run.message == ""


@needs_root_cgroup_v1
def test_exceeding_the_memory_limit_is_a_real_oom_kill(tmp_path):
    run = _container(tmp_path, "oom", "x = []\nwhile True: x.append(bytearray(10**7))", 64 * 1024**2)
    assert (run.exit_code, run.reason) == (137, "OOMKilled")
    assert not run.cgroup.exists()  # removed after the container ended


def test_python_stays_visible_where_a_pod_volume_covers_it():
    from e2e.lab.podrunner import IMAGE_BIN, TRAINER_PATH, image_paths

    venv, base = Path("/tmp/ci/venv"), Path("/usr")
    # The scratch emptyDir at /tmp covers a virtual environment under /tmp: it is mounted back.
    assert image_paths([Path("/tmp"), Path("/etc/hosts")], (base, venv)) == [TRAINER_PATH, IMAGE_BIN, venv]
    assert image_paths([Path("/tmp/ci")], (base, venv)) == [TRAINER_PATH, IMAGE_BIN, venv]
    # Nothing covers it: nothing more is mounted (a python under /usr is never mounted over itself).
    assert image_paths([Path("/checkpoints"), Path("/tmp")], (base,)) == [TRAINER_PATH, IMAGE_BIN]
    assert image_paths([Path("/tmp/civ")], (venv,)) == [TRAINER_PATH, IMAGE_BIN]
