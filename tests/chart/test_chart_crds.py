"""The chart's crds/: only the FineTuneJob CRD, the generated one, byte for byte."""

from __future__ import annotations

from chart_support import CHART

REPO = CHART.parents[1]


def test_chart_crd_is_the_generated_crd():
    chart_copy = (CHART / "crds" / "finetunejob.yaml").read_text()
    generated = (REPO / "crds" / "finetunejob.yaml").read_text()
    assert chart_copy == generated, (
        "charts/finetune-operator/crds/finetunejob.yaml differs from crds/finetunejob.yaml: run `make crd` "
        "(it regenerates the CRD and copies it into the chart); never edit the chart's copy by hand"
    )


def test_chart_crds_are_only_ours():
    """Only the FineTuneJob CRD: the leader election uses a built-in Lease, no kopf peering CRDs."""
    names = sorted(p.name for p in (CHART / "crds").iterdir())
    assert names == ["finetunejob.yaml"]
