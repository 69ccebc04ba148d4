"""The worksheet's Upstream/downstream section (orchid_tools.capacity_features) for the example
gateway config: the ranker route's contract and its source, computed from the configuration."""

from __future__ import annotations

import pytest

from gateway.config import load_gateway_config, load_routes
from orchid_tools.capacity import compute_worksheet, load_workload, with_upstream
from orchid_tools.capacity_features import upstream_section
from orchid_tools.cli import main
from tests.conftest import ROOT

WORKLOAD = ROOT / "examples" / "orchid" / "workload.yaml"
GATEWAY = ROOT / "examples" / "orchid" / "gateway.yaml"


def test_the_upstream_section_names_the_ranker_route() -> None:
    workload = load_workload(WORKLOAD)
    sheet = with_upstream(compute_worksheet(workload), workload, GATEWAY)
    section = sheet.sections[-1]
    assert section.title == "Upstream/downstream"
    assert sheet.value("upstream.ranker.features") == 3
    assert "feast" in sheet.figure("upstream.ranker.features").explanation
    assert sheet.value("upstream.ranker.max_entities") == 16
    assert sheet.value("upstream.ranker.reserve_ms") == 20.0  # feast's budget_ms
    assert sheet.value("upstream.ranker.reads_per_1000") == 1000  # no workload class calls ranker
    assert sheet.value("upstream.ranker.cache_ttl_s") == 1.0  # min(1,000 ms, 21,600 s)
    assert sheet.value("upstream.ranker.max_concurrency") == 16
    keys = [f.key for f in section.figures]
    assert all(k.startswith("upstream.ranker.") for k in keys)
    assert "upstream.ranker.warning" not in keys


def test_cli_prints_it_and_leaves_the_rest_alone(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capacity", str(WORKLOAD)]) == 0
    plain = capsys.readouterr().out
    assert "Upstream/downstream" not in plain
    assert main(["capacity", str(WORKLOAD), "--gateway", str(GATEWAY)]) == 0
    out = capsys.readouterr().out
    assert "Upstream/downstream" in out
    line = next(x for x in out.splitlines() if "ranker: upstream reserve" in x)
    assert "20.0 ms" in line


def test_a_planned_rate_over_max_concurrency_warns() -> None:
    config = load_gateway_config(GATEWAY)
    routes = load_routes(config.routes_dir)
    budget_s = config.feature_sources["feast"].budget_ms / 1000.0
    slow = upstream_section(config, routes, {"ranker": 100.0})
    assert slow is not None
    inflight = {f.key: f.value for f in slow.figures}
    assert inflight["upstream.ranker.reads_per_s"] == 100.0
    assert inflight["upstream.ranker.inflight"] == pytest.approx(100.0 * budget_s)
    assert "upstream.ranker.warning" not in inflight  # 2 in flight, 16 allowed
    busy = upstream_section(config, routes, {"ranker": 2000.0})
    assert busy is not None
    figures = {f.key: f.value for f in busy.figures}
    assert figures["upstream.ranker.warning"] == pytest.approx(2000.0 * budget_s / 16)
