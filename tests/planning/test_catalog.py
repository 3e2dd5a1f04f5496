"""The catalog and the policy: loading, defaults, and errors that name the pool and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from finetune_operator.planning import CatalogError, PolicyError, load_catalog, load_policy
from finetune_operator.planning.pools import GiB, MiB, GpuLabel, QuantityError, canonical_gpu_name, parse_quantity

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pools.yaml"


def _pool(**fields):
    base = {"name": "p1", "region": "eu-de-berlin", "gpuType": "H100-80GB", "gpusPerNode": 8, "maxNodes": 2}
    base.update(fields)
    return base


def test_example_catalog_is_realistic():
    pools = load_catalog(EXAMPLE.read_text())
    regions = {p.region for p in pools}
    assert {"eu-de-berlin", "eu-fr-paris", "us-east-virginia"} <= regions
    assert {"H100-80GB", "A100-80GB", "A100-40GB", "L40S-48GB", "H200-141GB"} <= {p.gpu_type for p in pools}
    assert all(p.price_per_gpu_hour for p in pools)
    assert all(p.selector == {"karpenter.sh/nodepool": p.name} for p in pools)
    h200 = next(p for p in pools if p.gpu_type == "H200-141GB")
    assert h200.gpu_memory_bytes == 143771 * MiB
    assert next(p for p in pools if p.gpu_type == "L40S-48GB").intra_node == "pcie"


def test_defaults_and_quantities():
    (pool,) = load_catalog({"pools": [_pool(gpuType="NVIDIA-A100-SXM4-80GB", hostMemory="1Ti", cpus=96)]})
    assert pool.gpu_type == "A100-80GB"  # product spellings become canonical
    assert pool.gpu_memory_bytes == 81920 * MiB
    assert pool.host_memory_bytes == 1024 * GiB
    assert pool.selector == {"karpenter.sh/nodepool": "p1"}
    assert pool.free_gpus is None and pool.source == "catalog"
    (custom,) = load_catalog([_pool(gpuType="B200-192GB", gpuMemory="180Gi", peakTflops=2250,
                                    gpuLabel={"values": ["NVIDIA-B200"]})])
    assert custom.gpu_memory_bytes == 180 * GiB and custom.tflops == 2250
    assert custom.gpu_label == GpuLabel(key="nvidia.com/gpu.product", values=["NVIDIA-B200"])


@pytest.mark.parametrize(
    "pools, expected",
    [
        ([_pool(), _pool()], "pool 'p1' (pools[1]): name: duplicate of pools[0]"),
        ([_pool(gpuType="B300")], "pool 'p1' (pools[0]): gpuType: unknown GPU type 'B300' and no gpuMemory given"),
        ([_pool(gpusPerNode=-1)], "pool 'p1' (pools[0]): gpusPerNode: Input should be greater than or equal to 1"),
        ([_pool(maxNodes=-2)], "pool 'p1' (pools[0]): maxNodes: Input should be greater than or equal to 0"),
        ([_pool(freeGpus=-1)], "pool 'p1' (pools[0]): freeGpus: Input should be greater than or equal to 0"),
        ([_pool(pricePerGpuHour=-3)], "pool 'p1' (pools[0]): pricePerGpuHour"),
        ([_pool(hostMemory="lots")], "pool 'p1' (pools[0]): hostMemory: not a Kubernetes quantity: 'lots'"),
        ([_pool(colour="red")], "pool 'p1' (pools[0]): colour: unknown field"),
        ([_pool(intraNode="infiniband")], "pool 'p1' (pools[0]): intraNode"),
        ([_pool(name="H100_Berlin")], "pool 'H100_Berlin' (pools[0]): name: must be a DNS-1123 label"),
        ([{"region": "x", "gpuType": "H100-80GB", "gpusPerNode": 1, "maxNodes": 1}], "pools[0]: name: required field"),
        (["h100"], "pools[0]: must be a mapping of pool fields"),
        ([_pool(taints=[{"key": "a", "effect": "Sometimes"}])], "pool 'p1' (pools[0]): taints.0.effect"),
    ],
)
def test_catalog_errors_name_pool_and_field(pools, expected):
    with pytest.raises(CatalogError) as error:
        load_catalog({"pools": pools})
    assert str(error.value).startswith(expected), str(error.value)


def test_catalog_shape_errors():
    with pytest.raises(CatalogError, match="not valid YAML"):
        load_catalog("pools: [")
    with pytest.raises(CatalogError, match="pools: must be a list"):
        load_catalog({"pools": {"name": "x"}})
    with pytest.raises(CatalogError, match="expected a 'pools' list"):
        load_catalog({"nodes": []})


def test_policy_loads_catalog_with_its_pool_label_and_names_errors():
    policy = load_policy(
        "allowedRegions: [eu-de-berlin]\n"
        "regionLabelKey: node-restriction.kubernetes.io/region\n"
        "poolLabelKeys: [cloud.google.com/gke-nodepool]\n"
        "catalog:\n- {name: a100, region: eu-de-berlin, gpuType: A100-80GB, gpusPerNode: 8, maxNodes: 1}\n"
    )
    assert policy.allowed_regions == ["eu-de-berlin"]
    assert policy.region_label_key == "node-restriction.kubernetes.io/region"
    assert policy.catalog[0].selector == {"cloud.google.com/gke-nodepool": "a100"}
    with pytest.raises(PolicyError, match=r"policy.catalog: pool 'a' \(pools\[0\]\): gpusPerNode"):
        load_policy({"catalog": [_pool(name="a", gpusPerNode=0)]})
    with pytest.raises(PolicyError, match="defaultMemoryHeadroom"):
        load_policy({"defaultMemoryHeadroom": 0.9})
    with pytest.raises(PolicyError, match="allowedRegions: .*unique"):
        load_policy({"allowedRegions": ["a", "a"]})
    with pytest.raises(PolicyError, match="regionKey: unknown field"):
        load_policy({"regionKey": "x"})
    assert load_policy("").allowed_regions == []  # nothing allowed unless the platform says so


@pytest.mark.parametrize(
    "text, value",
    [
        ("1e3", 1000),  # decimal exponent: the hand-written parser refused it
        ("1Ei", 2**60),  # exbi: refused too
        ("2E", 2 * 10**18),  # exa
        ("500m", 0.5),
        ("16Gi", 16 * GiB),
        ("2063146352Ki", 2063146352 * 1024),
        ("191500m", 191.5),
        ("1.5Gi", 1.5 * GiB),
        ("0", 0),
        (8, 8),
    ],
)
def test_kubernetes_quantities(text, value):
    assert parse_quantity(text) == value


@pytest.mark.parametrize(
    "text, why",
    [
        ("8 GPUs", "not a Kubernetes quantity"),
        ("1.5.5", "not a Kubernetes quantity"),
        ("", "not a Kubernetes quantity"),
        ("1Gb", "not a Kubernetes quantity"),
        (" 16Gi", "not a Kubernetes quantity"),  # Decimal strips spaces, the API server does not
        ("1_000", "not a Kubernetes quantity"),  # Decimal's digit separator
        ("inf", "not a Kubernetes quantity"),
        ("NaN", "not a Kubernetes quantity"),
        ("\u0663", "not a Kubernetes quantity"),  # an Arabic-Indic three: a Decimal digit, not the API's
        ("-1Gi", "must not be negative"),
        ("1e999999999", "larger than the API server can hold"),  # as an int it would take gigabytes
        (True, "not a Kubernetes quantity"),
        (None, "not a Kubernetes quantity"),
    ],
)
def test_invalid_quantities_name_the_field(text, why):
    with pytest.raises(QuantityError) as error:
        parse_quantity(text, "hostMemory")
    assert str(error.value).startswith(f"hostMemory: {why}: {text!r}"), str(error.value)


def test_catalog_quantities_in_every_form_and_errors_naming_pool_and_field():
    (pool,) = load_catalog([_pool(gpuType="B200-192GB", gpuMemory="1.8e11", hostMemory="2Ei",
                                  gpuLabel={"values": ["NVIDIA-B200"]})])
    assert pool.gpu_memory_bytes == 180_000_000_000 and pool.host_memory_bytes == 2 * 2**60
    with pytest.raises(CatalogError, match=r"^pool 'p1' \(pools\[0\]\): gpuMemory: must not be negative: '-80Gi'"):
        load_catalog([_pool(gpuMemory="-80Gi")])


def test_gpu_names():
    assert canonical_gpu_name("nvidia-h100-80gb") == "H100-80GB"
    assert canonical_gpu_name("NVIDIA-H200") == "H200-141GB"
    assert canonical_gpu_name("Something-Else") == "Something-Else"


def test_a_known_gpu_type_says_how_its_nodes_are_labelled():
    # Pods are pinned to the GPU label: the catalog fills it from the GPU table, under GPU Feature
    # Discovery's label by default, or under the label the pool names (GKE's own, without GFD).
    (gfd, gke) = load_catalog([
        _pool(name="a", gpuType="A100-80GB"),
        _pool(name="b", gpuType="nvidia-tesla-a100", gpuLabel={"key": "cloud.google.com/gke-accelerator"}),
    ])
    assert gfd.gpu_label == GpuLabel(key="nvidia.com/gpu.product", values=["NVIDIA-A100-80GB-PCIe", "NVIDIA-A100-SXM4-80GB"])
    assert gke.gpu_type == "A100-40GB"
    assert gke.gpu_label == GpuLabel(key="cloud.google.com/gke-accelerator", values=["nvidia-tesla-a100"])


@pytest.mark.parametrize(
    "fields, expected",
    [
        # A type the table does not know: nobody can guess what GFD writes for it.
        ({"gpuType": "B200-192GB", "gpuMemory": "180Gi"}, "gpuLabel: the GPU table does not know the values of"
                                                          " nvidia.com/gpu.product on B200-192GB nodes; give gpuLabel.values"),
        # A label the table has no values for.
        ({"gpuLabel": {"key": "example.com/gpu"}}, "gpuLabel: the GPU table does not know the values of example.com/gpu"),
        # Values of another GPU type would pin an H100 pool's pods to A100 nodes.
        ({"gpuLabel": {"values": ["NVIDIA-A100-SXM4-80GB"]}}, "gpuLabel: values ['NVIDIA-A100-SXM4-80GB'] name another GPU type"),
        ({"gpuLabel": {"values": ["x", "x"]}}, "gpuLabel: values ['x', 'x'] repeat a value"),
        ({"gpuLabel": {"value": "x"}}, "gpuLabel.value: unknown field"),
    ],
)
def test_gpu_label_errors_name_pool_and_field(fields, expected):
    with pytest.raises(CatalogError) as error:
        load_catalog([_pool(**fields)])
    assert str(error.value).startswith(f"pool 'p1' (pools[0]): {expected}"), str(error.value)
