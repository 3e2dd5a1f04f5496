"""The `finetune-operator` command.

Each subcommand is registered by one `_add_<name>` function, so that a subcommand's
options and its implementation sit together and new ones do not touch the others.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

import yaml

from . import api


class CliError(Exception):
    """An error to show the user without a traceback (exit code 2)."""


def load_job(path: str) -> api.FineTuneJob:
    """Read and validate one FineTuneJob from a YAML file (`-` for standard input)."""
    text = sys.stdin.read() if path == "-" else _read(path)
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as error:
        raise CliError(f"{path}: not valid YAML: {error}") from None
    jobs = [d for d in documents if isinstance(d, dict) and d.get("kind") == api.KIND]
    if len(jobs) != 1:
        raise CliError(f"{path}: expected exactly one {api.KIND} document, found {len(jobs)}")
    try:
        return api.parse_job(jobs[0])
    except api.JobValidationError as error:
        lines = "\n".join(f"  {p}" for p in error.problems)
        raise CliError(f"{path}: invalid {api.KIND}:\n{lines}") from None


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise CliError(f"cannot read {path}: {error.strerror}") from None


def dump_yaml(documents: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(documents, sort_keys=False, allow_unicode=True)


# ---------------------------------------------------------------------------
# subcommands
# ---------------------------------------------------------------------------


def _add_crd(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("crd", help="print the FineTuneJob CRD generated from the API models")
    p.set_defaults(func=_run_crd)


def _run_crd(args: argparse.Namespace) -> int:
    from .crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def _add_presets(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("presets", help="list the architecture presets (spec.model.architecture.preset)")
    p.set_defaults(func=_run_presets)


def _run_presets(args: argparse.Namespace) -> int:
    from .sizing import PRESETS

    for name, arch in sorted(PRESETS.items()):
        sys.stdout.write(f"{name:<20} {arch.family:<12} {arch.total_params / 1e9:>8.2f}B  {arch.name}\n")
    return 0


def _add_validate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="validate FineTuneJob YAML files; name every bad field")
    p.add_argument("files", nargs="+", help="FineTuneJob YAML files")
    p.set_defaults(func=_run_validate)


def _run_validate(args: argparse.Namespace) -> int:
    failed = 0
    for path in args.files:
        try:
            job = load_job(path)
        except CliError as error:
            print(error, file=sys.stderr)
            failed += 1
        else:
            print(f"{path}: {api.KIND} {job.metadata.name} is valid")
    return 1 if failed else 0


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run the operator against the current cluster")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (the default)")
    scope.add_argument("--namespace", "-n", action="append", default=[], help="watch this namespace (repeatable)")
    p.add_argument("--policy-configmap", help="ConfigMap holding the cluster policy (key policy.yaml); reloaded on change")
    p.add_argument("--policy-namespace", default=None, help="its namespace (default: $POD_NAMESPACE or 'default')")
    p.add_argument("--policy-file", help="read the policy from a file instead (no reload)")
    p.add_argument("--kubeconfig", help="kubeconfig to use (default: in-cluster, then ~/.kube/config)")
    p.add_argument("--health-port", type=int, default=8080, help="liveness endpoint port (/healthz); 0 turns it off")
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus metrics port; 0 turns it off")
    p.add_argument("--lease", default="finetune-operator",
                   help="Lease (in the policy namespace) that elects the one active replica ('' for a single replica, no election)")
    p.add_argument("--identity", default=None, help="this replica's name in the election (default: $POD_NAME, else the host name)")
    p.add_argument("--workers", type=int, default=64,
                   help="jobs reconciled in parallel (a reconcile mostly waits for the API server; bench/scale.py)")
    p.add_argument("--progress-interval", type=float, default=20.0,
                   help="seconds between two reads of a running job's rank-0 pod log for status.progress (0: off)")
    p.add_argument("--log-format", choices=["json", "plain"], default="json")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    p.set_defaults(func=_run_operator)


def _run_operator(args: argparse.Namespace) -> int:
    import logging
    import os

    from .shell import handlers, runner

    runner.configure_logging(args.log_format, args.log_level)
    handlers.RUNTIME.options = handlers.Options(
        policy_configmap=args.policy_configmap,
        policy_namespace=args.policy_namespace or os.environ.get("POD_NAMESPACE", "default"),
        policy_file=args.policy_file,
        metrics_port=args.metrics_port or None,
        workers=args.workers,
        lease=args.lease or None,
        identity=args.identity,
        clusterwide=not args.namespace,
        namespaces=tuple(args.namespace),
        kubeconfig=args.kubeconfig,
        progress_interval=max(args.progress_interval, 0.0),
    )
    code = runner.run(handlers.start, handlers.shutdown, health_port=args.health_port or None,
                      dead=handlers.dead_threads)
    # The shutdown ran (the Lease handed back, the last Events posted). What is left are daemon
    # threads, some blocked in a socket read (a watch, the metrics server). Letting the interpreter
    # finalise under them races them for the stdout/stderr locks and the GIL, and the process aborts
    # now and then (SIGABRT, exit -6, seen on SIGTERM in the chart's e2e test). Nothing remains to be
    # done, so leave without finalising, after flushing what was written.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan a FineTuneJob against node pools: pool, GPUs, strategy, batch split")
    p.add_argument("job", help="FineTuneJob YAML file (- for standard input)")
    p.add_argument("--pools", help="node-pool catalog YAML (e.g. examples/pools.yaml)")
    p.add_argument("--policy", help="cluster policy YAML (allowedRegions, catalog, ...); default: the pools file's allowedRegions")
    p.add_argument("--nodes", help="Node list for discovery (kubectl get nodes -o json)")
    p.add_argument("--pods", help="Pod list for free GPUs (kubectl get pods -A -o json)")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    p.set_defaults(func=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    from .planning import plan_job
    from .planning.plan import Plan
    from .planning.report import PlanInputError, format_table, planning_inputs, result_json

    job = load_job(args.job)
    try:
        pools, policy = planning_inputs(
            args.pools, _read(args.pools) if args.pools else None,
            args.policy, _read(args.policy) if args.policy else None,
            (args.nodes, _read(args.nodes)) if args.nodes else None,
            (args.pods, _read(args.pods)) if args.pods else None,
        )
    except PlanInputError as error:
        raise CliError(str(error)) from None
    result = plan_job(job.spec, pools, policy)
    if args.output == "json":
        print_json(result_json(result))
    else:
        sys.stdout.write(format_table(result, job.metadata.name))
    return 0 if isinstance(result, Plan) else 1


def _add_estimate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("estimate", help="estimate per-GPU and host memory of a FineTuneJob's fixed setup")
    p.add_argument("job", help="FineTuneJob YAML file (- for standard input)")
    p.add_argument("--model-config", help="config.json of the model (for spec.model.architecture.configMapRef)")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    p.set_defaults(func=_run_estimate)


def _run_estimate(args: argparse.Namespace) -> int:
    from .sizing import SizingError, estimate_memory
    from .sizing.from_job import setup_from_job
    from .sizing.report import format_table

    job = load_job(args.job)
    model_config = None
    if args.model_config:
        try:
            model_config = json.loads(_read(args.model_config))
        except json.JSONDecodeError as error:
            raise CliError(f"{args.model_config}: not valid JSON: {error}") from None
    try:
        job_setup = setup_from_job(job, model_config)
        estimate = estimate_memory(job_setup.setup)
    except SizingError as error:
        raise CliError(f"{args.job}: {error}") from None
    notes = list(job_setup.notes) + list(estimate.notes)
    if args.output == "json":
        document = estimate.to_json()
        document["notes"] = notes
        print_json(document)
    else:
        from dataclasses import replace

        sys.stdout.write(format_table(replace(estimate, notes=tuple(notes)), job_setup.setup))
    return 0


def _add_render(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("render", help="plan a FineTuneJob and print its attempt's ConfigMap and PyTorchJob (kubectl apply -f -)")
    p.add_argument("job", help="FineTuneJob YAML file (- for standard input)")
    p.add_argument("--pools", required=True, help="node-pool catalog YAML (e.g. examples/pools.yaml)")
    p.add_argument("--policy", help="cluster policy YAML (allowedRegions, trainerImage, ...); default: the pools file's allowedRegions")
    p.add_argument("--attempt", type=int, default=1, help="attempt number, from 1 (names the objects <job>-a<N>)")
    p.set_defaults(func=_run_render)


def _run_render(args: argparse.Namespace) -> int:
    from .planning import plan_job
    from .planning.plan import Plan
    from .planning.report import PlanInputError, planning_inputs
    from .rendering import RenderError
    from .rendering.backend import DEFAULT_BACKEND
    from .rendering.output import manifests_yaml

    if args.attempt < 1:
        raise CliError(f"--attempt: must be at least 1, got {args.attempt}")
    job = load_job(args.job)
    try:
        pools, policy = planning_inputs(
            args.pools, _read(args.pools), args.policy, _read(args.policy) if args.policy else None
        )
    except PlanInputError as error:
        raise CliError(str(error)) from None
    result = plan_job(job.spec, pools, policy)
    if not isinstance(result, Plan):
        raise CliError(f"{args.job}: no plan fits: {result.message}")
    try:
        rendered = DEFAULT_BACKEND.render(job, result, args.attempt, policy)
    except RenderError as error:
        raise CliError(f"{args.job}: cannot render: {error}") from None
    sys.stdout.write(manifests_yaml(rendered.objects))
    return 0


def _add_record(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("record", help="print a FineTuneJob's provenance record: data, model, attempts, GPU-hours, energy")
    p.add_argument("name", nargs="?", help="the FineTuneJob in the cluster (read with your kubeconfig)")
    p.add_argument("-n", "--namespace", help="its namespace (default: the kubeconfig context's, else default)")
    p.add_argument("-f", "--file", help="read the job from a file instead (kubectl get ftj NAME -o yaml; - for standard input)")
    p.add_argument("--kubeconfig", help="kubeconfig to use (default: $KUBECONFIG or ~/.kube/config)")
    p.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")
    p.set_defaults(func=_run_record)


def _run_record(args: argparse.Namespace) -> int:
    from datetime import datetime, timezone

    from .provenance import build_record

    if (args.name is None) == (args.file is None):
        raise CliError("record: name a FineTuneJob or give -f FILE (one of them)")
    job = load_job(args.file) if args.file else _read_cluster_job(args.name, args.namespace, args.kubeconfig)
    record = build_record(job, datetime.now(timezone.utc)).model_dump(mode="json", by_alias=True, exclude_none=True)
    if args.output == "json":
        print_json(record)
    else:
        sys.stdout.write(dump_yaml([record]))
    return 0


def _read_cluster_job(name: str, namespace: str | None, kubeconfig: str | None) -> api.FineTuneJob:
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException

    from .shell.apiclient import bounded_client, client_configuration

    try:
        configuration = client_configuration(kubeconfig)
        if namespace is None:
            _, active = config.list_kube_config_contexts(config_file=kubeconfig)
            namespace = (active or {}).get("context", {}).get("namespace") or "default"
    except (config.ConfigException, OSError) as error:
        raise CliError(f"record: no cluster to read from: {error}") from None
    with bounded_client(configuration) as api_client:
        try:
            body = client.CustomObjectsApi(api_client).get_namespaced_custom_object(
                api.GROUP, api.VERSION, namespace, api.PLURAL, name)
        except ApiException as error:
            if error.status == 404:
                raise CliError(f"record: FineTuneJob {namespace}/{name} not found") from None
            raise CliError(f"record: reading FineTuneJob {namespace}/{name}: {error.status} {error.reason}") from None
    try:
        return api.parse_job(body)
    except api.JobValidationError as error:
        raise CliError(f"record: FineTuneJob {namespace}/{name} does not read back: {error}") from None


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_crd, _add_presets, _add_validate, _add_run, _add_plan, _add_render, _add_estimate, _add_record,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="finetune-operator",
        description="Size, place and self-heal LLM fine-tuning jobs on Kubernetes.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CliError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=False))


if __name__ == "__main__":
    sys.exit(main())
