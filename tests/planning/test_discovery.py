"""Discovery of node pools from Node and Pod objects, and merging with the catalog."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from finetune_operator.planning import ClusterPolicy, discover, discover_pools, load_catalog, merge_pools
from finetune_operator.planning.pools import MiB, same_gpu_type

from .nodes import cpu_node, gpu_node, gpu_pod, snake_case

POLICY = ClusterPolicy(allowed_regions=["eu-de-berlin", "eu-fr-paris"])


def _by_name(pools):
    return {p.name: p for p in pools}


def test_karpenter_pool_with_gfd_labels_and_free_gpus():
    nodes = [gpu_node("ip-10-0-1-1"), gpu_node("ip-10-0-1-2", zone="eu-de-berlin-2"), cpu_node("ip-10-0-9-9")]
    pods = [
        gpu_pod("train-a", "ip-10-0-1-1", 4),
        gpu_pod("train-b", "ip-10-0-1-1", 2, limits_only=True),  # a limit alone is the request
        gpu_pod("done", "ip-10-0-1-2", 8, phase="Succeeded"),  # finished pods hold nothing
        gpu_pod("init", "ip-10-0-1-2", 1, init_gpus=3),  # init container needs 3 before the 1 runs
        gpu_pod("unscheduled", "", 8, phase="Pending"),
    ]
    pools = discover_pools(nodes, pods, POLICY)
    assert [p.name for p in pools] == ["h100-berlin"]
    pool = pools[0]
    assert pool.gpu_type == "H100-80GB"
    assert pool.gpu_memory_bytes == 81559 * MiB
    assert pool.gpus_per_node == 8
    assert pool.nodes_now == 2 and pool.max_nodes == 2
    assert pool.free_gpus == (8 - 4 - 2) + (8 - 3)
    assert pool.region == "eu-de-berlin"
    assert pool.zones == ["eu-de-berlin-1", "eu-de-berlin-2"]
    assert pool.selector == {"karpenter.sh/nodepool": "h100-berlin"}
    assert [(t.key, t.value, t.effect) for t in pool.taints] == [("nvidia.com/gpu", "present", "NoSchedule")]
    assert pool.host_memory_bytes == 2063146352 * 1024
    assert pool.cpus == 191
    assert pool.source == "discovered"


def test_gke_pool_label_and_gke_product_spelling():
    node = gpu_node(
        "gke-train-a100-pool-1a2b", product="NVIDIA-A100-SXM4-40GB", memory_mib=40960, gpus=8,
        region="eu-fr-paris", zone="eu-fr-paris-a",
        pool_labels={"cloud.google.com/gke-nodepool": "a100-pool", "cloud.google.com/gke-accelerator": "nvidia-tesla-a100"},
    )
    pool = discover_pools([node], [], POLICY)[0]
    assert pool.name == "a100-pool"
    assert pool.gpu_type == "A100-40GB"
    assert pool.selector == {"cloud.google.com/gke-nodepool": "a100-pool"}


def test_cordoned_not_ready_and_unlabelled_nodes_are_left_out_with_reasons():
    nodes = [
        gpu_node("ok"),
        gpu_node("cordoned", unschedulable=True),
        gpu_node("sick", ready=False),
        gpu_node("no-region", extra_labels={}, region=""),
        gpu_node("no-pool", pool_labels={}),
        gpu_node("mig", product="NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", memory_mib=4864),
    ]
    found = discover(nodes, [], POLICY)
    assert [p.name for p in found.pools] == ["h100-berlin"]
    assert found.pools[0].nodes_now == 1
    reasons = {s.node: s.reason for s in found.skipped}
    assert "cordoned" in reasons["cordoned"]
    assert "not Ready" in reasons["sick"]
    assert "region" in reasons["no-region"]
    assert "pool label" in reasons["no-pool"]
    assert "MIG" in reasons["mig"]


def test_transient_taints_are_not_pool_taints_but_custom_ones_are():
    node = gpu_node("n1", taints=[
        {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
        {"key": "dedicated", "value": "training", "effect": "NoExecute"},
        {"key": "node.kubernetes.io/not-ready", "effect": "NoExecute"},
    ])
    pool = discover_pools([node], [], POLICY)[0]
    assert {(t.key, t.effect) for t in pool.taints} == {("nvidia.com/gpu", "NoSchedule"), ("dedicated", "NoExecute")}


def test_region_label_key_is_configurable():
    # A platform that does not trust kubelet-set labels keeps the region under node-restriction.
    key = "node-restriction.kubernetes.io/region"
    policy = ClusterPolicy(allowed_regions=["eu-de-berlin"], region_label_key=key)
    spoofed = gpu_node("n1", region="us-east-virginia", extra_labels={key: "eu-de-berlin"})
    pool = discover_pools([spoofed], [], policy)[0]
    assert pool.region == "eu-de-berlin"
    unlabelled = discover([gpu_node("n2")], [], policy)
    assert unlabelled.pools == [] and key in unlabelled.skipped[0].reason


def test_catalog_selector_names_the_pool_and_unknown_gpu_uses_gfd_memory():
    catalog = load_catalog({"pools": [{
        "name": "team-gpus", "region": "eu-de-berlin", "gpuType": "H100-80GB", "gpusPerNode": 8, "maxNodes": 4,
        "selector": {"example.com/pool": "team"},
    }]})
    policy = ClusterPolicy(allowed_regions=["eu-de-berlin"], catalog=catalog)
    nodes = [
        gpu_node("n1", extra_labels={"example.com/pool": "team"}),
        gpu_node("n2", product="NVIDIA-B200", memory_mib=183359, pool_labels={"karpenter.sh/nodepool": "b200"}),
    ]
    pools = _by_name(discover_pools(nodes, [], policy))
    assert pools["team-gpus"].selector == {"example.com/pool": "team"}
    assert pools["b200"].gpu_type == "NVIDIA-B200"
    assert pools["b200"].gpu_memory_bytes == 183359 * MiB


def test_snake_case_objects_from_the_python_client_read_the_same():
    nodes = [gpu_node("n1"), gpu_node("n2", unschedulable=True)]
    pods = [gpu_pod("p", "n1", 3, init_gpus=1)]
    assert discover_pools([snake_case(n) for n in nodes], [snake_case(p) for p in pods], POLICY) == \
        discover_pools(nodes, pods, POLICY)


def test_pool_label_spanning_regions_is_split_and_pinned_by_region():
    nodes = [gpu_node("b1"), gpu_node("p1", region="eu-fr-paris", zone="eu-fr-paris-a")]
    pools = _by_name(discover_pools(nodes, [], POLICY))
    assert set(pools) == {"h100-berlin-eu-de-berlin", "h100-berlin-eu-fr-paris"}
    paris = pools["h100-berlin-eu-fr-paris"]
    assert paris.selector == {"karpenter.sh/nodepool": "h100-berlin", "topology.kubernetes.io/region": "eu-fr-paris"}


def test_merge_keeps_catalog_price_and_ceiling_and_takes_live_facts():
    catalog = load_catalog({"pools": [
        {"name": "h100-berlin", "region": "eu-de-berlin", "gpuType": "H100-80GB", "gpusPerNode": 8, "maxNodes": 4,
         "pricePerGpuHour": 3.4, "interNodeGbps": 3200},
        {"name": "l40s-berlin", "region": "eu-de-berlin", "gpuType": "L40S-48GB", "gpusPerNode": 4, "maxNodes": 6},
    ]})
    live = discover_pools(
        [gpu_node("n1"), gpu_node("n2"), gpu_node("x1", pool_labels={"karpenter.sh/nodepool": "h100-spot"})],
        [gpu_pod("p", "n1", 8)], POLICY,
    )
    merged = _by_name(merge_pools(catalog, live))
    h100 = merged["h100-berlin"]
    assert h100.source == "both"
    assert (h100.price_per_gpu_hour, h100.max_nodes, h100.inter_node_gbps) == (3.4, 4, 3200)
    assert (h100.free_gpus, h100.nodes_now) == (8, 2)
    assert merged["l40s-berlin"].source == "catalog" and merged["l40s-berlin"].free_gpus is None
    assert merged["h100-spot"].source == "discovered" and merged["h100-spot"].price_per_gpu_hour is None


@pytest.mark.parametrize("allocatable", ["0", "not-a-number"])
def test_node_without_usable_gpu_resource_is_reported(allocatable):
    node = gpu_node("n1")
    node["status"]["allocatable"]["nvidia.com/gpu"] = allocatable
    found = discover([node], [], POLICY)
    assert found.pools == [] and "allocatable" in found.skipped[0].reason


def test_catalog_pool_label_seen_in_another_region_stays_apart():
    catalog = load_catalog({"pools": [
        {"name": "h100-berlin", "region": "eu-de-berlin", "gpuType": "H100-80GB", "gpusPerNode": 8, "maxNodes": 4},
    ]})
    policy = ClusterPolicy(allowed_regions=["eu-de-berlin"], catalog=catalog)
    stray = gpu_node("stray", region="eu-fr-paris", zone="eu-fr-paris-a")
    merged = merge_pools(catalog, discover_pools([gpu_node("b1"), stray], [], policy))
    names = [p.name for p in merged]
    assert len(names) == len(set(names))
    assert {(p.name, p.region) for p in merged} == {("h100-berlin", "eu-de-berlin"),
                                                    ("h100-berlin-eu-fr-paris", "eu-fr-paris")}


@settings(max_examples=300, deadline=None)
@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(
        st.sampled_from(["metadata", "labels", "name", "spec", "status", "allocatable", "conditions", "type",
                         "status", "taints", "key", "effect", "unschedulable", "nvidia.com/gpu",
                         "nvidia.com/gpu.product", "topology.kubernetes.io/region", "karpenter.sh/nodepool",
                         "containers", "resources", "requests", "limits", "nodeName", "phase", "memory", "cpu"]),
        children, max_size=4),
    max_leaves=20,
))
def test_discovery_never_crashes_on_odd_objects(blob):
    nodes = [blob, gpu_node("ok")] if not isinstance(blob, list) else blob + [gpu_node("ok")]
    found = discover(nodes, nodes, POLICY)
    assert any(p.name == "h100-berlin" for p in found.pools)


@pytest.mark.parametrize("labels, name", [
    ({"eks.amazonaws.com/nodegroup": "p5-training"}, "p5-training"),
    ({"kubernetes.azure.com/agentpool": "gpunp1"}, "gpunp1"),
    ({"eks.amazonaws.com/nodegroup": "GPU_Group.A"}, "gpu-group-a"),  # made a valid pool name...
])
def test_eks_and_aks_pool_labels(labels, name):
    pool = discover_pools([gpu_node("n1", pool_labels=labels)], [], POLICY)[0]
    assert pool.name == name
    assert pool.selector == labels  # ...but selected by the label value as it is


def test_first_pool_label_key_in_policy_order_wins():
    policy = ClusterPolicy(allowed_regions=["eu-de-berlin"], pool_label_keys=["example.com/pool", "karpenter.sh/nodepool"])
    node = gpu_node("n1", pool_labels={"karpenter.sh/nodepool": "default", "example.com/pool": "research"})
    assert discover_pools([node], [], policy)[0].selector == {"example.com/pool": "research"}


def test_free_gpus_are_known_per_node():
    nodes = [gpu_node("a"), gpu_node("b")]
    pods = [gpu_pod("p1", "a", 4), gpu_pod("p2", "b", 4)]
    pool = discover_pools(nodes, pods, POLICY)[0]
    assert pool.free_gpus == 8 and pool.free_gpus_per_node == [4, 4]
    # Eight GPUs are free, but not on one node.
    assert pool.fits_now(2, 4) and pool.fits_now(1, 4) and not pool.fits_now(1, 8)


A100_80 = {"product": "NVIDIA-A100-SXM4-80GB", "memory_mib": 81920}


def _node_labels(node):
    return node["metadata"]["labels"]


def test_pool_label_spanning_gpu_types_is_split_with_selectors_that_tell_the_parts_apart():
    # One Karpenter pool label over H100 and A100 nodes in one region: before, both parts had the
    # same selector, so a plan for the H100 part could land on the A100 nodes.
    nodes = [gpu_node("h1"), gpu_node("a1", **A100_80)]
    pools = _by_name(discover_pools(nodes, [], POLICY))
    assert set(pools) == {"h100-berlin-eu-de-berlin-h100-80gb", "h100-berlin-eu-de-berlin-a100-80gb"}
    h100, a100 = pools["h100-berlin-eu-de-berlin-h100-80gb"], pools["h100-berlin-eu-de-berlin-a100-80gb"]
    assert h100.selector == {"karpenter.sh/nodepool": "h100-berlin", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert a100.selector == {"karpenter.sh/nodepool": "h100-berlin", "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert (h100.gpu_type, h100.gpu_label.values) == ("H100-80GB", ["NVIDIA-H100-80GB-HBM3"])
    assert (a100.gpu_type, a100.gpu_label.values) == ("A100-80GB", ["NVIDIA-A100-SXM4-80GB"])
    region = POLICY.region_label_key
    assert [n["metadata"]["name"] for n in nodes if h100.selects(_node_labels(n), region)] == ["h1"]
    assert [n["metadata"]["name"] for n in nodes if a100.selects(_node_labels(n), region)] == ["a1"]


def test_the_catalogs_gpu_type_keeps_the_catalogs_name_and_its_gpu_label_grows_by_what_nodes_show():
    catalog = load_catalog({"pools": [
        {"name": "h100-berlin", "region": "eu-de-berlin", "gpuType": "H100-80GB", "gpusPerNode": 8, "maxNodes": 4,
         "pricePerGpuHour": 3.4},
    ]})
    policy = ClusterPolicy(allowed_regions=["eu-de-berlin"], catalog=catalog)
    # A product spelling the GPU table does not know yet, with the memory GFD reports.
    odd = gpu_node("h2", product="NVIDIA-H100-80GB-HBM3-Rev2", memory_mib=81559)
    merged = _by_name(merge_pools(catalog, discover_pools([gpu_node("h1"), gpu_node("a1", **A100_80), odd], [], policy)))
    assert merged["h100-berlin"].source == "both" and merged["h100-berlin"].price_per_gpu_hour == 3.4
    assert merged["h100-berlin"].gpu_type == "H100-80GB"
    # The catalog's spellings (for nodes yet to scale up) and the one the node shows now.
    assert merged["h100-berlin"].gpu_label.values == ["NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-SXM5-80GB"]
    a100 = merged["h100-berlin-eu-de-berlin-a100-80gb"]
    assert a100.source == "discovered" and a100.gpu_label.values == ["NVIDIA-A100-SXM4-80GB"]
    # The unknown spelling is a type of its own (the table cannot say it is an H100).
    assert any(p.gpu_label.values == ["NVIDIA-H100-80GB-HBM3-Rev2"] for p in merged.values())


def test_labels_that_read_as_one_name_stay_apart():
    # "GPU_Group.A" and "gpu-group-a" both make the pool name gpu-group-a; grouped together, one
    # selector would have stood for nodes it does not select.
    nodes = [gpu_node("n1", pool_labels={"eks.amazonaws.com/nodegroup": "GPU_Group.A"}),
             gpu_node("n2", pool_labels={"eks.amazonaws.com/nodegroup": "gpu-group-a"})]
    pools = discover_pools(nodes, [], POLICY)
    assert sorted((p.name, p.selector["eks.amazonaws.com/nodegroup"]) for p in pools) == [
        ("gpu-group-a", "GPU_Group.A"), ("gpu-group-a-2", "gpu-group-a")]


def test_allocatable_quantities_in_every_form_the_api_writes():
    # The kubelet reports memory in Ki, but the API accepts (and a device plugin or a patch may write)
    # any canonical quantity: exponents and exbibytes included.
    node = gpu_node("n1", memory="2113523516e3", cpu="1.92e2")
    node["status"]["allocatable"]["nvidia.com/gpu"] = "8e0"
    (pool,) = discover_pools([node], [], POLICY)
    assert (pool.host_memory_bytes, pool.cpus, pool.gpus_per_node) == (2113523516000, 192, 8)
    big = gpu_node("n2", memory="1Ei")
    assert discover_pools([big], [], POLICY)[0].host_memory_bytes == 2**60


@pytest.mark.parametrize("key, value", [("memory", "lots"), ("cpu", "-4"), ("nvidia.com/gpu", "8 GPUs")])
def test_an_unreadable_allocatable_quantity_is_reported_naming_the_field(key, value):
    node = gpu_node("n1")
    node["status"]["allocatable"][key] = value
    found = discover([node], [], POLICY)
    assert found.pools == []
    (skipped,) = found.skipped
    assert skipped.reason.startswith(f"status.allocatable[{key}]: "), skipped.reason
    assert repr(value) in skipped.reason


PRODUCTS = [("NVIDIA-H100-80GB-HBM3", 81559), ("NVIDIA-H100-SXM5-80GB", 81559), ("NVIDIA-A100-SXM4-80GB", 81920),
            ("NVIDIA-L40S", 46068), ("NVIDIA-B200", 183359)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["h100", "mixed", "GPU_Pool"]), st.sampled_from(["eu-de-berlin", "eu-fr-paris"]),
                          st.sampled_from(PRODUCTS)), min_size=1, max_size=10),
       st.booleans())
def test_every_node_is_selected_by_exactly_its_own_pool(specs, with_catalog):
    """Whatever mix of pool labels, regions and GPUs: each node is selected (region, selector and GPU
    label, as the rendered pods require them) by exactly one discovered pool, of its GPU type and region."""
    nodes = [gpu_node(f"n{i}", product=product, memory_mib=mib, region=region, pool_labels={"karpenter.sh/nodepool": label})
             for i, (label, region, (product, mib)) in enumerate(specs)]
    catalog = load_catalog({"pools": [
        {"name": "h100", "region": "eu-de-berlin", "gpuType": "H100-80GB", "gpusPerNode": 8, "maxNodes": 2},
        {"name": "mixed", "region": "eu-fr-paris", "gpuType": "A100-80GB", "gpusPerNode": 8, "maxNodes": 2},
    ]}) if with_catalog else []
    policy = ClusterPolicy(allowed_regions=["eu-de-berlin", "eu-fr-paris"], catalog=catalog)
    pools = discover_pools(nodes, [], policy)
    assert len({p.name for p in pools}) == len(pools)
    for node, (_, region, (product, _)) in zip(nodes, specs):
        (pool,) = [p for p in pools if p.selects(_node_labels(node), policy.region_label_key)]
        assert pool.region == region
        assert same_gpu_type(pool.gpu_type, product) or pool.gpu_type == product.upper()
    # The merged list keeps that: the catalog adds pools, never a second home for a node.
    merged = merge_pools(catalog, pools)
    for node in nodes:
        assert len([p for p in merged if p.selects(_node_labels(node), policy.region_label_key)]) == 1
