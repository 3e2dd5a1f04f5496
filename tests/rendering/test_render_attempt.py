"""What render_attempt produces for a job and a plan, and what it refuses."""

from __future__ import annotations

import json

import pytest
from jinja2 import TemplateError
from render_factories import GiB, plan_for, policy, pool

from finetune_operator import api
from finetune_operator.rendering import RenderError, is_queued, render_attempt, starts_suspended
from finetune_operator.rendering.templating import _ENV, render_json_template


def job_of(document: dict, **spec_updates) -> api.FineTuneJob:
    document["spec"].update(spec_updates)
    return api.parse_job(document)


def pods(rendered):
    return {k: v["template"] for k, v in rendered.pytorch_job["spec"]["pytorchReplicaSpecs"].items()}


def trainer(rendered) -> dict:
    return json.loads(rendered.config_map["data"]["config.json"])


def test_single_node_has_only_a_master(lora_job):
    job = job_of(lora_job)
    rendered = render_attempt(job, plan_for(job, gpus_per_node=2), 1, policy())
    specs = rendered.pytorch_job["spec"]["pytorchReplicaSpecs"]
    assert list(specs) == ["Master"] and specs["Master"]["replicas"] == 1
    command = specs["Master"]["template"]["spec"]["containers"][0]["command"]
    assert command == ["python", "-m", "finetune_trainer.launch", "--config", "/etc/finetune/config.json",
                       "--nnodes=1", "--nproc-per-node=2"]
    assert rendered.pytorch_job["spec"]["nprocPerNode"] == "2"


def test_multi_node_has_workers_and_identical_pods(lora_job):
    job = job_of(lora_job)
    rendered = render_attempt(job, plan_for(job, nodes=4, gpus_per_node=8), 3, policy())
    specs = rendered.pytorch_job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 3
    assert specs["Master"]["template"] == specs["Worker"]["template"]
    assert specs["Worker"]["template"]["metadata"]["labels"]["finetune.dev/attempt"] == "3"
    assert rendered.name == "demo-a3"


def test_resources_are_guaranteed_and_follow_the_plan(lora_job):
    job = job_of(lora_job)
    plan = plan_for(job, pool(cpus=192, gpus_per_node=8), gpus_per_node=2, host_memory_bytes=100 * GiB + 1)
    container = pods(render_attempt(job, plan, 1, policy()))["Master"]["spec"]["containers"][0]
    assert container["resources"]["requests"] == container["resources"]["limits"] == {
        "nvidia.com/gpu": "2",
        "cpu": "43",  # a quarter of the node's 192 CPUs, less the share left to the system
        "memory": f"{100 * 1024 + 1}Mi",  # rounded up, never below the estimate
    }


# The values GPU Feature Discovery writes into nvidia.com/gpu.product on an H100 SXM node.
H100_PRODUCTS = ["NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-SXM5-80GB"]


def match_expressions(rendered) -> list[dict]:
    terms = pods(rendered)["Master"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    (term,) = terms["nodeSelectorTerms"]
    return term["matchExpressions"]


def test_placement_is_required_affinity_on_region_gpu_and_pool(lora_job):
    job = job_of(lora_job, placement={"regions": ["eu-de-berlin", "eu-fr-paris"]})
    node_pool = pool(selector={"karpenter.sh/nodepool": "h100-berlin", "gpu.example/class": "h100"})
    plan = plan_for(job, node_pool, allowed_regions=["eu-fr-paris", "eu-de-berlin"])
    spec = pods(render_attempt(job, plan, 1, policy(region_label_key="example.com/region")))["Master"]["spec"]
    # One region (the plan's, though the plan could have used two) and the plan's GPU product.
    assert spec["affinity"] == {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": "example.com/region", "operator": "In", "values": ["eu-de-berlin"]},
                            {"key": "nvidia.com/gpu.product", "operator": "In", "values": H100_PRODUCTS},
                            {"key": "gpu.example/class", "operator": "In", "values": ["h100"]},
                            {"key": "karpenter.sh/nodepool", "operator": "In", "values": ["h100-berlin"]},
                        ]
                    }
                ]
            }
        }
    }
    assert spec["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"},
    ]


@pytest.mark.parametrize(
    "policy_regions,plan_regions,match",
    [
        (["eu-de-berlin"], ["eu-de-berlin", "us-east-virginia"], "us-east-virginia"),  # outside policy and job
        (["eu-fr-paris"], ["eu-de-berlin"], "not allowed by both"),  # the job allows it, the policy does not
        (["eu-de-berlin"], [], "empty"),
    ],
)
def test_regions_outside_policy_or_job_are_refused(lora_job, policy_regions, plan_regions, match):
    job = job_of(lora_job)
    plan = plan_for(job, allowed_regions=plan_regions)
    with pytest.raises(RenderError, match=match) as error:
        render_attempt(job, plan, 1, policy(allowed_regions=policy_regions))
    assert error.value.path == "plan.allowedRegions"


def test_a_pool_outside_the_plans_region_is_refused(lora_job):
    job = job_of(lora_job, placement={"regions": ["eu-de-berlin", "eu-fr-paris"]})
    plan = plan_for(job, pool(region="eu-fr-paris"), region="eu-de-berlin", allowed_regions=["eu-de-berlin"])
    with pytest.raises(RenderError, match="pool h100-berlin is in 'eu-fr-paris'"):
        render_attempt(job, plan, 1, policy())


@pytest.mark.parametrize("other", ["us-east-virginia", "eu-fr-paris"])  # outside the allowed regions; allowed, but not the plan's
def test_a_pool_selector_cannot_move_the_region(lora_job, other):
    job = job_of(lora_job, placement={"regions": ["eu-de-berlin", "eu-fr-paris"]})
    plan = plan_for(job, pool(selector={"topology.kubernetes.io/region": other}), allowed_regions=["eu-de-berlin", "eu-fr-paris"])
    with pytest.raises(RenderError, match="not the plan's region 'eu-de-berlin'") as error:
        render_attempt(job, plan, 1, policy())
    assert error.value.path == "pool h100-berlin.selector"


def test_a_pool_selector_that_pins_the_plans_region_is_not_repeated(lora_job):
    # Discovery pins a pool label that spans regions by region as well.
    job = job_of(lora_job, placement={"regions": ["eu-de-berlin", "eu-fr-paris"]})
    node_pool = pool(selector={"karpenter.sh/nodepool": "h100", "topology.kubernetes.io/region": "eu-de-berlin"})
    plan = plan_for(job, node_pool, allowed_regions=["eu-de-berlin", "eu-fr-paris"])
    assert match_expressions(render_attempt(job, plan, 1, policy())) == [
        {"key": "topology.kubernetes.io/region", "operator": "In", "values": ["eu-de-berlin"]},
        {"key": "nvidia.com/gpu.product", "operator": "In", "values": H100_PRODUCTS},
        {"key": "karpenter.sh/nodepool", "operator": "In", "values": ["h100"]},
    ]


def test_a_multi_node_attempt_runs_in_the_plans_region_only(lora_job):
    # The plan may run in either region; its pods, Master and Workers alike, must all land in the one
    # it chose, or the ranks of one attempt could straddle a border.
    job = job_of(lora_job, placement={"regions": ["eu-de-berlin", "eu-fr-paris"]})
    paris = pool(name="h100-paris", region="eu-fr-paris", selector={"karpenter.sh/nodepool": "h100-paris"})
    rendered = render_attempt(job, plan_for(job, paris, nodes=4, allowed_regions=["eu-de-berlin", "eu-fr-paris"]), 1, policy())
    for template in pods(rendered).values():
        (term,) = template["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"]
        assert term["matchExpressions"][0] == {"key": "topology.kubernetes.io/region", "operator": "In", "values": ["eu-fr-paris"]}


def test_a_plan_region_the_policy_does_not_allow_is_refused_not_widened(lora_job):
    job = job_of(lora_job, placement={"regions": ["eu-de-berlin", "eu-fr-paris"]})
    paris = pool(name="h100-paris", region="eu-fr-paris")
    # The plan claims only Berlin is allowed but runs in Paris.
    with pytest.raises(RenderError, match="plan says 'eu-fr-paris'") as error:
        render_attempt(job, plan_for(job, paris, allowed_regions=["eu-de-berlin"]), 1, policy())
    assert error.value.path == "plan.region"
    # The policy allows only Berlin; a plan in Paris is refused, whatever the plan says is allowed.
    with pytest.raises(RenderError) as error:
        render_attempt(job, plan_for(job, paris, allowed_regions=["eu-fr-paris"]), 1, policy(allowed_regions=["eu-de-berlin"]))
    assert error.value.path == "plan.allowedRegions"


def test_gpu_label_under_another_key_pins_by_that_key(lora_job):
    # A GKE pool without GPU Feature Discovery: its nodes name the GPU in GKE's accelerator label.
    job = job_of(lora_job)
    node_pool = pool(gpu_label={"key": "cloud.google.com/gke-accelerator"})
    assert match_expressions(render_attempt(job, plan_for(job, node_pool), 1, policy()))[1] == {
        "key": "cloud.google.com/gke-accelerator", "operator": "In", "values": ["nvidia-h100-80gb", "nvidia-h100-mega-80gb"]
    }


def test_a_gpu_type_the_table_does_not_know_is_pinned_by_the_pools_own_values(lora_job):
    job = job_of(lora_job)
    node_pool = pool(gpu_type="B200-192GB", gpu_memory_bytes=180 * GiB, gpu_label={"values": ["NVIDIA-B200"]})
    assert match_expressions(render_attempt(job, plan_for(job, node_pool), 1, policy()))[1] == {
        "key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-B200"]
    }


def test_gpu_pins_that_cannot_be_right_are_refused(lora_job):
    job = job_of(lora_job)
    h100 = pool()
    # The plan says A100, the pool is H100.
    with pytest.raises(RenderError) as error:
        render_attempt(job, plan_for(job, h100, gpu_type="A100-80GB"), 1, policy())
    assert error.value.path == "plan.gpuType"
    # Nobody said how the nodes of an unknown GPU type are labelled: nothing to pin to.
    unknown = pool(gpu_type="B200-192GB", gpu_memory_bytes=180 * GiB)
    assert unknown.gpu_label is None
    with pytest.raises(RenderError, match="gpuLabel.values") as error:
        render_attempt(job, plan_for(job, unknown), 1, policy())
    assert error.value.path == "pool h100-berlin.gpuLabel"
    # A label value of another GPU type (a pool changed without validation) would pin the pods there.
    mislabelled = h100.model_copy(update={"gpu_label": h100.gpu_label.model_copy(update={"values": ["NVIDIA-A100-SXM4-80GB"]})})
    with pytest.raises(RenderError, match="names A100-80GB, not the plan.s H100-80GB") as error:
        render_attempt(job, plan_for(job, mislabelled), 1, policy())
    assert error.value.path == "pool h100-berlin.gpuLabel"
    # A value no node label can hold would leave the pods pending forever.
    nasty = h100.model_copy(update={"gpu_label": h100.gpu_label.model_copy(update={"values": ['H100"], "x": ["']})})
    with pytest.raises(RenderError, match="not a valid label value") as error:
        render_attempt(job, plan_for(job, nasty), 1, policy())
    # A pool selector on the GPU label may only narrow it to one of the plan's values.
    with pytest.raises(RenderError, match="selects GPU 'NVIDIA-A100-SXM4-80GB'") as error:
        render_attempt(job, plan_for(job, pool(selector={"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"})), 1, policy())
    assert error.value.path == "pool h100-berlin.selector"


def test_bad_label_keys_from_the_catalog_or_policy_are_named(lora_job):
    job = job_of(lora_job)
    with pytest.raises(RenderError) as error:
        render_attempt(job, plan_for(job, pool(selector={"bad key": "x"})), 1, policy())
    assert error.value.path == "pool h100-berlin.selector"
    with pytest.raises(RenderError) as error:
        render_attempt(job, plan_for(job), 1, policy(region_label_key="no spaces/allowed here"))
    assert error.value.path == "policy.regionLabelKey"
    with pytest.raises(RenderError) as error:
        render_attempt(job, plan_for(job, pool(taints=[{"key": "k", "value": "not a value!"}])), 1, policy())
    assert error.value.path == "pool h100-berlin.taints"


def test_gpu_taint_is_tolerated_once(lora_job):
    job = job_of(lora_job)
    plan = plan_for(job, pool(taints=[{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]))
    spec = pods(render_attempt(job, plan, 1, policy()))["Master"]["spec"]
    assert spec["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_labels_owner_queue_and_suspend(lora_job):
    lora_job["metadata"]["uid"] = "0b9d-uid"
    job = job_of(lora_job, queueName="research", suspend=True)
    rendered = render_attempt(job, plan_for(job), 2, policy())
    meta = rendered.pytorch_job["metadata"]
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "research"
    assert "kueue.x-k8s.io/queue-name" not in rendered.config_map["metadata"]["labels"]
    assert meta["labels"]["finetune.dev/job"] == "demo" and meta["labels"]["finetune.dev/attempt"] == "2"
    assert meta["namespace"] == rendered.config_map["metadata"]["namespace"] == "team-a"
    for obj in rendered.objects:
        assert obj["metadata"]["ownerReferences"] == [
            {"apiVersion": "finetune.dev/v1alpha1", "kind": "FineTuneJob", "name": "demo", "uid": "0b9d-uid",
             "controller": True, "blockOwnerDeletion": True}
        ]
    assert rendered.pytorch_job["spec"]["runPolicy"] == {"cleanPodPolicy": "Running", "suspend": True}
    assert is_queued(rendered.pytorch_job)


def test_a_queued_job_is_created_suspended_for_the_queue_to_admit(lora_job):
    # Kueue admits a job by un-suspending it; one created running would start before admission.
    job = job_of(lora_job, queueName="research")
    assert job.spec.suspend is False and starts_suspended(job.spec)
    rendered = render_attempt(job, plan_for(job), 1, policy())
    assert rendered.pytorch_job["spec"]["runPolicy"]["suspend"] is True
    assert is_queued(rendered.pytorch_job) and not is_queued(rendered.config_map)
    unqueued = render_attempt(job_of(lora_job, queueName=None), plan_for(job), 1, policy())
    assert not is_queued(unqueued.pytorch_job) and unqueued.pytorch_job["spec"]["runPolicy"]["suspend"] is False


def test_a_finished_job_frees_the_gpus_of_pods_still_running(lora_job):
    # Training-operator v1.9: once the job is Failed or Succeeded, "Running" deletes its Running and
    # Pending pods (hung peer ranks holding GPUs) and keeps the terminated ones that explain a failure;
    # "None" would keep them all, and "All" would delete the evidence too.
    job = job_of(lora_job)
    rendered = render_attempt(job, plan_for(job, nodes=2), 1, policy())
    assert rendered.pytorch_job["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"


def test_no_uid_no_owner_no_queue(lora_job):
    job = job_of(lora_job)
    rendered = render_attempt(job, plan_for(job), 1, policy())
    assert "ownerReferences" not in rendered.pytorch_job["metadata"]
    assert "kueue.x-k8s.io/queue-name" not in rendered.pytorch_job["metadata"]["labels"]
    assert rendered.pytorch_job["spec"]["runPolicy"]["suspend"] is False


def test_pod_security_volumes_and_env(lora_job):
    job = job_of(lora_job, checkpoint={"pvc": {"claimName": "ckpt", "path": "demo"}})
    rendered = render_attempt(job, plan_for(job, predicted_peak_bytes=123), 1, policy())
    template = pods(rendered)["Master"]
    from finetune_operator.rendering.pod import scanner_skips

    assert template["metadata"]["annotations"] == {
        "finetune.dev/predicted-peak-bytes": "123",
        "finetune.dev/job-name": job.metadata.name,
        **scanner_skips(credentials=False, network_policy=True),
    }
    spec = template["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    container = spec["containers"][0]
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert container["terminationMessagePath"] == "/dev/termination-log"
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory" and volumes["dshm"]["emptyDir"]["sizeLimit"].endswith("Mi")
    assert volumes["config"] == {"name": "config", "configMap": {"name": "demo-a1"}}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "ckpt", "readOnly": False}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/etc/finetune"] == "config" and mounts["/dev/shm"] == "dshm"
    config = trainer(rendered)
    assert config["model"]["path"] == "/mnt/model/llama"
    assert config["dataset"]["path"] == "/mnt/data/train.jsonl"
    assert config["checkpoint"] == {"directory": "/mnt/checkpoints/demo", "everySteps": 200, "keepLast": 2}
    assert config["outputDirectory"] == "/mnt/checkpoints/demo/final"


def test_a_job_without_volumes_for_the_result_writes_to_an_empty_dir(lora_job):
    job = job_of(lora_job)
    rendered = render_attempt(job, plan_for(job), 1, policy())
    spec = pods(rendered)["Master"]["spec"]
    assert {"name": "output", "emptyDir": {}} in spec["volumes"]
    assert trainer(rendered)["outputDirectory"] == "/mnt/output"
    assert "checkpoint" not in trainer(rendered)


def test_hub_model_is_fetched_by_an_init_container(lora_job):
    lora_job["spec"]["model"]["source"] = {
        "hf": {"repo": "meta-llama/Llama-3.1-8B", "revision": "0e9e39f", "tokenSecretRef": {"name": "hf"}}
    }
    job = job_of(lora_job)
    rendered = render_attempt(job, plan_for(job), 1, policy())
    spec = pods(rendered)["Master"]["spec"]
    (fetch,) = spec["initContainers"]
    assert fetch["command"] == ["hf", "download", "meta-llama/Llama-3.1-8B", "--revision", "0e9e39f", "--local-dir", "/mnt/model"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in fetch["env"]
    assert "nvidia.com/gpu" not in fetch["resources"]["limits"]
    assert {"name": "model", "emptyDir": {}} in spec["volumes"]
    assert trainer(rendered)["model"]["path"] == "/mnt/model"


@pytest.mark.parametrize(
    "where,value,path",
    [
        ("model", {"uri": "s3://bucket/llama"}, "spec.model.source.uri"),
        ("dataset", {"uri": "https://example.com/train.jsonl"}, "spec.dataset.source.uri"),
        ("output", {"uri": "gs://bucket/out"}, "spec.output.uri"),
    ],
)
def test_uri_sources_are_refused_as_not_supported_yet(lora_job, where, value, path):
    if where == "model":
        lora_job["spec"]["model"]["source"] = value
    elif where == "dataset":
        lora_job["spec"]["dataset"]["source"] = value
    else:
        lora_job["spec"]["output"] = value
    with pytest.raises(api.JobValidationError) as error:
        job_of(lora_job)
    assert [p.path for p in error.value.problems] == [path]
    assert "not supported yet" in error.value.problems[0].message


def test_trainer_config_follows_the_plan(lora_job):
    job = job_of(lora_job, training={"sequenceLength": 2048, "globalBatchSize": 32, "maxSteps": 100, "warmupRatio": 0.05})
    plan = plan_for(job, nodes=2, gpus_per_node=2, micro_batch_size=2, strategy="zero3", offload="optimizer",
                    gradient_checkpointing=False, optimizer="adamw")
    config = render_attempt(job, plan, 1, policy()).trainer_config
    assert (config.micro_batch_size, config.gradient_accumulation) == (2, 4)
    assert config.strategy == "zero3" and config.offload == "optimizer"
    assert config.deepspeed["train_batch_size"] == 32
    assert config.deepspeed["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert config.gradient_checkpointing is False
    assert config.learning_rate == 2e-4  # the lora default
    assert config.warmup_steps == 5 and config.warmup_ratio is None
    assert config.lora.target_modules == "all-linear"


def test_epochs_carry_the_warmup_ratio(lora_job):
    job = job_of(lora_job, method="full", lora=None,
                 training={"sequenceLength": 2048, "globalBatchSize": 32, "epochs": 2.0})
    config = render_attempt(job, plan_for(job, strategy="fsdp"), 1, policy()).trainer_config
    assert config.warmup_steps == 0 and config.warmup_ratio == 0.03
    assert config.learning_rate == 2e-5 and config.method == "full"
    assert config.fsdp is not None and config.deepspeed is None


def test_recovery_may_switch_lora_to_qlora(lora_job):
    lora_job["spec"]["lora"] = {"rank": 8, "targetModules": ["q_proj", "v_proj"]}
    job = job_of(lora_job)
    config = render_attempt(job, plan_for(job, method="qlora", optimizer="paged-adamw-8bit"), 2, policy()).trainer_config
    assert config.method == "qlora" and config.lora.rank == 8 and config.lora.target_modules == ["q_proj", "v_proj"]


def test_a_plan_that_changes_the_global_batch_is_refused(lora_job):
    job = job_of(lora_job)
    with pytest.raises(RenderError, match="globalBatchSize is 32") as error:
        render_attempt(job, plan_for(job, gradient_accumulation=3), 1, policy())
    assert error.value.path == "plan.gradientAccumulation"


def test_a_plan_the_trainer_would_refuse_is_named(lora_job):
    job = job_of(lora_job)
    with pytest.raises(RenderError, match="zero1 and zero2 are not run with bitsandbytes"):
        render_attempt(job, plan_for(job, method="qlora", strategy="zero2"), 1, policy())


def test_attempt_must_be_positive(lora_job):
    job = job_of(lora_job)
    with pytest.raises(RenderError, match="at least 1"):
        render_attempt(job, plan_for(job), 0, policy())


def test_templates_cannot_print_a_value_without_the_json_filter():
    with pytest.raises(TemplateError, match="without the json filter"):
        _ENV.from_string('{"a": "{{ x }}"}').render(x="ok")
    with pytest.raises(TemplateError, match="without the json filter"):
        _ENV.from_string('{"a": {{ x | json | upper }}}').render(x="ok")
    assert _ENV.from_string('{"a": {{ x | json }}}').render(x='", "b": "c') == '{"a": "\\", \\"b\\": \\"c"}'


def test_rendered_json_refuses_duplicate_keys(tmp_path, monkeypatch):
    template = _ENV.from_string('{"a": 1, "a": 2}')
    monkeypatch.setattr(_ENV, "get_template", lambda name: template)
    with pytest.raises(TemplateError, match="twice"):
        render_json_template("any")


def test_the_evaluation_settings_reach_the_trainer_and_are_absent_without_spec_evaluation(lora_job):
    job = job_of(lora_job, evaluation={"heldOutFraction": 0.05, "everySteps": 50, "microBatchSize": 8})
    rendered = render_attempt(job, plan_for(job, gpus_per_node=2), 1, policy())
    assert trainer(rendered)["evaluation"] == {"heldOutFraction": 0.05, "everySteps": 50, "microBatchSize": 8}
    del lora_job["spec"]["evaluation"]  # job_of updates the fixture in place
    plain = job_of(lora_job)
    assert "evaluation" not in trainer(render_attempt(plain, plan_for(plain, gpus_per_node=2), 1, policy()))


def test_early_stopping_and_keep_best_reach_the_trainer(lora_job):
    lora_job["spec"]["checkpoint"] = {"pvc": {"claimName": "ckpt"}, "everySteps": 50}
    job = job_of(lora_job, evaluation={"heldOutFraction": 0.05, "everySteps": 50, "keepBest": True,
                                       "earlyStopping": {"patience": 3, "minDelta": 0.01}})
    rendered = render_attempt(job, plan_for(job, gpus_per_node=2), 1, policy())
    assert trainer(rendered)["evaluation"] == {"heldOutFraction": 0.05, "everySteps": 50, "keepBest": True,
                                               "earlyStopping": {"patience": 3, "minDelta": 0.01}}


def test_a_separate_eval_dataset_on_a_volume_is_mounted_read_only_and_read_like_the_training_data(lora_job):
    lora_job["spec"]["dataset"]["format"] = "instruction"
    job = job_of(lora_job, evaluation={"dataset": {"pvc": {"claimName": "evals", "path": "support/eval.jsonl"}},
                                       "everySteps": 20})
    rendered = render_attempt(job, plan_for(job, gpus_per_node=2), 1, policy())
    assert trainer(rendered)["evaluation"] == {
        "dataset": {"path": "/mnt/eval/support/eval.jsonl", "format": "instruction", "packing": False,
                    "paddingFree": False},
        "everySteps": 20}
    spec = rendered.pytorch_job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert {"name": "eval", "persistentVolumeClaim": {"claimName": "evals", "readOnly": True}} in spec["volumes"]
    assert {"name": "eval", "mountPath": "/mnt/eval", "readOnly": True} in spec["containers"][0]["volumeMounts"]
    assert "initContainers" not in spec  # on a volume: nothing to fetch


def test_spec_export_reaches_the_trainer_and_an_omitted_one_defaults_by_the_plans_method(lora_job):
    job = job_of(lora_job, export="merged")
    assert trainer(render_attempt(job, plan_for(job), 1, policy()))["export"] == "merged"
    # Recovery may switch lora to qlora: merged stays valid (the trainer dequantises for the merge).
    assert render_attempt(job, plan_for(job, method="qlora", optimizer="paged-adamw-8bit"), 2,
                          policy()).trainer_config.export == "merged"
    del lora_job["spec"]["export"]  # job_of updates the fixture in place
    plain = job_of(lora_job)
    rendered = render_attempt(plain, plan_for(plain), 1, policy())
    assert "export" not in trainer(rendered) and rendered.trainer_config.export_kind == "adapter"


def test_padding_free_and_the_declared_tokens_reach_the_trainer(lora_job):
    lora_job["spec"]["dataset"].update(paddingFree=True, microBatchTokens=[900, 1500, 2000])
    job = job_of(lora_job)
    dataset = trainer(render_attempt(job, plan_for(job, gpus_per_node=2), 1, policy()))["dataset"]
    assert dataset["paddingFree"] is True and dataset["microBatchTokens"] == [900, 1500, 2000]
