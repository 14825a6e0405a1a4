"""deploy/: the Grafana dashboard and the Prometheus rules read only metrics the node exports,
cover every one of them, and pass promtool (`check rules`, and the rules' own unit tests) where
promtool is installed (scripts/bootstrap.sh installs Debian's `prometheus`, which ships it)."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "engy-node.json"
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "rules_test.yml"
PROMTOOL = shutil.which("promtool")
NO_PROMTOOL = "promtool is not installed: run scripts/bootstrap.sh (make test does), or apt-get install prometheus"
"""Not a skip: `make test` installs it, and rules nothing validated must not pass as checked."""

METRIC = re.compile(r"\b((?:engy|sglang):?[a-zA-Z0-9_:]*)")
SERIES_SUFFIXES = ("_bucket", "_sum", "_count")
NOT_METRICS = {"engy", "engy:"}
"""Words of the files that match METRIC but are not metrics (job names, the record prefix)."""


def registered() -> set[str]:
    """Every metric family the node registers: the first argument of each `.counter(…)`,
    `.gauge(…)` and `.histogram(…)` call in engy_node (metrics.py's `Registry`)."""
    names = set()
    for path in (ROOT / "engy_node").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in {"counter", "gauge", "histogram"}
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                names.add(node.args[0].value)
    return names


def expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    found = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", ())]
    for group in yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"]:
        found += [rule["expr"] for rule in group["rules"]]
    return found


def used_metrics(expr: str) -> set[str]:
    names = set()
    for word in METRIC.findall(expr):
        if word in NOT_METRICS or word.startswith("engy:"):  # a recording rule's own name
            continue
        for suffix in SERIES_SUFFIXES:
            if word.endswith(suffix):
                word = word.removesuffix(suffix)
                break
        names.add(word)
    return names


def test_the_scan_finds_the_metrics_of_each_role() -> None:
    names = registered()
    assert {"engy_miner_ttft_seconds", "engy_gateway_queue_depth", "sglang:num_running_reqs"} <= names


def test_every_metric_the_deploy_files_read_is_exported_and_every_exported_one_is_read() -> None:
    names = registered()
    used = set().union(*(used_metrics(expr) for expr in expressions()))
    assert used - names == set(), "deploy/ reads metrics the node does not export"
    assert names - used == set(), "metrics the node exports that no dashboard panel or rule shows"


def test_the_dashboard_is_importable() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert {var["name"] for var in dashboard["templating"]["list"]} == {"datasource", "instance"}
    for panel in dashboard["panels"]:
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
        for target in panel.get("targets", ()):
            assert '$instance"' in target["expr"], panel["title"]
            assert target["datasource"]["uid"] == "${datasource}"


def test_promtool_accepts_the_rules() -> None:
    assert PROMTOOL is not None, NO_PROMTOOL
    result = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_rules_fire_on_promtool_s_made_up_series() -> None:
    assert PROMTOOL is not None, NO_PROMTOOL
    result = subprocess.run(
        [PROMTOOL, "test", "rules", RULES_TEST.name], capture_output=True, text=True, timeout=120, cwd=RULES_TEST.parent
    )
    assert result.returncode == 0, result.stdout + result.stderr
