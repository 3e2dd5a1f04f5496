"""Object storage and sovereignty: the regions a job may run in once its S3 endpoints are counted,
and the planner narrowed to them."""

from __future__ import annotations

import pytest

from finetune_operator.planning import ClusterPolicy, Plan, load_catalog, load_policy, plan_job
from finetune_operator.planning.policy import PolicyError, normalize_endpoint
from finetune_operator.planning.storage import StorageError, storage_regions

from .simple_estimator import simple_estimate
from .test_search import spec

BERLIN = "https://s3.eu-de-berlin.example"
PARIS = "https://s3.eu-fr-paris.example"


def s3(endpoint: str, key: str = "") -> dict:
    return {"endpoint": endpoint, "bucket": "team-a", "key": key, "credentialsSecretRef": {"name": "s3"}}


def policy(*storage: dict, regions=("eu-de-berlin", "eu-fr-paris")) -> ClusterPolicy:
    return load_policy({"allowedRegions": list(regions), "objectStorage": list(storage)})


STORAGE = ({"endpoint": BERLIN, "region": "eu-de-berlin"}, {"endpoint": PARIS, "region": "eu-fr-paris"})


def job(*, regions=("eu-de-berlin", "eu-fr-paris"), model=None, data=None, output=None):
    changes = {"placement.regions": list(regions)}
    if model:
        changes["model.source"] = {"s3": s3(model, "llama/")}
    if data:
        changes["dataset.source"] = {"s3": s3(data, "train.jsonl")}
    if output:
        changes["output"] = {"s3": s3(output, "out/")}
    return spec(**changes)


def test_endpoints_are_compared_in_one_spelling():
    assert normalize_endpoint("HTTPS://S3.Example.com:443/") == "https://s3.example.com"
    assert normalize_endpoint("http://127.0.0.1:80") == "http://127.0.0.1"
    assert normalize_endpoint("http://127.0.0.1:8333/") == "http://127.0.0.1:8333"
    for bad in ("https://s3.example.com/bucket", "s3://bucket", "https://user@s3.example.com", "https://h:99999"):
        with pytest.raises(ValueError):
            normalize_endpoint(bad)
    assert policy(*STORAGE).object_storage_for("https://S3.eu-de-berlin.example:443") is not None
    with pytest.raises(PolicyError, match="listed twice"):
        policy({"endpoint": BERLIN, "region": "a"}, {"endpoint": BERLIN.upper() + "/", "region": "b"})


def test_a_job_without_object_storage_is_not_narrowed():
    assert storage_regions(job(), policy(*STORAGE)) is None


def test_data_narrows_to_the_regions_its_endpoint_may_be_used_from():
    assert storage_regions(job(data=PARIS), policy(*STORAGE)) == ["eu-fr-paris"]
    assert storage_regions(job(data=BERLIN, output=BERLIN), policy(*STORAGE)) == ["eu-de-berlin"]
    shared = {"endpoint": PARIS, "region": "eu-fr-paris", "accessibleFrom": ["eu-fr-paris", "eu-de-berlin"]}
    assert storage_regions(job(data=PARIS), policy(shared)) == ["eu-de-berlin", "eu-fr-paris"]


def test_an_endpoint_not_in_the_policy_is_named():
    with pytest.raises(StorageError) as error:
        storage_regions(job(output="https://s3.us-east.example"), policy(*STORAGE))
    assert error.value.path == "spec.output.s3.endpoint"
    assert BERLIN in error.value.message and PARIS in error.value.message
    with pytest.raises(StorageError) as error:
        storage_regions(job(model="https://s3.us-east.example"), policy())
    assert error.value.path == "spec.model.source.s3.endpoint" and "lists: none" in error.value.message


def test_an_endpoint_outside_the_jobs_regions_is_named():
    with pytest.raises(StorageError) as error:
        storage_regions(job(regions=["eu-de-berlin"], data=PARIS), policy(*STORAGE))
    assert error.value.path == "spec.dataset.source.s3.endpoint"
    assert "eu-fr-paris" in error.value.message and "may run in eu-de-berlin" in error.value.message
    # The cluster policy bounds it too: Paris allowed by the job but not by the cluster.
    with pytest.raises(StorageError):
        storage_regions(job(data=PARIS), policy(*STORAGE, regions=["eu-de-berlin"]))


def test_endpoints_that_together_leave_no_region_are_named():
    with pytest.raises(StorageError) as error:
        storage_regions(job(model=BERLIN, data=PARIS), policy(*STORAGE))
    assert error.value.path == "spec.dataset.source.s3.endpoint"
    assert "spec.model.source.s3.endpoint" in error.value.message and "no region may reach" in error.value.message


def test_no_common_region_at_all_is_left_to_the_planner():
    # The job and the cluster share no region: the planner says so (Pending), not the storage check.
    assert storage_regions(job(regions=["us-east-virginia"], data=BERLIN), policy(*STORAGE)) == []


POOLS = load_catalog({"pools": [
    {"name": "h100-berlin", "region": "eu-de-berlin", "gpuType": "H100-80GB", "gpusPerNode": 8, "maxNodes": 2,
     "pricePerGpuHour": 3.0},
    {"name": "h100-paris", "region": "eu-fr-paris", "gpuType": "H100-80GB", "gpusPerNode": 8, "maxNodes": 2,
     "pricePerGpuHour": 9.0},
]})


def test_the_planner_trains_where_the_data_may_be_read():
    # Berlin is cheaper, but the data is in Paris's storage and may be read only there.
    cheap = plan_job(job(), POOLS, policy(*STORAGE), estimator=simple_estimate)
    assert isinstance(cheap, Plan) and cheap.region == "eu-de-berlin"
    plan = plan_job(job(data=PARIS), POOLS, policy(*STORAGE), estimator=simple_estimate)
    assert isinstance(plan, Plan) and plan.region == "eu-fr-paris" and plan.allowed_regions == ["eu-fr-paris"]
    # An endpoint the policy refuses does not change planning: validation makes the job Invalid.
    refused = plan_job(job(data="https://s3.elsewhere.example"), POOLS, policy(*STORAGE), estimator=simple_estimate)
    assert isinstance(refused, Plan) and refused.region == "eu-de-berlin"


def test_the_upload_sidecar_s_memory_is_counted_on_the_node():
    """An output in object storage adds the master's upload sidecar (512 MiB requested beside the
    ranks): a node whose allocatable holds the ranks but not the sidecar too is not planned on."""
    from finetune_operator.planning.search.ask import UPLOAD_SIDECAR_HOST_BYTES, ask_from_spec

    pvc_plan = plan_job(job(), POOLS, policy(*STORAGE), estimator=simple_estimate)
    assert isinstance(pvc_plan, Plan)
    ranks = pvc_plan.host_memory_bytes
    assert ask_from_spec(job(output=BERLIN), policy(*STORAGE), None).pod_extra_host_bytes == UPLOAD_SIDECAR_HOST_BYTES
    assert ask_from_spec(job(), policy(*STORAGE), None).pod_extra_host_bytes == 0
    for room, fits in ((ranks + UPLOAD_SIDECAR_HOST_BYTES, True), (ranks + UPLOAD_SIDECAR_HOST_BYTES - 1, False)):
        tight = load_catalog({"pools": [
            {"name": "h100-berlin", "region": "eu-de-berlin", "gpuType": "H100-80GB", "gpusPerNode": pvc_plan.gpus_per_node,
             "maxNodes": 1, "pricePerGpuHour": 3.0, "hostMemoryBytes": room}]})
        planned = plan_job(job(output=BERLIN, regions=["eu-de-berlin"]), tight, policy(*STORAGE),
                           estimator=simple_estimate)
        assert isinstance(planned, Plan) is fits, planned
