"""The pre-flight profile against the same truth (`python bench/sizing_accuracy.py --profile`).

For each setup of the accuracy matrix, the profile is what the operator would run for a job with a
global batch of 8 and maxGPUs 8: the traced grid of the planner's range (micro-batch 1, 2, 4, 8; FSDP
at 1, 2, 4, 8 GPUs; DDP on one GPU, its reducer buckets added for more), and the estimate is the
planner's profile estimator (finetune_operator.profiling.estimate) at the setup. The matrix's setups
lie on that grid, where the estimate is the measurement itself; between grid points it interpolates
(tests/trainer/test_profile.py checks an inside point). The truth is bench/sizing_truth.py's cached
measurement of the setup itself (the same tracing code: finetune_trainer.profile). Each profile runs
in its own process; its CPU time (user + system of that process, interpreter start-up excluded) per
traced setup is reported, the figure the issue's goal (under 60 s per setup for an 8B model) is
about. Profiles are cached in bench/results/sizing_profile.json (--refresh re-measures).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "operator"))
sys.path.insert(0, os.path.join(HERE, "..", "images", "trainer"))

PROFILE_CACHE = os.path.join(HERE, "results", "sizing_profile.json")
GIB = 1 << 30
GLOBAL_BATCH = 8
MAX_GPUS = 8


def _job_profile(case):
    from sizing_truth import profile_setup

    from finetune_operator.profiling.setups import JobProfile, grid

    template = profile_setup(case.setup())
    return JobProfile(template, (case.strategy,), (case.gc,), grid(GLOBAL_BATCH), grid(MAX_GPUS))


def measure_one(case) -> dict:
    """In this process: the profile of `case`'s corners and the estimate at `case` (JSON-able)."""
    from finetune_trainer import profile as P
    from finetune_trainer.contract import ProfileRequest
    from finetune_operator.profiling.estimate import profiled_architecture
    from finetune_operator.sizing import TrainingSetup, estimate_memory

    jp = _job_profile(case)
    setups = jp.setups()
    config = case.setup().architecture.to_hf_config()
    cpu0 = time.process_time()
    wall0 = time.perf_counter()
    report = P.run_profile(ProfileRequest(config=config, setups=setups))
    cpu = time.process_time() - cpu0
    if not report.ok:
        return {"error": report.error}
    arch = profiled_architecture(report, jp, {m.key: m for m in report.measurements}, "bench")
    s = case.setup()
    est = estimate_memory(TrainingSetup(
        architecture=arch, method=s.method, lora_rank=s.lora_rank, lora_targets=s.lora_targets,
        lora_dropout=s.lora_dropout, precision=s.precision, micro_batch_size=s.micro_batch_size,
        sequence_length=s.sequence_length, gradient_checkpointing=s.gradient_checkpointing,
        attention=s.attention, strategy=s.strategy, world_size=s.world_size))
    return {"peak_bytes": est.peak_allocated_bytes, "setups": len(setups), "cpu_s": cpu,
            "wall_s": time.perf_counter() - wall0, "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}


def _run(case_key: str) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), case_key], capture_output=True, text=True,
                          timeout=7200)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(cases, truths: dict, *, cached: bool, refresh: bool) -> int:
    from sizing_accuracy import load_cache, save_cache

    # The profile traces the plain training step: setups with lean-trainer levers are not its to size.
    cases = [c for c in cases if not getattr(c, "levers", ())]
    results = load_cache(PROFILE_CACHE)
    todo = [c for c in cases if refresh or c.key not in results or "error" in results[c.key]]
    if todo and not cached:
        print(f"profiling {len(todo)} setups, one process each ...", file=sys.stderr)
        for case in todo:
            results[case.key] = _run(case.key)
            save_cache({case.key: results[case.key]}, PROFILE_CACHE)
            print(f"  {case.key}: {results[case.key]}", file=sys.stderr)
    header = f"{'setup':<62} {'profile GiB':>11} {'truth GiB':>9} {'err %':>7} {'traced':>6} {'CPU s/setup':>11}"
    print(header)
    print("-" * len(header))
    errors, per_setup = [], {}
    for c in cases:
        got, truth = results.get(c.key), truths.get(c.key)
        if not got or "error" in got or not truth or "error" in truth:
            print(f"{c.key:<62} {'n/a':>11}  {(got or {}).get('error') or (truth or {}).get('error') or 'not measured'}")
            continue
        err = (got["peak_bytes"] - truth["peak_bytes"]) / truth["peak_bytes"] * 100
        errors.append(err)
        cpu = got["cpu_s"] / got["setups"]
        per_setup.setdefault(c.preset, []).append(cpu)
        print(f"{c.key:<62} {got['peak_bytes'] / GIB:>11.2f} {truth['peak_bytes'] / GIB:>9.2f} {err:>+7.2f} "
              f"{got['setups']:>6} {cpu:>11.1f}")
    if errors:
        abs_err = [abs(e) for e in errors]
        ok = max(abs_err) <= 2 and min(errors) >= 0
        print("-" * len(header))
        print(f"setups {len(errors)}  median |err| {statistics.median(abs_err):.2f}%  worst |err| {max(abs_err):.2f}%  "
              f"most negative {min(errors):+.2f}%  goal (within 2%, never under): {'MET' if ok else 'NOT MET'}")
        for preset, cpus in sorted(per_setup.items()):
            print(f"  {preset}: {statistics.mean(cpus):.1f} s CPU per traced setup (max {max(cpus):.1f})")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    from sizing_accuracy import matrix

    key = sys.argv[1]
    (case,) = [c for c in matrix() if c.key == key]
    print(json.dumps(measure_one(case)))
