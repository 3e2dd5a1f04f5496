"""The chart's crds/: the FineTuneJob CRD is the generated one, byte for byte, and the kopf peering
CRDs are structural and match what kopf 1.x talks to."""

from __future__ import annotations

import yaml

from chart_support import CHART

REPO = CHART.parents[1]


def test_chart_crd_is_the_generated_crd():
    chart_copy = (CHART / "crds" / "finetunejob.yaml").read_text()
    generated = (REPO / "crds" / "finetunejob.yaml").read_text()
    assert chart_copy == generated, (
        "charts/finetune-operator/crds/finetunejob.yaml differs from crds/finetunejob.yaml: run `make crd` "
        "(it regenerates the CRD and copies it into the chart); never edit the chart's copy by hand"
    )


def test_chart_crds_are_only_ours_and_kopfs():
    names = sorted(p.name for p in (CHART / "crds").iterdir())
    assert names == ["finetunejob.yaml", "kopf-peering.yaml"]


def _peering_crds() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all((CHART / "crds" / "kopf-peering.yaml").read_text()) if d]
    return {d["metadata"]["name"]: d for d in docs}


def test_kopf_peering_crds():
    import kopf._cogs.structs.references as refs  # the group/version/plural kopf itself uses

    crds = _peering_crds()
    assert sorted(crds) == ["clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"]
    for selector, scope in ((refs.CLUSTER_PEERINGS_K, "Cluster"), (refs.NAMESPACED_PEERINGS_K, "Namespaced")):
        crd = crds[f"{selector.any_name}.{selector.group}"]
        assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
        spec = crd["spec"]
        assert spec["group"] == selector.group and spec["scope"] == scope
        assert spec["names"]["plural"] == selector.any_name
        (version,) = spec["versions"]
        assert version["name"] == selector.version and version["served"] and version["storage"]
        # kopf patches peers into .status of the main resource: a status subresource would make those
        # patches go nowhere (and need another RBAC rule).
        assert "subresources" not in version
        status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
        assert status == {**status, "type": "object", "x-kubernetes-preserve-unknown-fields": True}
