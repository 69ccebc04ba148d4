"""Grafana dashboards (docs/grafana/*.json) and alert rules (docs/prometheus/alerts.yaml) use
only metric names the gateway exports: every PromQL expression is parsed for the metric
names it selects, and each must be a series name of the gateway's registry."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import TelemetryConfig
from gateway.telemetry import Telemetry
from tests.conftest import ROOT

DASHBOARDS = sorted((ROOT / "docs" / "grafana").glob("*.json"))
ALERTS = ROOT / "docs" / "prometheus" / "alerts.yaml"

KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool"}
KEYWORDS |= {"offset", "inf", "nan"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w$.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers that are not functions, keywords,
    label names (in ``{...}`` matchers or grouping clauses), strings or range durations."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges and subqueries
    text = _GROUPING.sub("", text)
    names = set()
    for match in _IDENTIFIER.finditer(text):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in KEYWORDS:
            continue
        names.add(name)
    return names


def exported_names() -> set[str]:
    """Every series name the gateway's registry exposes (counters as *_total and *_created,
    histograms as *_bucket, *_count, *_sum, *_created), labelled families included."""
    registry = Telemetry(TelemetryConfig()).metrics.registry
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_count", "_sum", "_created"),
        "summary": ("", "_count", "_sum", "_created"),
        "gauge": ("",),
        "info": ("_info",),
    }
    names = set()
    for family in registry.collect():
        for suffix in suffixes.get(family.type, ("",)):
            names.add(family.name + suffix)
    return names


def dashboard_exprs(board: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            inner = re.search(r"label_values\((\w+)", variable["definition"])
            assert inner, variable
            yield f"variable {variable['name']}", inner.group(1)


def test_the_parser_finds_metric_names() -> None:
    expr = (
        'sum by (tenant) (rate(orchid_charged_accelerator_ms_total{tenant=~"$tenant", x="a b"}'
        "[$__rate_interval])) / ignoring (tenant) group_left sum(orchid_other) > 0.1 and on (instance) up"
    )
    assert metric_names(expr) == {"orchid_charged_accelerator_ms_total", "orchid_other", "up"}
    assert metric_names("histogram_quantile(0.5, sum by (le) (rate(a_bucket[5m]))) < 0.5") == {"a_bucket"}


def test_every_dashboard_is_there() -> None:
    names = {path.stem for path in DASHBOARDS}
    assert {"fleet-overview", "pool", "tenant", "policy"} <= names


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_uses_exported_metrics(path: Path) -> None:
    board = json.loads(path.read_text())
    exported = exported_names()
    assert board["uid"] and board["title"] and board["panels"]
    seen = set()
    for where, expr in dashboard_exprs(board):
        names = metric_names(expr)
        assert names, f"{path.name}: {where}: no metric in {expr!r}"
        unknown = names - exported
        assert not unknown, f"{path.name}: {where}: not exported by the gateway: {sorted(unknown)}"
        seen |= names
    assert any(name.startswith("orchid_") for name in seen)


def test_alert_rules_use_exported_metrics() -> None:
    exported = exported_names()
    rules = [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    alerts = {rule["alert"] for rule in rules}
    assert {
        "OrchidLadderRejecting",
        "OrchidPolicyFailOpen",
        "OrchidQuotaExhaustion",
        "OrchidBackendNotReady",
        "OrchidPredictionDrift",
    } <= alerts
    for rule in rules:
        names = metric_names(rule["expr"])
        assert names and names <= exported, (rule["alert"], sorted(names - exported))


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian 'prometheus') not installed")
def test_promtool_accepts_the_alert_rules() -> None:
    result = subprocess.run(
        ["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
