"""The chaos benchmark (bench/chaos.py) at a size that fits CI: every fate once (13 jobs), the
operator SIGKILLed 4 times, the kube-apiserver restarted once, status patches, foreign objects
with clashing names and queued children, on a lab of its own (the operator it runs must be the
only one reconciling, so it does not share the session's lab, where test_operator.py runs one).

It asserts the issue's goals: no duplicate training jobs, attempt numbers never going back,
nothing lost or stuck, no foreign object touched, no queued child un-suspended, every job in
its expected terminal state. FINETUNE_CHAOS_JOBS / FINETUNE_CHAOS_KILLS / FINETUNE_CHAOS_SEED
change the size and the seed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from e2e.lab.build import find_installation

pytestmark = pytest.mark.e2e


def test_chaos_small(tmp_path: Path) -> None:
    if find_installation() is None:
        if os.environ.get("FINETUNE_LAB_REQUIRED", "") not in ("", "0", "false", "no"):
            pytest.fail("FINETUNE_LAB_REQUIRED=1 but the lab binaries are not built (e2e/lab/build.sh)", pytrace=False)
        pytest.skip("lab binaries are not built: run e2e/lab/build.sh")
    from bench.chaos import Config, run_benchmark, summary, table

    cfg = Config(
        jobs=int(os.environ.get("FINETUNE_CHAOS_JOBS", "13")),
        kills=int(os.environ.get("FINETUNE_CHAOS_KILLS", "4")),
        apiserver_restarts=1,
        seed=int(os.environ.get("FINETUNE_CHAOS_SEED", "7")),
        namespaces=2,
        concurrency=13,
        gap_min=3.0,
        gap_max=12.0,
        deadline=420.0,
        json_out=tmp_path / "chaos.json",
    )
    result = run_benchmark(cfg)
    cfg.json_out.write_text(json.dumps(result, indent=2, default=str))
    print(table(result))
    print(summary(result))
    f = result["figures"]
    problems = []
    if f["duplicate_training_jobs"]:
        problems.append(f"duplicate training jobs: {[(d['job'], d['live']) for d in result['duplicates']]}")
    if f["attempt_numbers_backwards"]:
        problems.append(f"attempt numbers went backwards: {[(r['job'], r['created']) for r in result['attempt_regressions']]}")
    if f["foreign_touched"]:
        problems.append(f"foreign objects touched: {[(x['name'], [e['what'] for e in x['events']]) for x in result['foreign'] if x['events']]}"
                        f"{' (adopted: ' + str(f['foreign_adopted']) + ')' if f['foreign_adopted'] else ''}")
    if f["unsuspended_by_others"]:
        problems.append(f"queued children un-suspended before admission: {len(result['unsuspended'])}, "
                        f"e.g. {result['unsuspended'][0]['pytorchjob']} by {result['unsuspended'][0]['managers']}")
    if f["lost_or_stuck"]:
        problems.append(f"lost or stuck: {result['stuck']}")
    wrong = [(j["name"], j["expected"], j["final"]) for j in result["jobs"] if not j["right"]]
    if wrong:
        problems.append(f"not in the expected terminal state: {wrong}")
    if not f["settled"]:
        problems.append("the cluster never settled before the deadline")
    assert not problems, "\n".join(problems) + f"\ndetails: {cfg.json_out}; operator log: {result['logs']['operator']}"
