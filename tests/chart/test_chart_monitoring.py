"""The chart's Grafana dashboard and PrometheusRule: off by default, rendered from the values that
configure them, and every PromQL expression in them names only metrics the operator really exports
(`finetune_operator.shell.metrics`, read from the prometheus_client registry) or that Prometheus itself
writes (`up`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from chart_support import CHART, TOOLS_DIR, Rendered, kubernetes_version, with_values

RELEASE_NS = "finetune-system"
FULLNAME = "finetune-operator"
DASHBOARD_FILE = CHART / "dashboards" / "finetune-operator.json"
# Series Prometheus writes for every scrape target, not the operator.
PROMETHEUS_SERIES = {"up"}


# ---------------------------------------------------------------------------
# what the operator exports, and what an expression names
# ---------------------------------------------------------------------------

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "gauge": ("",),
    "unknown": ("",),
}


def exported_metric_names() -> set[str]:
    """Every series name the operator's /metrics can carry: the families the registry collects,
    with the suffixes of their type, and the sample names it has now."""
    from prometheus_client import REGISTRY

    import finetune_operator.shell.metrics  # noqa: F401  (registers the operator's metrics)

    names: set[str] = set()
    for family in REGISTRY.collect():
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
             "offset", "inf", "nan", "atan2"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are neither functions nor
    keywords, once strings, label matchers, ranges and label lists are taken out. Grafana's
    `label_values(<selector>, <label>)` counts as its selector."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    text = re.sub(r"label_values\(([^,()]*(?:\{[^{}]*\})?)\s*,\s*\w+\s*\)", r"\1", text)
    text = re.sub(r"label_values\(\s*\w+\s*\)", "", text)
    text = re.sub(r"\$\{[^}]*\}|\$\w+", "1m", text)
    text = re.sub(r"\{[^{}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.:])[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = match.group()
        if word.lower() in _KEYWORDS or text[match.end():].lstrip().startswith("("):
            continue
        names.add(word)
    return names


def balanced(expr: str) -> bool:
    """Brackets of a PromQL expression pair up (outside strings); a cheap check of its syntax."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    for char in text:
        if char in "([{":
            stack.append(char)
        elif char in pairs:
            if not stack or stack.pop() != pairs[char]:
                return False
    return not stack and text.count('"') % 2 == 0


@pytest.mark.parametrize(("expr", "names"), [
    ('sum by (le, result) (rate(foo_bucket{job=~"$job", le="1.0"}[$__rate_interval]))', {"foo_bucket"}),
    ("time() - max by (a, b) (bar{x=\"y\"}) > 1800", {"bar"}),
    ("absent(up{job=\"j\"} == 1)", {"up"}),
    ("a_total / on (pod) group_left (node) b offset 5m", {"a_total", "b"}),
    ('label_values(baz{namespace=~"$namespace"}, job)', {"baz"}),
    ("label_values(qux, namespace)", {"qux"}),
    ("histogram_quantile(0.9, sum by (le) (rate(h_bucket[5m]))) > 1e3", {"h_bucket"}),
])
def test_metric_names_are_read_out_of_promql(expr, names):
    assert metric_names(expr) == names


def test_exported_names_include_type_suffixes():
    names = exported_metric_names()
    for name in ("finetune_jobs", "finetune_attempts_total", "finetune_planning_seconds_bucket",
                 "finetune_planning_seconds_count", "finetune_gpu_seconds_total", "finetune_gpus_running",
                 "finetune_reconcile_seconds_bucket", "process_resident_memory_bytes"):
        assert name in names, name
    assert "finetune_jobs_total" not in names and "finetune_attempts" not in names


# ---------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------


@pytest.fixture
def render(helm, tmp_path):
    def _render(values: dict[str, Any], **kw: Any) -> Rendered:
        return helm.render(values, tmp_path, namespace=RELEASE_NS, **kw)

    return _render


def monitoring(values: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return with_values(values, **{"metrics.serviceMonitor.enabled": True, "metrics.dashboard.enabled": True,
                                  "metrics.prometheusRule.enabled": True, **changes})


def _dashboard(r: Rendered, namespace: str = RELEASE_NS) -> tuple[dict[str, Any], dict[str, Any]]:
    cms = [c for c in r.of_kind("ConfigMap") if c["metadata"]["name"] == f"{FULLNAME}-dashboard"]
    assert len(cms) == 1 and cms[0]["metadata"]["namespace"] == namespace
    (key, text), = cms[0]["data"].items()
    assert key.endswith(".json")
    return cms[0], json.loads(text)


def _exprs_of_dashboard(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if variable["type"] == "query":
            out.append((f"variable {variable['name']}", query["query"] if isinstance(query, dict) else query))
    return out


def _rules(r: Rendered) -> dict[str, dict[str, Any]]:
    (rule,) = r.of_kind("PrometheusRule")
    return {item["alert"]: item for group in rule["spec"]["groups"] for item in group["rules"]}


def test_both_are_absent_by_default(render, default_values):
    r = render(default_values)
    assert r.of_kind("PrometheusRule") == []
    assert [c["metadata"]["name"] for c in r.of_kind("ConfigMap")] == [f"{FULLNAME}-policy"]
    assert default_values["metrics"]["dashboard"]["enabled"] is False
    assert default_values["metrics"]["prometheusRule"]["enabled"] is False
    # Turning on the ServiceMonitor alone adds neither.
    r = render(with_values(default_values, **{"metrics.serviceMonitor.enabled": True}))
    assert r.of_kind("PrometheusRule") == [] and len(r.of_kind("ConfigMap")) == 1


def test_lint_passes_with_everything_on(helm, default_values, tmp_path):
    values = monitoring(default_values, **{"metrics.dashboard.namespace": "grafana",
                                           "metrics.prometheusRule.labels": {"release": "prom"},
                                           "metrics.prometheusRule.alertLabels": {"team": "platform"}})
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    lint = helm.run("lint", str(CHART), "--strict", "--kube-version", kubernetes_version(),
                    "--namespace", RELEASE_NS, "--values", str(path))
    assert lint.returncode == 0, lint.stdout + lint.stderr
    r = helm.render(values, tmp_path, namespace=RELEASE_NS)
    assert len(r.of_kind("PrometheusRule")) == 1 and len(r.of_kind("ServiceMonitor")) == 1


def test_dashboard_configmap_is_found_by_the_grafana_sidecar(render, default_values):
    cm, dashboard = _dashboard(render(monitoring(default_values)))
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["labels"]["app.kubernetes.io/instance"] == "finetune-operator"
    assert "annotations" not in cm["metadata"]
    assert dashboard["uid"] == "finetune-operator" and dashboard["title"]
    cm, _ = _dashboard(render(monitoring(default_values, **{
        "metrics.dashboard.namespace": "grafana",
        "metrics.dashboard.labels": {"example.com/dashboards": "platform"},
        "metrics.dashboard.annotations": {"grafana_folder": "Fine-tuning"},
    })), namespace="grafana")
    # Helm merges maps: the default label stays unless set to null; the new one is added.
    assert cm["metadata"]["labels"]["example.com/dashboards"] == "platform"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Fine-tuning"}


def test_dashboard_is_the_file_shipped_and_well_formed(render, default_values):
    _, dashboard = _dashboard(render(monitoring(default_values)))
    assert dashboard == json.loads(DASHBOARD_FILE.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard["panels"]:
        assert {"x", "y", "w", "h"} <= panel["gridPos"].keys(), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            # Scoped to the chosen operator namespace and scrape job, like every query.
            assert 'namespace=~"$namespace"' in target["expr"] and 'job=~"$job"' in target["expr"], panel["title"]
    refs = [(p["title"], t["refId"]) for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(refs) == len(set(refs)), "refIds must be unique within a panel"


def test_dashboard_queries_use_only_exported_metrics(render, default_values):
    _, dashboard = _dashboard(render(monitoring(default_values)))
    exported = exported_metric_names() | PROMETHEUS_SERIES
    exprs = _exprs_of_dashboard(dashboard)
    assert len(exprs) > 15
    for where, expr in exprs:
        assert balanced(expr), f"{where}: unbalanced brackets or quotes in {expr}"
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr}"
        assert names <= exported, f"{where}: {sorted(names - exported)} not exported by the operator"


def test_dashboard_shows_what_the_platform_team_asked_for(default_values):
    """Jobs by phase, attempts and recoveries by kind, observed/predicted peak ratio, planning latency,
    GPU hours by pool and region (issue 18)."""
    dashboard = json.loads(DASHBOARD_FILE.read_text())
    used: dict[str, str] = {}
    for title, expr in _exprs_of_dashboard(dashboard):
        for name in metric_names(expr):
            used.setdefault(name, expr)
    wanted = {
        "finetune_jobs": "by (phase)",
        "finetune_attempts_total": "",
        "finetune_recoveries_total": "kind",
        "finetune_observed_to_predicted_peak_ratio_bucket": "histogram_quantile",
        "finetune_planning_seconds_bucket": "histogram_quantile",
        "finetune_gpu_seconds_total": "pool, region",
        "finetune_job_phase_since_timestamp_seconds": "Pending|Queued",
    }
    for name, needle in wanted.items():
        assert name in used, f"no panel reads {name}"
        exprs = [e for _, e in _exprs_of_dashboard(dashboard) if name in metric_names(e)]
        assert any(needle in e for e in exprs), f"{name}: no query with {needle!r}"
    gpu_hours = [e for _, e in _exprs_of_dashboard(dashboard) if "finetune_gpu_seconds_total" in e]
    assert any("/ 3600" in e and "increase(" in e for e in gpu_hours), "GPU hours: increase of GPU-seconds / 3600"


def test_rules_use_only_exported_metrics(render, default_values):
    rules = _rules(render(monitoring(default_values)))
    assert set(rules) == {"FineTuneJobFailed", "FineTuneRecoveriesHigh", "FineTuneJobPendingTooLong",
                          "FineTuneJobQueuedTooLong", "FineTuneOperatorDown"}
    exported = exported_metric_names() | PROMETHEUS_SERIES
    for name, rule in rules.items():
        expr = rule["expr"]
        assert balanced(expr), f"{name}: {expr}"
        names = metric_names(expr)
        assert names and names <= exported, f"{name}: {sorted(names - exported)} not exported by the operator"
        # Only this release's series: its scrape job in its namespace.
        assert f'job="{FULLNAME}-metrics", namespace="{RELEASE_NS}"' in expr, name
        assert rule["labels"]["severity"] and rule["annotations"]["summary"] and rule["annotations"]["description"]
        # Alert templates reach Prometheus as written, not eaten by Helm.
        assert "{{" not in expr
    assert "{{ $labels.job_namespace }}/{{ $labels.job_name }}" in rules["FineTuneJobPendingTooLong"]["annotations"]["summary"]


def test_rules_render_with_the_thresholds_from_values(render, default_values):
    rules = _rules(render(monitoring(default_values, **{
        "metrics.prometheusRule.jobFailed.window": "30m",
        "metrics.prometheusRule.recoveries.perHour": 25,
        "metrics.prometheusRule.recoveries.for": "20m",
        "metrics.prometheusRule.jobPending.minutes": 45,
        "metrics.prometheusRule.jobQueued.minutes": 240,
        "metrics.prometheusRule.jobQueued.severity": "warning",
        "metrics.prometheusRule.operatorDown.for": "2m",
        "metrics.prometheusRule.alertLabels": {"team": "platform"},
    })))
    assert rules["FineTuneJobFailed"]["expr"].endswith("[30m])) > 0")
    assert 'result="Failed", reason!="Invalid"' in rules["FineTuneJobFailed"]["expr"]
    assert rules["FineTuneRecoveriesHigh"]["expr"].endswith("[1h])) > 25")
    assert rules["FineTuneRecoveriesHigh"]["for"] == "20m"
    assert re.search(r'phase="Pending"}\) > 2700$', rules["FineTuneJobPendingTooLong"]["expr"])
    assert re.search(r'phase="Queued"}\) > 14400$', rules["FineTuneJobQueuedTooLong"]["expr"])
    assert rules["FineTuneJobQueuedTooLong"]["labels"] == {"severity": "warning", "team": "platform"}
    assert rules["FineTuneOperatorDown"]["for"] == "2m"
    assert rules["FineTuneOperatorDown"]["labels"] == {"severity": "critical", "team": "platform"}
    assert "more than 45 minutes" in rules["FineTuneJobPendingTooLong"]["annotations"]["description"]


def test_rules_can_be_turned_off_one_by_one_and_placed(render, default_values):
    r = render(monitoring(default_values, **{
        "metrics.prometheusRule.jobQueued.enabled": False,
        "metrics.prometheusRule.recoveries.enabled": False,
        "metrics.prometheusRule.namespace": "monitoring",
        "metrics.prometheusRule.labels": {"release": "kube-prometheus-stack"},
        "metrics.prometheusRule.scrapeJob": "finetune",
    }))
    (obj,) = r.of_kind("PrometheusRule")
    assert obj["apiVersion"] == "monitoring.coreos.com/v1"
    assert obj["metadata"]["namespace"] == "monitoring"
    assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rules = _rules(r)
    assert set(rules) == {"FineTuneJobFailed", "FineTuneJobPendingTooLong", "FineTuneOperatorDown"}
    # The series stay those of the release's namespace, whatever namespace the rule object is in.
    assert all(f'job="finetune", namespace="{RELEASE_NS}"' in rule["expr"] for rule in rules.values())
    # With no replica here (the operator runs elsewhere) "down" would always fire: not rendered.
    rules = _rules(render(monitoring(default_values, replicaCount=0)))
    assert "FineTuneOperatorDown" not in rules and "FineTuneJobFailed" in rules


def test_rules_need_the_metrics_scraped(helm, default_values, tmp_path):
    values = with_values(default_values, **{"metrics.prometheusRule.enabled": True})
    proc = helm.template(values, tmp_path, namespace=RELEASE_NS)
    assert proc.returncode != 0 and "enable metrics.serviceMonitor" in proc.stderr
    ok = helm.template(with_values(values, **{"metrics.prometheusRule.scrapeJob": "kubernetes-pods"}), tmp_path,
                       namespace=RELEASE_NS)
    assert ok.returncode == 0, ok.stderr


@pytest.mark.parametrize(("path", "value"), [
    ("metrics.prometheusRule.jobPending.minutes", 0),
    ("metrics.prometheusRule.jobPending.minutes", "30"),
    ("metrics.prometheusRule.recoveries.perHour", 0),
    ("metrics.prometheusRule.jobFailed.window", "15 minutes"),
    ("metrics.prometheusRule.operatorDown.for", ""),
    ("metrics.prometheusRule.scrapeJob", 'x"} or vector(1) #'),
    ("metrics.prometheusRule.jobQueued.severity", ""),
    ("metrics.prometheusRule.alertLabels", {"bad-name": "x"}),
    ("metrics.prometheusRule.jobFailed.treshold", 1),
    ("metrics.dashboard.labels", None),  # null drops the default: no label the sidecar could find
    ("metrics.dashboard.namespace", "Not_A_Namespace"),
    ("metrics.dashboard.enable", True),
])
def test_schema_rejects_bad_monitoring_values(helm, default_values, tmp_path, path, value):
    values = monitoring(default_values)
    parent, _, leaf = path.rpartition(".")
    node = values
    for key in parent.split("."):
        node = node[key]
    node[leaf] = value
    proc = helm.template(values, tmp_path, namespace=RELEASE_NS)
    assert proc.returncode != 0, f"{path}={value!r} was accepted"
    # The schema refuses it (helm's path of a propertyNames error is unreliable, so only the refusal is checked).
    assert "don't meet the specifications of the schema" in proc.stderr, proc.stderr



# ---------------------------------------------------------------------------
# Prometheus's own parser, when built
# ---------------------------------------------------------------------------

PROMQL_CHECK_SOURCE = "tests/chart/promql_check"
# What Grafana puts in place of its variables before a query reaches Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "2m", "$__range": "24h", "$__interval": "1m", "$namespace": ".*", "$job": ".*"}


def find_promql_check() -> str | None:
    for candidate in (str(TOOLS_DIR / "promql_check"), shutil.which("promql_check")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def run_promql_check(items: list[dict[str, str]]) -> subprocess.CompletedProcess:
    binary = find_promql_check()
    if binary is None:
        pytest.skip(f"promql_check is not built: `cd {PROMQL_CHECK_SOURCE} && GOBIN={TOOLS_DIR} go install .` "
                    "(Prometheus's PromQL parser, pinned in its go.mod)")
    return subprocess.run([binary], input=json.dumps(items), capture_output=True, text=True, timeout=60)


def grafana_interpolated(expr: str) -> str:
    for variable, replacement in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, replacement)
    assert "$" not in expr, f"a Grafana variable this test does not know: {expr}"
    return expr


def test_promql_check_finds_a_bad_expression():
    proc = run_promql_check([{"where": "good", "expr": 'sum by (le) (rate(a_bucket{b="c"}[5m])) > 1'},
                             {"where": "bad", "expr": "sum(rate(a[5m]) >"}, {"where": "for", "duration": "15 m"}])
    assert proc.returncode == 1 and "bad:" in proc.stdout and "for:" in proc.stdout and "good" not in proc.stdout


def test_prometheus_parses_every_rule_and_dashboard_query(render, default_values):
    r = render(monitoring(default_values))
    items = []
    for name, rule in _rules(r).items():
        items.append({"where": f"rule {name}", "expr": rule["expr"]})
        if "for" in rule:
            items.append({"where": f"rule {name} for", "duration": rule["for"]})
    _, dashboard = _dashboard(r)
    for where, expr in _exprs_of_dashboard(dashboard):
        if where.startswith("variable "):
            expr = re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", expr)
        items.append({"where": f"dashboard {where}", "expr": grafana_interpolated(expr)})
    proc = run_promql_check(items)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(items)} checked, 0 problems" in proc.stdout


def test_readme_lists_every_metric_the_operator_exports():
    """The chart README's metrics table and the registry agree: no metric undocumented, none documented
    that is not exported."""
    from prometheus_client import REGISTRY

    import finetune_operator.shell.metrics  # noqa: F401

    families = set()
    for family in REGISTRY.collect():
        if family.name.startswith("finetune_"):
            families.add(family.name + ("_total" if family.type == "counter" else ""))
    text = (CHART / "README.md").read_text()
    table = text.split("### Metrics", 1)[1].split("\n\n", 2)[1]
    documented = set(re.findall(r"^\| `(finetune_[a-z_]+)` \|", table, flags=re.M))
    assert documented == families, f"undocumented: {sorted(families - documented)}; not exported: {sorted(documented - families)}"
