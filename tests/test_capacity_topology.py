"""The worksheet's "Parallel topology" section (``orchid-gateway capacity --gateway CONFIG``) for
the example topology (examples/orchid/topology/gateway.yaml): every figure hand-derived here from
the route profiles (routes/orchid.yaml) and the backend's declarations, the arithmetic in comments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import load_gateway_config, load_routes
from orchid_tools.capacity import (
    backend_topologies,
    compute_worksheet,
    load_workload,
    topology_section,
    with_gateway,
)
from orchid_tools.cli import main
from tests.conftest import ROOT

WORKLOAD = ROOT / "examples" / "orchid" / "workload.yaml"
TOPOLOGY = ROOT / "examples" / "orchid" / "topology" / "gateway.yaml"
PLAIN = ROOT / "examples" / "orchid" / "gateway.yaml"
GIB = 1024**3

# The local backend (examples/orchid/topology/gateway.yaml): 4 devices of 80 GiB, 6 GiB reserve;
# every route has no `backends`, so every route's backend model it loads is on it (its
# load_models: the repository's chat-v1 is not loaded there).
# Resident on each device (weights_bytes; no workspace declared), each model's share / its width:
#   full-v18 28e9 / 1 + compact-v11 7e9 / 1 + full-v18-tp2 28e9 / 2 + full-v18-stream 28e9 / 1
#   (profile full-v18) + ranker-v3 0.5e9 / 1 = 77.5e9 B
RESIDENT = 28_000_000_000 + 7_000_000_000 + 14_000_000_000 + 28_000_000_000 + 500_000_000
ROOM = 80 * GIB - 6 * GIB - RESIDENT  # 79,456,894,976 - 77.5e9 = 1,956,894,976 B (1.82 GiB)


def _loadable(tmp_path: Path) -> Path:
    """The example topology config, its paths made absolute, with the example stack's feature
    source if it declares none (routes/orchid.yaml's ranker reads `feast`: serve refuses it without)."""
    data: dict[str, Any] = yaml.safe_load(TOPOLOGY.read_text())
    plain: dict[str, Any] = yaml.safe_load(PLAIN.read_text())
    base = TOPOLOGY.parent
    for key in ("tenants_file", "routes_dir", "policies_dir"):
        data[key] = str((base / data[key]).resolve())
    data["local_triton"]["model_repository"] = str(
        (base / data["local_triton"]["model_repository"]).resolve()
    )
    if "feature_sources" not in data:
        source = dict(plain["feature_sources"]["feast"])
        for key in ("registry", "repo"):
            if key in source:
                source[key] = str((PLAIN.parent / source[key]).resolve())
        data["feature_sources"] = {"feast": source}
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _section() -> Any:
    config = load_gateway_config(TOPOLOGY)
    routes = load_routes(config.routes_dir)
    return config, routes


def test_units_are_planned_inside_the_link_groups() -> None:
    config, routes = _section()
    (local,) = backend_topologies(config, routes)
    assert local.backend == "local" and local.devices == 4
    units = {m.model: [u.devices for u in m.units] for m in local.models}
    assert units["full-v18-tp2"] == [(0, 1), (2, 3)]  # one pair per NVLink island
    assert units["full-v18"] == [(0,), (1,), (2,), (3,)]  # no layout: one device per unit
    assert units["compact-v11"] == [(0,), (1,), (2,), (3,)]


def test_the_section_reproduces_by_computation() -> None:
    config, routes = _section()
    workload = load_workload(WORKLOAD)
    section = topology_section(config, routes, workload)
    assert section is not None and section.title == "Parallel topology"
    figures = {f.key: f for f in section.figures}

    def value(key: str) -> float:
        v = figures[key].value
        assert v is not None, figures[key].explanation
        return v

    key = "topology.local"
    assert value(f"{key}.devices") == 4
    assert value(f"{key}.domains.host") == 2 and value(f"{key}.domains.rack") == 1
    assert value(f"{key}.links") == 2
    assert value(f"{key}.full-v18-tp2.width") == 2
    assert value(f"{key}.full-v18-tp2.units") == 2
    assert "u0 [0, 1]; u1 [2, 3]" in figures[f"{key}.full-v18-tp2.units"].explanation
    assert "devices 2, 3" in figures[f"{key}.full-v18-tp2.u1"].explanation
    assert "host host-b" in figures[f"{key}.full-v18-tp2.u1"].explanation
    assert value(f"{key}.full-v18.width") == 1 and value(f"{key}.full-v18.units") == 4

    # Memory: the TP-2 model's 28e9 B of weights over its pair: 14e9 B on each device.
    assert value(f"{key}.full-v18-tp2.resident_per_device") == 14e9
    assert value(f"{key}.full-v18.resident_per_device") == 28e9
    assert value(f"{key}.resident_per_device") == RESIDENT == 77_500_000_000
    assert value(f"{key}.live_room_per_device") == ROOM == 1_956_894_976
    # Live tokens per unit: floor(room x width / 131,072 B per token).
    assert value(f"{key}.full-v18-tp2.live_tokens_per_unit") == (ROOM * 2) // 131072 == 29_859
    assert value(f"{key}.full-v18.live_tokens_per_unit") == ROOM // 131072 == 14_929

    # Execution of the workload's short shape (256 in / 64 out) on a pair: the profile gives the
    # pair's wall time, 2.42 + 256 x 0.055 + 64 x 0.2303 = 2.42 + 14.08 + 14.7392 = 31.2392 ms;
    # accelerator-ms are both devices': 62.4784.
    wall = 2.42 + 256 * 0.055 + 64 * 0.2303
    assert value(f"{key}.full-v18-tp2.short.wall_ms") == pytest.approx(wall)
    assert value(f"{key}.full-v18-tp2.short.accelerator_ms") == pytest.approx(2 * wall)
    assert value(f"{key}.full-v18-tp2.short.unit_rps") == pytest.approx(1000 / wall)  # ~32.0
    assert value(f"{key}.full-v18-tp2.short.pool_rps") == pytest.approx(2 * 1000 / wall)
    # full-v18 alone: 4.4 + 25.6 + 26.8 = 56.8 ms on one device.
    assert value(f"{key}.full-v18.short.accelerator_ms") == pytest.approx(56.8)
    assert f"{key}.full-v18-tp2.short.cadence_ms" not in figures  # one stage: no pipeline

    # The protected envelope: 4 devices of units x 1,000 x 0.70 = 2,800 accelerator-ms/s per pool.
    for model in ("full-v18-tp2", "full-v18", "compact-v11"):
        assert value(f"{key}.{model}.envelope") == pytest.approx(4 * 1000 * 0.70)
    assert value(f"{key}.full-v18-tp2.short.envelope_rps") == pytest.approx(2800 / (2 * wall))  # ~44.8

    # One domain loss: host-b (devices 2, 3) takes full-v18-tp2/u1 and full-v18's u2, u3.
    loss = f"{key}.loss.host.host-b"
    assert value(f"{loss}.devices") == 2
    assert value(f"{loss}.stranded") == 0  # the pairs are the hosts': no healthy half is stranded
    assert value(f"{loss}.full-v18-tp2.units_lost") == 1
    assert figures[f"{loss}.full-v18-tp2.units_lost"].explanation.startswith("u1;")
    assert value(f"{loss}.full-v18.units_lost") == 2
    # Envelope left: 2 devices of the units left x 1,000 x 0.70 = 1,400.
    assert value(f"{loss}.full-v18-tp2.envelope") == pytest.approx(1400)
    assert value(f"{loss}.full-v18.envelope") == pytest.approx(1400)
    # rack-1 holds every device: nothing is left.
    assert value(f"{key}.loss.rack.rack-1.full-v18-tp2.envelope") == 0
    # Cold load (the workload's device_group_loss: 5 GiB/s, warm-up 2 x short + 1 x long): each
    # returning device reloads its 77.5e9 B of shares, then the lost units' warm-ups run.
    warm_ms = 0.0
    for per_ms, fixed, prefill, decode in (
        (1, 4.4, 0.1, 0.41875),  # full-v18
        (1, 4.0, 0.05, 0.2375),  # compact-v11
        (1, 2.42, 0.055, 0.2303),  # full-v18-tp2: its wall time (the warm-up's latency)
        (1, 4.4, 0.1, 0.41875),  # full-v18-stream
        (1, 2.0, 0.02, 0.1),  # ranker-v3
    ):
        short = fixed + 256 * prefill + 64 * decode
        long = fixed + 4096 * prefill + 128 * decode
        warm_ms += per_ms * (2 * short + long)
    assert value(f"{loss}.cold_load_s") == pytest.approx(RESIDENT / GIB / 5 + warm_ms / 1000)


def test_without_a_load_time_the_cold_load_is_not_declared() -> None:
    config, routes = _section()
    section = topology_section(config, routes, None)
    assert section is not None
    figures = {f.key: f for f in section.figures}
    cold = figures["topology.local.loss.host.host-b.cold_load_s"]
    assert cold.value is None and "not declared" in cold.explanation
    assert figures["topology.local.full-v18-tp2.execution"].value is None  # no shape without a workload


def test_the_section_sits_after_scheduling_and_before_upstream(tmp_path: Path) -> None:
    workload = load_workload(WORKLOAD)
    sheet = with_gateway(compute_worksheet(workload), workload, _loadable(tmp_path))
    titles = [s.title for s in sheet.sections]
    at = titles.index("Parallel topology")
    assert titles[at - 1] == "Scheduling and batching"
    assert titles.index("Upstream/downstream") > at
    assert sheet.value("topology.local.loss.host.host-b.full-v18-tp2.envelope") == pytest.approx(1400)


def test_cli_prints_it_and_a_config_without_a_topology_prints_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _loadable(tmp_path)
    assert main(["capacity", str(WORKLOAD), "--gateway", str(config)]) == 0
    out = capsys.readouterr().out
    assert "Parallel topology" in out
    line = next(x for x in out.splitlines() if "full-v18-tp2: resident per device" in x)
    assert "14,000,000,000 B" in line
    assert main(["capacity", "--gateway", str(config), "--json"]) == 0  # no workload: the gateway's sections
    assert '"topology.local.full-v18-tp2.envelope"' in capsys.readouterr().out
    assert main(["capacity", str(WORKLOAD), "--gateway", str(PLAIN)]) == 0
    assert "Parallel topology" not in capsys.readouterr().out
    assert main(["capacity"]) == 2  # neither a workload nor a config
