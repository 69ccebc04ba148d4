"""``seed-10x.yaml``: the simulator at ten times the seed (issue 31 item 6).

The full scenario (106,650 requests) takes about 90 s on a 2-core machine: the suite does not run
it (`orchid-gateway simulate examples/orchid/simulate/seed-10x.yaml --check` does: 13 of 13
expectations). Its determinism is checked here on the same scenario with its phases cut to a
twentieth of their length (same fleet, rates, surge shape and seed). No assertion reads the wall
time's value.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchid_tools.cli import main
from orchid_tools.simulate import load_scenario
from tests.conftest import ROOT

SCENARIOS = ROOT / "examples" / "orchid" / "simulate"
SEED_SURGE = SCENARIOS / "seed-surge.yaml"
SEED_10X = SCENARIOS / "seed-10x.yaml"


def shortened(tmp_path: Path, fraction: float) -> Path:
    """``seed-10x.yaml`` with every phase ``fraction`` of its length (its expectations dropped:
    they are the full run's)."""
    data: dict[str, Any] = yaml.safe_load(SEED_10X.read_text())
    data["gateway"] = str((SCENARIOS / data["gateway"]).resolve())
    for phase in data["phases"]:
        phase["duration_s"] = phase["duration_s"] * fraction
    data.pop("expect", None)
    path = tmp_path / "seed-10x-short.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_seed_10x_is_ten_copies_of_the_seeds_fleet_at_ten_times_its_traffic() -> None:
    seed, _ = load_scenario(SEED_SURGE)
    big, _ = load_scenario(SEED_10X)
    assert len(big.fleet) == 10
    assert sum(b.devices for b in big.fleet) == 240 == 10 * sum(b.devices for b in seed.fleet)
    (group,) = seed.fleet
    for backend in big.fleet:
        assert backend.devices == group.devices
        assert backend.shared_devices == group.shared_devices
        assert backend.max_inflight_per_device == group.max_inflight_per_device
        assert backend.models.keys() == group.models.keys()
    assert {n: a.rate_per_s for n, a in big.arrivals.items()} == {"short": 1400, "long": 180}
    for name, arrival in seed.arrivals.items():
        assert big.arrivals[name].rate_per_s == 10 * (arrival.rate_per_s or 0)
        assert big.arrivals[name].deadline_ms == arrival.deadline_ms
        assert big.arrivals[name].arrivals == arrival.arrivals == "deterministic"
    assert [(p.name, p.duration_s, p.multiplier) for p in big.phases] == [
        (p.name, p.duration_s, p.multiplier) for p in seed.phases
    ]
    assert big.expect, "the ten-times scenario carries expectations"


def test_seed_10x_shortened_is_deterministic_and_reports_its_wall_time_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = shortened(tmp_path, 0.05)
    outputs = []
    for _ in range(2):
        code = main(["simulate", str(path), "--json"])
        out, err = capsys.readouterr()
        assert code == 0
        outputs.append(out)
        # The wall time goes to stderr only, as one JSON object: never into the report.
        timing = json.loads(err.strip().splitlines()[-1])
        assert set(timing) == {"wall_s"} and timing["wall_s"] >= 0
    assert outputs[0] == outputs[1]
    assert "wall_s" not in outputs[0]
    document = json.loads(outputs[0])
    assert document["envelope"]["devices"] == 240
    normal, surge, recover = (p["offered_pct_of_protected"] for p in document["phases"])
    assert normal == recover == 97.43
    assert 121.5 < surge <= 121.79  # 1.5 s of the surge: 337 of 337.5 long arrivals
    assert [p["classes"]["short"]["offered"] for p in document["phases"]] == [1400, 2625, 700]
