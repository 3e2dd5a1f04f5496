"""Property test: no string in a job, policy or pool can change the shape of what is rendered.

Every free-text field of the job (and of the pool and policy, which are data too) holds
YAML and Jinja metacharacters, newlines, quotes, `{{ }}`, `{% %}`, anchors, unicode and
long text. Each job is rendered twice: as generated, and as a "benign twin" in which
every such string is a plain word. The two renderings must have the same skeleton (every
key set and list length, recursively, the trainer config's JSON included): strings only
ever land in leaves. On top, every pod template keeps exactly the required node affinity
(the plan's one region, inside the allowed regions, and the plan's GPU product), the key sets of the objects are the expected ones, every string arrives
verbatim where it belongs, and (every tenth example) the manifests pass the upstream
PyTorchJob schema and survive the CLI's YAML output unchanged. The same job rendered as a
TrainJob (`check_trainjob`) keeps its shape too, and its runtime patch pins the pods exactly
like the PyTorchJob's (and passes the upstream TrainJob schema every tenth example).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from manifest_checks import attempt_errors
from test_render_trainjob import trainjob_errors
from render_factories import plan_for
from upstream_crd import pytorchjob_schema, trainjob_schema

from finetune_operator import api
from finetune_operator.planning import ClusterPolicy, NodePool
from finetune_operator.planning.pools import GFD_PRODUCT, GKE_ACCELERATOR, gpu_type_info, label_values_for
from finetune_operator.rendering.pod import scanner_skips, takes_credentials
from finetune_operator.rendering import RenderError, render_attempt, render_trainjob
from finetune_operator.rendering.trainjob import _as_go_writes_it, pod_template_patch
from finetune_operator.rendering.names import DNS1035_LABEL
from finetune_operator.rendering.output import manifests_yaml

# 500 in CI (about 20 s of a worker); RENDER_PROPERTY_EXAMPLES=20000 for a long hunt.
EXAMPLES = int(os.environ.get("RENDER_PROPERTY_EXAMPLES", "500"))
# Every schema check costs ~10 ms; the skeleton and key-set checks run on every example.
SCHEMA_EVERY = 10

NASTY = [
    "{{ 7*7 }}", "{{", "}}", "{% if true %}x{% endif %}", "{%", "%}", "{# c #}", "{{ config.__class__ }}",
    "&anchor", "*anchor", "<<: *anchor", "!!python/object/apply:os.system ['id']", "!tag", "---", "...",
    "key: value", "- item", "? q", "| block", "> fold", "# comment", "%YAML 1.2", "@", "`",
    '"', "'", "\\", "\\n", "\n", "\r\n", "\t", " ", ":", ",", "[", "]", "{", "}", "</script>", "\x00",
    "\u2028", "\u00e9", "\u0130", "\U0001F680", "\ufeff", "null", "true", "~", "0x1F", "1e3",
    '", "injected": "1', "'}, {'x': 1}", "\n  nodeSelectorTerms: []", '"]}]}, "x": {"y": ["',
    "eu-us-virginia", "topology.kubernetes.io/region", "values: [us-east-virginia]",
]


def wild(max_size: int, *, no_space: bool = False) -> st.SearchStrategy[str]:
    """Metacharacters, unicode, and now and then a very long string (a piece repeated).

    Every generated character costs hypothesis one draw, so pieces stay short and long
    text comes from repetition.
    """
    pieces = st.one_of(
        st.sampled_from(NASTY),
        st.text(min_size=1, max_size=12),
        st.text(alphabet="{}%#&*!|>-:'\"\\\n ", min_size=1, max_size=10),
    )
    text = st.builds(
        lambda parts, repeat: "".join(parts) * repeat,
        st.lists(pieces, min_size=1, max_size=4),
        st.sampled_from([1, 1, 1, 1, 2, 100]),
    )
    if no_space:
        text = text.map(lambda s: re.sub(r"\s", "_", s))
    return text.map(lambda s: s[:max_size]).filter(bool)


# Built once: a strategy built inside `cases` would be built and validated on every draw.
WILD_100, WILD_200, WILD_512, WILD_1024 = wild(100), wild(200), wild(512), wild(1024)
WILD_IMAGE = wild(512, no_space=True)


def relative_path(text: str) -> str:
    """The same length of text made a path the API accepts: relative, one line, no '..' segment."""
    parts = ["__" if p == ".." else p for p in text.replace("\n", " ").split("/")]
    path = "/".join(parts)
    return "p" + path[1:] if path.startswith("/") else path


def printable_line(text: str) -> str:
    """The same text made what the API accepts as a model name: no control characters (C0, DEL, C1)."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f]", "_", text)


def git_revision(text: str) -> str:
    """The same length of text made a revision the API accepts: `-._+/` kept, never first."""
    text = re.sub(r"[^-A-Za-z0-9_.+/]", "_", text)
    return "r" + text[1:] if text[0] in "-.+/" else text


LOWER = "abcdefghijklmnopqrstuvwxyz"
ALNUM = LOWER + LOWER.upper() + "0123456789"


def _word(first: str, middle: str, last: str, max_middle: int) -> st.SearchStrategy[str]:
    """first + middle* + last, or just first: what the API's name patterns accept."""
    return st.builds(
        lambda a, m, z: a + (m + z if z else ""),
        st.sampled_from(first),
        st.text(alphabet=middle, max_size=max_middle),
        st.one_of(st.just(""), st.sampled_from(last)),
    )


# Built from alphabets, not regexes: generation dominates the test's time.
DNS_LABEL = _word(LOWER, LOWER + "0123456789-", LOWER + "0123456789", 12)


def _subdomain(labels: list[str], repeat: int) -> str:
    labels = labels * repeat  # now and then far longer than a PyTorchJob name may be
    while len(".".join(labels)) > 253:
        labels.pop()
    return ".".join(labels)


DNS_SUBDOMAIN = st.builds(_subdomain, st.lists(DNS_LABEL, min_size=1, max_size=3), st.sampled_from([1, 1, 1, 20]))
LABEL_VALUE = _word(ALNUM, ALNUM + "-_.", ALNUM, 16)
QUALIFIED_NAME = st.builds(
    lambda prefix, name: f"{prefix}/{name}" if prefix else name,
    st.one_of(st.none(), st.lists(DNS_LABEL, min_size=1, max_size=3).map(".".join)),
    _word(ALNUM, ALNUM + "-_.", ALNUM, 16),
)


@dataclass(frozen=True)
class Strings:
    """Every free-text value of one generated case; the twin has plain words instead."""

    model_name: str
    model_path: str
    data_path: str
    checkpoint_path: str
    output_path: str
    hf_revision: str
    secret_key: str
    image: str
    policy_image: str
    uid: str
    selector_value: str

    def benign(self) -> "Strings":
        return Strings(*(f"plain{i}" for i in range(len(self.__dataclass_fields__))))


@dataclass(frozen=True)
class Case:
    strings: Strings
    job_name: str
    namespace: str | None
    claims: tuple[str, str, str, str]
    regions: tuple[str, ...]
    policy_regions: tuple[str, ...]
    region_label_key: str
    selector_key: str
    taint: tuple[str, str | None] | None
    queue_name: str | None
    hf_model: bool
    output_volume: bool
    image_override: bool
    nodes: int
    gpus_per_node: int
    strategy: str
    attempt: int
    suspend: bool
    pin_region: bool  # the pool's selector also names its region (as discovery does for split pools)
    region_index: int  # which of the regions both job and policy allow the plan (and its pool) is in
    gpu: tuple[str, str | None, tuple[str, ...]]  # GPU type, its label key (None: default), values (): the table's


@st.composite
def cases(draw) -> Case:
    strings = Strings(
        model_name=printable_line(draw(WILD_200)),
        model_path=relative_path(draw(WILD_1024)),
        data_path=relative_path(draw(WILD_1024)),
        checkpoint_path=relative_path(draw(WILD_1024)),
        output_path=relative_path(draw(WILD_1024)),
        hf_revision=git_revision(draw(WILD_200)),
        secret_key=draw(WILD_1024),
        image=draw(WILD_IMAGE),
        policy_image=draw(WILD_512),
        uid=draw(WILD_100),
        selector_value=draw(WILD_200),
    )
    regions = tuple(draw(REGION_LISTS))
    extra = draw(EXTRA_REGIONS)
    keep = draw(st.integers(1, len(regions))) if len(regions) > 1 else 1
    policy_regions = tuple(dict.fromkeys(list(regions[:keep]) + extra))
    region_label_key = draw(REGION_LABEL_KEYS)
    selector_key = draw(QUALIFIED_NAME)
    if selector_key == region_label_key:
        selector_key = "x" + selector_key
    shape = draw(SHAPES)
    gpu = draw(GPUS)
    if gpu[1] is not None and gpu[1] in (region_label_key, selector_key):
        gpu = (gpu[0], "x" + gpu[1], gpu[2])
    if selector_key == (gpu[1] or GFD_PRODUCT):
        selector_key = "x" + selector_key
    return Case(
        strings=strings,
        job_name=draw(DNS_SUBDOMAIN),
        namespace=draw(NAMESPACES),
        claims=tuple(draw(CLAIMS)),
        regions=regions,
        policy_regions=policy_regions,
        region_label_key=region_label_key,
        selector_key=selector_key,
        taint=draw(TAINTS),
        queue_name=draw(QUEUES),
        hf_model=shape[0],
        output_volume=shape[1],
        image_override=shape[2],
        nodes=shape[3],
        gpus_per_node=shape[4],
        strategy=shape[5],
        attempt=shape[6],
        suspend=shape[7],
        pin_region=shape[8],
        region_index=draw(st.integers(0, 3)),
        gpu=gpu,
    )


# Every strategy `cases` draws from is built once, here.
REGION_LISTS = st.lists(LABEL_VALUE, min_size=1, max_size=4, unique=True)
EXTRA_REGIONS = st.lists(LABEL_VALUE, max_size=3, unique=True)
REGION_LABEL_KEYS = st.one_of(st.just("topology.kubernetes.io/region"), QUALIFIED_NAME)
NAMESPACES = st.one_of(st.none(), DNS_LABEL)
CLAIMS = st.lists(DNS_SUBDOMAIN, min_size=4, max_size=4)
TAINTS = st.one_of(st.none(), st.tuples(QUALIFIED_NAME, st.one_of(st.none(), LABEL_VALUE)))
QUEUES = st.one_of(st.none(), LABEL_VALUE)
# GPU types the table knows (their label values come from it, under GFD's or GKE's label), and
# a type it does not know, whose label and values the pool names itself.
GPUS = st.one_of(
    st.tuples(st.sampled_from(["H100-80GB", "A100-40GB", "L40S-48GB"]), st.sampled_from([None, GKE_ACCELERATOR]), st.just(())),
    st.tuples(
        st.just("B200-192GB"),
        st.one_of(st.none(), QUALIFIED_NAME),
        st.lists(LABEL_VALUE.filter(lambda v: gpu_type_info(v) is None), min_size=1, max_size=3, unique=True).map(tuple),
    ),
)
SHAPES = st.tuples(
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.integers(1, 3),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from(["ddp", "fsdp", "zero1", "zero2", "zero3"]),
    st.integers(1, 20),
    st.booleans(),
    st.booleans(),
)


def plan_region(case: Case) -> str:
    both = sorted(set(case.regions) & set(case.policy_regions))
    return both[case.region_index % len(both)]


def gpu_expression(case: Case) -> dict[str, Any]:
    """The GPU requirement the pods must carry, worked out from the case, not from the pool."""
    gpu_type, key, values = case.gpu
    key = key or GFD_PRODUCT
    return {"key": key, "operator": "In", "values": sorted(values or label_values_for(key, gpu_type))}


def build(case: Case, s: Strings) -> tuple[api.FineTuneJob, ClusterPolicy, NodePool]:
    model_source: dict[str, Any]
    if case.hf_model:
        model_source = {"hf": {"repo": "org/model", "revision": s.hf_revision, "tokenSecretRef": {"name": case.claims[0], "key": s.secret_key}}}
    else:
        model_source = {"pvc": {"claimName": case.claims[0], "path": s.model_path}}
    spec: dict[str, Any] = {
        "model": {"name": s.model_name, "architecture": {"preset": "llama-3.1-8b"}, "source": model_source},
        "dataset": {"source": {"pvc": {"claimName": case.claims[1], "path": s.data_path}}},
        "method": "full",
        "training": {"sequenceLength": 2048, "globalBatchSize": 48, "maxSteps": 100},
        "placement": {"regions": list(case.regions)},
        "checkpoint": {"pvc": {"claimName": case.claims[2], "path": s.checkpoint_path}},
        "suspend": case.suspend,
    }
    if case.output_volume:
        spec["output"] = {"pvc": {"claimName": case.claims[3], "path": s.output_path}}
    if case.image_override:
        spec["image"] = s.image
    if case.queue_name is not None:
        spec["queueName"] = case.queue_name
    metadata = {"name": case.job_name, "uid": s.uid}
    if case.namespace is not None:
        metadata["namespace"] = case.namespace
    job = api.parse_job({"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": metadata, "spec": spec})
    taints = [] if case.taint is None else [{"key": case.taint[0], "value": case.taint[1], "effect": "NoExecute"}]
    gpu_type, label_key, label_values = case.gpu
    gpu_label: dict[str, Any] = {"values": list(label_values)}
    if label_key is not None:
        gpu_label["key"] = label_key
    pool = NodePool.model_validate(
        {
            "name": "pool-a",
            "region": plan_region(case),
            "gpu_type": gpu_type,
            "gpu_label": gpu_label,
            "gpu_memory_bytes": 80 * 1024**3,
            "gpus_per_node": 8,
            "max_nodes": 4,
            "cpus": 96,
            "selector": {case.selector_key: s.selector_value}
            | ({case.region_label_key: plan_region(case)} if case.pin_region else {}),
            "taints": taints,
        }
    )
    policy = ClusterPolicy(
        allowed_regions=list(case.policy_regions),
        region_label_key=case.region_label_key,
        trainer_image=s.policy_image,
        # The job's own image is one the policy allows (a disallowed one is Invalid: test_trusted_images.py).
        allowed_images=[{"prefix": s.image}] if case.image_override else [],
    )
    return job, policy, pool


def skeleton(value: Any) -> Any:
    """The shape of a manifest: key sets and list lengths, with every leaf reduced to its type."""
    if isinstance(value, dict):
        return {k: skeleton(v) for k, v in value.items()}
    if isinstance(value, list):
        return [skeleton(v) for v in value]
    return type(value).__name__


def config_map_skeleton(config_map: dict[str, Any]) -> Any:
    """The trainer config is JSON inside a string: its shape counts too."""
    parsed = dict(config_map, data={k: json.loads(v) for k, v in config_map["data"].items()})
    return skeleton(parsed)


POD_SPEC_KEYS = {"enableServiceLinks", "automountServiceAccountToken", "securityContext", "affinity", "tolerations",
                 "containers", "volumes"}
CONTAINER_KEYS = {
    "name", "image", "imagePullPolicy", "command", "env", "ports", "resources", "volumeMounts",
    "securityContext", "terminationMessagePath", "terminationMessagePolicy",
}
LABEL_KEYS = {
    "app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component",
    "app.kubernetes.io/part-of", "app.kubernetes.io/managed-by", "finetune.dev/job", "finetune.dev/attempt",
}


def check(case: Case, schema: bool) -> None:
    s = case.strings
    job, policy, pool = build(case, s)
    plan_regions = sorted(set(case.regions) & set(case.policy_regions))
    plan = plan_for(
        job, pool, nodes=case.nodes, gpus_per_node=case.gpus_per_node, micro_batch_size=1,
        gradient_accumulation=48 // (case.nodes * case.gpus_per_node) or 1, strategy=case.strategy,
        allowed_regions=plan_regions,
    )
    if 48 % (case.nodes * case.gpus_per_node):
        plan = plan.model_copy(update={"gradient_accumulation": 1, "global_batch_size": case.nodes * case.gpus_per_node})
        job = job.model_copy(update={"spec": job.spec.model_copy(update={"training": job.spec.training.model_copy(update={"global_batch_size": case.nodes * case.gpus_per_node})})})
    rendered = render_attempt(job, plan, case.attempt, policy)

    twin_job, twin_policy, twin_pool = build(case, s.benign())
    twin_job = twin_job.model_copy(update={"spec": twin_job.spec.model_copy(update={"training": job.spec.training})})
    twin = render_attempt(twin_job, plan.model_copy(update={"pool": twin_pool}), case.attempt, twin_policy)
    assert skeleton(rendered.pytorch_job) == skeleton(twin.pytorch_job)
    assert config_map_skeleton(rendered.config_map) == config_map_skeleton(twin.config_map)

    # --- names
    name = rendered.name
    assert DNS1035_LABEL.fullmatch(name) and len(name) <= 51
    assert rendered.pytorch_job["metadata"]["name"] == rendered.config_map["metadata"]["name"] == name

    # --- key sets
    pj = rendered.pytorch_job
    assert set(pj) == {"apiVersion", "kind", "metadata", "spec"}
    meta_keys = {"name", "labels", "annotations", "ownerReferences"} | ({"namespace"} if case.namespace else set())
    assert set(pj["metadata"]) == meta_keys
    assert set(rendered.config_map["metadata"]) == meta_keys - {"annotations"}
    expected_labels = LABEL_KEYS | ({"kueue.x-k8s.io/queue-name"} if case.queue_name else set())
    assert set(pj["metadata"]["labels"]) == expected_labels
    assert set(pj["metadata"]["annotations"]) == {"finetune.dev/model", "finetune.dev/plan", "finetune.dev/job-name"}
    assert set(pj["spec"]) == {"runPolicy", "nprocPerNode", "pytorchReplicaSpecs"}
    # A named queue creates the job suspended: Kueue admits it by un-suspending it.
    assert pj["spec"]["runPolicy"] == {"cleanPodPolicy": "Running", "suspend": case.suspend or case.queue_name is not None}
    assert pj["spec"]["nprocPerNode"] == str(case.gpus_per_node)
    replicas = pj["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == ({"Master", "Worker"} if case.nodes > 1 else {"Master"})
    assert sum(r["replicas"] for r in replicas.values()) == case.nodes
    assert set(rendered.config_map) == {"apiVersion", "kind", "metadata", "data"}
    assert set(rendered.config_map["data"]) == {"config.json"}

    for rtype, replica in replicas.items():
        assert set(replica) == {"replicas", "restartPolicy", "template"} and replica["restartPolicy"] == "Never"
        template = replica["template"]
        assert set(template) == {"metadata", "spec"}
        assert set(template["metadata"]) == {"labels", "annotations"}
        assert set(template["metadata"]["labels"]) == LABEL_KEYS
        assert template["metadata"]["labels"]["finetune.dev/attempt"] == str(case.attempt)
        pod = template["spec"]
        assert template["metadata"]["annotations"] == {
            "finetune.dev/predicted-peak-bytes": str(plan.predicted_peak_bytes),
            "finetune.dev/job-name": job.metadata.name,
            # the scanner's skips (fixed text; the credential one only with a Hub token in the pod)
            **scanner_skips(takes_credentials(pod.get("initContainers", []) + pod["containers"]), network_policy=True),
        }
        assert set(pod) == POD_SPEC_KEYS | ({"initContainers"} if case.hf_model else set())
        # --- sovereignty: exactly one required term: the plan's one region, its GPU, then the pool
        affinity = pod["affinity"]
        assert set(affinity) == {"nodeAffinity"} and set(affinity["nodeAffinity"]) == {"requiredDuringSchedulingIgnoredDuringExecution"}
        terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert set(terms) == {"nodeSelectorTerms"} and len(terms["nodeSelectorTerms"]) == 1
        expressions = terms["nodeSelectorTerms"][0]["matchExpressions"]
        assert terms["nodeSelectorTerms"][0] == {
            "matchExpressions": [
                {"key": case.region_label_key, "operator": "In", "values": [plan_region(case)]},
                gpu_expression(case),
                {"key": case.selector_key, "operator": "In", "values": [s.selector_value]},
            ]
        }
        # Pinned to exactly the plan's region, one region, inside what both policy and job allow
        # (every expression on the region key, the pool's own pin included, says just that) ...
        on_region = [e for e in expressions if e["key"] == case.region_label_key]
        assert on_region and all(e["operator"] == "In" and e["values"] == [plan.region] for e in on_region)
        assert plan.region in set(case.regions) & set(case.policy_regions)
        # ... and to the plan's GPU product: every value names the plan's GPU type (or, for a type
        # the table does not know, is one the pool itself names).
        (on_gpu,) = [e for e in expressions if e["key"] == (case.gpu[1] or GFD_PRODUCT)]
        assert on_gpu["operator"] == "In" and on_gpu["values"]
        for value in on_gpu["values"]:
            known = gpu_type_info(value)
            assert (known.name == plan.gpu_type) if known else value in case.gpu[2]
        (container,) = pod["containers"]
        assert set(container) == CONTAINER_KEYS and container["name"] == "pytorch"
        assert container["image"] == (s.image if case.image_override else s.policy_image)
        assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"]
        assert container["resources"]["requests"] == container["resources"]["limits"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == str(case.gpus_per_node)
        tolerations = pod["tolerations"]
        assert tolerations[0] == {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        if case.taint is not None and case.taint[0] != "nvidia.com/gpu":
            assert any(t["key"] == case.taint[0] and t.get("value") == case.taint[1] for t in tolerations)
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        assert claims.get("data") == case.claims[1] and claims["checkpoints"] == case.claims[2]
        assert claims.get("model") == (None if case.hf_model else case.claims[0])
        assert claims.get("output") == (case.claims[3] if case.output_volume else None)
        if case.hf_model:
            (fetch,) = pod["initContainers"]
            assert fetch["command"][fetch["command"].index("--revision") + 1] == s.hf_revision
            secret = next(e for e in fetch["env"] if e["name"] == "HF_TOKEN")["valueFrom"]["secretKeyRef"]
            assert secret == {"name": case.claims[0], "key": s.secret_key}

    # --- verbatim strings
    assert pj["metadata"]["annotations"]["finetune.dev/model"] == s.model_name
    assert pj["metadata"]["ownerReferences"] == [
        {"apiVersion": api.API_VERSION, "kind": api.KIND, "name": case.job_name, "uid": s.uid, "controller": True, "blockOwnerDeletion": True}
    ]
    if case.namespace:
        assert pj["metadata"]["namespace"] == rendered.config_map["metadata"]["namespace"] == case.namespace
    if case.queue_name:
        assert pj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == case.queue_name
    config = json.loads(rendered.config_map["data"]["config.json"])
    assert config["model"]["path"] == ("/mnt/model" if case.hf_model else f"/mnt/model/{s.model_path}")
    assert config["dataset"]["path"] == f"/mnt/data/{s.data_path}"
    assert config["checkpoint"]["directory"] == f"/mnt/checkpoints/{s.checkpoint_path}"
    assert config["outputDirectory"] == (
        f"/mnt/output/{s.output_path}" if case.output_volume else f"/mnt/checkpoints/{s.checkpoint_path}/final"
    )
    assert config["jobName"] == case.job_name and config["attempt"] == case.attempt
    assert rendered.trainer_config.model_dump(by_alias=True, exclude_none=True) == config

    if schema:
        assert attempt_errors(rendered.config_map, rendered.pytorch_job) == []
        # What `finetune-operator render` prints reads back as exactly the same objects.
        assert list(yaml.safe_load_all(manifests_yaml(rendered.objects))) == rendered.objects

    check_trainjob(case, job, plan, policy, rendered, twin_job, twin_policy, twin_pool, schema)


def check_trainjob(case: Case, job, plan, policy, rendered, twin_job, twin_policy, twin_pool, schema: bool) -> None:
    """The TrainJob backend: the same strings change nothing of its shape either, and its pods are
    pinned exactly like the PyTorchJob's (the plan's one region inside the allowed ones, its GPU
    product, its pool), carry the same labels, tolerations and volumes."""
    if case.hf_model:
        # A Hub model needs the fetch-model init container, which a runtime patch cannot add.
        with pytest.raises(RenderError):
            render_trainjob(job, plan, case.attempt, policy)
        return
    image = job.spec.image or policy.trainer_image
    if len(image) > 500:
        # The TrainJob CRD bounds spec.trainer.image; the renderer says so instead of the API server.
        with pytest.raises(RenderError, match="spec.trainer.image"):
            render_trainjob(job, plan, case.attempt, policy)
        return
    tj = render_trainjob(job, plan, case.attempt, policy)
    twin = render_trainjob(twin_job, plan.model_copy(update={"pool": twin_pool}), case.attempt, twin_policy)
    assert skeleton(tj) == skeleton(twin)
    assert tj["metadata"]["name"] == rendered.name
    assert tj["metadata"]["labels"] == rendered.pytorch_job["metadata"]["labels"]
    assert tj["spec"]["suspend"] is (case.suspend or case.queue_name is not None)
    assert tj["spec"]["trainer"]["numNodes"] == case.nodes and tj["spec"]["trainer"]["numProcPerNode"] == case.gpus_per_node
    patch = pod_template_patch(tj)
    master = rendered.pytorch_job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    assert patch["metadata"] == master["metadata"]
    for key in ("affinity", "tolerations", "volumes", "securityContext"):
        # The same objects, as Go writes them back (trainjob._as_go_writes_it: no readOnly false, no empty lists).
        assert patch["spec"].get(key, []) == _as_go_writes_it(master["spec"][key]), key
    # Exactly the plan's region and GPU product, worked out from the case (not from the PyTorchJob).
    (term,) = patch["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"][:2] == [
        {"key": case.region_label_key, "operator": "In", "values": [plan_region(case)]},
        gpu_expression(case),
    ]
    on_region = [e for e in term["matchExpressions"] if e["key"] == case.region_label_key]
    assert all(e["operator"] == "In" and e["values"] == [plan.region] for e in on_region)
    assert plan.region in set(case.regions) & set(case.policy_regions)
    trainer = tj["spec"]["trainer"]
    (container,) = master["spec"]["containers"]
    assert trainer["image"] == container["image"] and trainer["command"] == container["command"]
    assert trainer["env"] == container["env"] and trainer["resourcesPerNode"] == container["resources"]
    if schema:
        assert trainjob_errors(tj) == []


RUNS = {"examples": 0}


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    database=None,
)
@given(case=cases())
def _property(case: Case) -> None:
    RUNS["examples"] += 1
    check(case, schema=RUNS["examples"] % SCHEMA_EVERY == 1)


@pytest.mark.slow
def test_no_string_changes_the_shape_of_a_rendered_attempt():
    pytorchjob_schema()  # load the upstream schemas once, outside the examples
    trainjob_schema()
    RUNS["examples"] = 0
    _property()
    print(f"\nrendering property test: {RUNS['examples']} examples")
    assert RUNS["examples"] >= EXAMPLES


def _spliced(value: Any) -> Any:
    """What a careless template does: strings pasted between quotes, unescaped."""
    from finetune_operator.rendering import templating

    if isinstance(value, str):
        return templating._JsonText(f'"{value}"')
    return templating._json_filter(value)


@pytest.mark.parametrize(
    "nasty",
    [
        '", "nodeSelectorTerms": [], "x": "',  # closes the string and adds keys
        "eu\"]}, {\"key\": \"r\", \"operator\": \"Exists",  # widens the affinity
        'a"b',  # merely breaks the JSON
    ],
)
def test_the_property_check_catches_a_template_that_splices_text(monkeypatch, nasty):
    # The check has teeth: with the json filter replaced by text splicing, a nasty
    # selector value (or model name) either breaks the render or fails the check.
    from finetune_operator.rendering import templating

    case = Case(
        # Every free text nasty, but the revision: the API only takes a git ref there.
        strings=Strings(**{name: "v1" if name == "hf_revision" else nasty for name in Strings.__dataclass_fields__}),
        job_name="demo", namespace="team-a", claims=("m", "d", "c", "o"), regions=("eu-de-berlin",),
        policy_regions=("eu-de-berlin",), region_label_key="topology.kubernetes.io/region",
        selector_key="karpenter.sh/nodepool", taint=None, queue_name=None, hf_model=True, output_volume=True,
        image_override=False, nodes=2, gpus_per_node=2, strategy="zero3", attempt=1, suspend=False,
        pin_region=False, region_index=0, gpu=("H100-80GB", None, ()),
    )
    check(case, schema=False)  # the real filter: passes
    monkeypatch.setitem(templating._ENV.filters, "json", _spliced)
    with pytest.raises(Exception):
        check(case, schema=False)
