"""Fast tests of what the chaos benchmark adds to the lab (no cluster): the fake GPU's per-attempt
outcomes and its kubelet-style eviction, and the kwok stage that renders the pod-level reason."""

from __future__ import annotations

import pytest
import yaml

from e2e.lab import fate
from e2e.lab.cluster import LAB_STAGES

GIB = fate.GIB


def _rule(**values):
    return fate.resolve_rule([fate.RuleSource("pod ns/p", {k.replace("_", "-"): v for k, v in values.items()})])


def test_outcome_by_attempt_picks_the_attempts_entry_and_repeats_the_last():
    rule = _rule(outcome_by_attempt="host-oom, evicted,auto")
    small = 1 * GIB
    verdicts = [fate.decide(fate.TrainingPod("p", small, 81559, attempt=n), rule) for n in (1, 2, 3, 7)]
    assert [v.summary.split()[0] for v in verdicts] == ["host-oom", "evicted", "succeed:", "succeed:"]
    # Without an attempt label the plain outcome applies.
    assert fate.decide(fate.TrainingPod("p", small, 81559), rule).exit_code == 0


def test_outcome_by_attempt_rejects_unknown_outcomes():
    with pytest.raises(fate.RuleError, match="outcome-by-attempt"):
        _rule(outcome_by_attempt="host-oom,explode")


def test_eviction_looks_like_the_kubelets():
    v = fate.decide(fate.TrainingPod("p", GIB, 81559), _rule(outcome="evicted"))
    assert (v.pod_phase, v.pod_reason, v.exit_code) == ("Failed", "Evicted", 137)
    annotations = v.annotations()
    assert annotations[fate.VERDICT_POD_REASON] == "Evicted"
    assert "low on resource: memory" in annotations[fate.VERDICT_POD_MESSAGE]
    # Other verdicts carry no pod-level reason.
    assert fate.VERDICT_POD_REASON not in fate.decide(fate.TrainingPod("p", GIB, 81559), fate.Rule()).annotations()


def test_attempt_of_reads_the_label():
    assert fate.attempt_of({fate.ATTEMPT_LABEL: "3"}) == 3
    assert fate.attempt_of({fate.ATTEMPT_LABEL: "x"}) is None and fate.attempt_of(None) is None


def test_kwok_stage_renders_the_pod_reason_and_message():
    template = yaml.safe_load(LAB_STAGES.read_text())["spec"]["next"]["statusTemplate"]
    for key in (fate.VERDICT_POD_REASON, fate.VERDICT_POD_MESSAGE):
        assert f'"{key}"' in template
