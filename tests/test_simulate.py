"""``orchid-gateway simulate``: the production runtime over in-memory backends, in virtual time.

Every figure the tests check is computed from the simulation's JSON output (the arrivals it
priced, the envelope it declares), never from the seed's printed constants.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchid_tools.capacity import load_workload
from orchid_tools.cli import main
from orchid_tools.simulate import render_json, simulate
from tests.conftest import ROOT

SCENARIOS = ROOT / "examples" / "orchid" / "simulate"
SEED_SURGE = SCENARIOS / "seed-surge.yaml"
NOISY = SCENARIOS / "noisy-neighbour.yaml"
GATEWAY = ROOT / "examples" / "orchid" / "gateway.yaml"


def small(tmp_path: Path, **changes: Any) -> Path:
    """A small scenario (4 devices, a few seconds): fast enough to run several times."""
    scenario: dict[str, Any] = {
        "gateway": str(GATEWAY),
        "tenants_file": str(ROOT / "examples" / "orchid" / "tenants.yaml"),
        "seed": 3,
        "fleet": [
            {
                "name": "pool",
                "cell": "eu-restricted",
                "devices": 4,
                "shared_devices": True,
                "models": {"full-v18": {}, "compact-v11": {}},
            }
        ],
        "arrivals": {
            "short": {
                "tenant": "orchid",
                "model": "full-v18",
                "class": "interactive",
                "rate_per_s": 30,
                "input_tokens": 256,
                "output_tokens": 64,
                "deadline_ms": 200,
            },
            "long": {
                "tenant": "orchid",
                "model": "full-v18",
                "class": "interactive",
                "rate_per_s": 2,
                "input_tokens": 4096,
                "output_tokens": 128,
                "deadline_ms": 1000,
            },
        },
        "phases": [{"name": "one", "duration_s": 3}, {"name": "two", "duration_s": 3, "multiplier": 1.5}],
    }
    scenario.update(changes)
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(scenario, sort_keys=False))
    return path


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["simulate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def seed_run() -> dict[str, Any]:
    return simulate(SEED_SURGE)


def test_seed_surge_reproduces_the_seed_figures_from_its_own_arrivals(seed_run: dict[str, Any]) -> None:
    envelope = seed_run["envelope"]
    assert envelope["devices"] == 24
    protected = envelope["protected_ms_per_s"]
    normal, surge, recover = seed_run["phases"]
    assert [p["name"] for p in seed_run["phases"]] == ["normal", "surge", "recover"]
    # Offered demand as the arrivals priced it, over devices x protected utilization x 1000 ms/s.
    assert round(100 * normal["totals"]["offered_ms_per_s"] / protected, 2) == 97.43
    assert round(100 * surge["totals"]["offered_ms_per_s"] / protected, 2) == 121.79
    assert round(100 * recover["totals"]["offered_ms_per_s"] / protected, 2) == 97.43
    assert normal["offered_pct_of_protected"] == 97.43
    assert surge["offered_pct_of_protected"] == 121.79
    # The modeled fallback saving at the surge, with the workload file's fallback shares and the
    # routes' compact costs as the run priced them.
    shares = load_workload(ROOT / "examples" / "orchid" / "workload.yaml").overload.fallback_share
    saving = sum(
        shares[name] * surge["classes"][name]["offered_per_s"] * (c["primary_ms"] - c["fallback_ms"])
        for name, c in seed_run["classes"].items()
    )
    assert round(saving, 1) == 5173.5
    assert round(surge["totals"]["offered_ms_per_s"] - saving, 1) == 15287.5


def test_seed_surge_keeps_normal_load_at_step_zero_and_serves_on_time(seed_run: dict[str, Any]) -> None:
    normal, surge, recover = seed_run["phases"]
    assert all(v["max_step"] == 0 for v in normal["ladder"].values())
    assert max(v["max_step"] for v in surge["ladder"].values()) >= 1  # the surge is certain
    for phase in (normal, surge, recover):
        assert phase["totals"]["on_time_pct"] >= 99.0, phase["totals"]
    ladder = seed_run["timeline"]["ladder_max_step"]["fleet-a/full-v18"]
    assert len(ladder) == 60 and ladder[-1] == 0  # back to step 0 by the end of the recovery
    assert seed_run["policy"]["label"] == "orchid-default-2"


@pytest.mark.slow
def test_seed_surge_json_is_byte_identical_for_the_same_seed(
    seed_run: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = cli(capsys, str(SEED_SURGE), "--json")
    assert code == 0
    assert out == render_json(seed_run)


def test_same_seed_same_bytes_and_another_seed_other_arrivals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = small(tmp_path)
    first = cli(capsys, str(path), "--json")
    again = cli(capsys, str(path), "--json")
    other = cli(capsys, str(path), "--json", "--seed", "4")
    assert first[0] == again[0] == other[0] == 0
    assert first[1] == again[1]
    assert '"request_id"' not in first[1] and "orchid.request_id" not in first[1]
    a, b = json.loads(first[1]), json.loads(other[1])
    assert b["seed"] == 4
    offered = [[c["offered"] for c in p["classes"].values()] for p in a["phases"]]
    assert offered != [[c["offered"] for c in p["classes"].values()] for p in b["phases"]]
    assert a["timeline"]["tenants"] != b["timeline"]["tenants"]


def test_deterministic_spacing_gives_exact_counts(tmp_path: Path) -> None:
    path = small(tmp_path)
    scenario = yaml.safe_load(path.read_text())
    for spec in scenario["arrivals"].values():
        spec["arrivals"] = "deterministic"
    path.write_text(yaml.safe_dump(scenario))
    document = simulate(path)
    one, two = document["phases"]
    assert (one["classes"]["short"]["offered"], one["classes"]["long"]["offered"]) == (90, 6)
    assert (two["classes"]["short"]["offered"], two["classes"]["long"]["offered"]) == (135, 9)


def test_the_noisy_neighbour_costs_the_in_share_tenant_nothing() -> None:
    document = simulate(NOISY)
    flood = next(p for p in document["phases"] if p["name"] == "flood")
    orchid, lumen = flood["tenants"]["orchid"], flood["tenants"]["lumen"]
    assert orchid["on_time_pct"] >= 95.0, orchid
    assert lumen["offered_ms_per_s"] > 2.5 * document["envelope"]["raw_ms_per_s"]
    refused = lumen["rejected_early"] + lumen["rejected_late"]
    assert refused > lumen["offered"] / 2  # 2.75x raw capacity cannot all run
    assert lumen["rejected_early"] >= 0.9 * refused  # early, for its own excess
    for phase in document["phases"]:
        assert phase["tenants"]["orchid"]["on_time_pct"] >= 95.0, phase["name"]


def test_compare_policies_runs_the_same_arrivals_against_a_modified_copy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    candidate = tmp_path / "policies"
    shutil.copytree(ROOT / "policies", candidate)
    # The what-if: refuse long inputs whatever the load (the fallback has the same input).
    (candidate / "50-what-if.yaml").write_text(
        "rules:\n"
        "  - id: what-if-no-long-inputs\n"
        "    stage: admission\n"
        "    condition: shape.input_tokens > 2048\n"
        "    action:\n"
        "      deny: {status: RESOURCE_EXHAUSTED}\n"
        "    message: \"'long inputs are not served'\"\n"
    )
    path = small(tmp_path)
    code, out, _ = cli(capsys, str(path), "--compare-policies", str(candidate))
    assert code == 0
    assert "Policy comparison" in out and "rejected early 0.0 -> 100.0%" in out
    code, raw, _ = cli(capsys, str(path), "--compare-policies", str(candidate), "--json")
    assert code == 0
    document = json.loads(raw)
    assert document["baseline"]["policy"]["version"] != document["candidate"]["policy"]["version"]
    # The same arrivals in both runs.
    for before, after in zip(document["baseline"]["phases"], document["candidate"]["phases"], strict=True):
        assert before["totals"]["offered"] == after["totals"]["offered"]
        assert after["classes"]["long"]["rejected_early_pct"] == 100.0
        assert after["classes"]["long"]["refusals"]["rejected_early:what-if-no-long-inputs"] > 0
        delta = document["differences"][before["name"]]["class long"]
        assert delta["rejected_early_pct"] == 100.0
        assert delta["on_time_pct"] == -before["classes"]["long"]["on_time_pct"]


def test_a_lost_device_group_fails_its_work_and_the_rest_carries_on(tmp_path: Path) -> None:
    fleet = [
        {
            "name": name,
            "cell": "eu-restricted",
            "devices": 2,
            "shared_devices": True,
            "models": {"full-v18": {}},
        }
        for name in ("group-a", "group-b")
    ]
    path = small(
        tmp_path,
        fleet=fleet,
        faults=[
            {"kind": "device_group_lost", "backend": "group-a", "at_s": 2.5, "until_s": 4.5},
            {"kind": "underprediction", "model": "full-v18", "factor": 3.0, "at_s": 5.0},
        ],
        phases=[
            {"name": "p", "duration_s": 2.5},
            {"name": "lost", "duration_s": 2.5},
            {"name": "slow", "duration_s": 2},
        ],
    )
    document = simulate(path)
    before, lost, slow = document["phases"]
    assert [f["kind"] for f in document["faults"]] == ["device_group_lost", "underprediction"]
    assert document["faults"][1]["longer_than_tokens"] == 1024  # the route's long bucket
    # Requests running on the lost group at 2.5 s fail (the devices' time with them) ...
    failed_and_wasted = before["totals"]["wasted_device_ms"] + lost["totals"]["wasted_device_ms"]
    assert before["totals"]["failed"] + lost["totals"]["failed"] > 0
    assert failed_and_wasted > 0
    # ... and the ladder of the lost pool shows it (no healthy capacity: step 6).
    assert lost["ladder"]["group-a/full-v18"]["max_step"] == 6
    assert lost["totals"]["on_time"] > 0  # group-b carries on
    # Long requests that take 3x their price miss or are refused late; short ones do not.
    assert slow["classes"]["short"]["on_time_pct"] > slow["classes"]["long"]["on_time_pct"]


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "run.png"
    code, out, _ = cli(capsys, str(small(tmp_path)), "--plot", str(target))
    assert code == 0 and "Ladder step" in out
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _edit(text: str, old: str, new: str) -> tuple[str, str]:
    """``text`` with the first ``old`` replaced, and ``:line:col`` where ``new`` starts."""
    at = text.index(old)
    line = text.count("\n", 0, at) + 1
    column = at - (text.rfind("\n", 0, at) + 1) + 1 + (len(new) - len(new.lstrip()))
    return text.replace(old, new, 1), f":{line}:{column}:"


@pytest.mark.parametrize(
    ("case", "problem"),
    [
        ("syntax", "YAML syntax error"),
        ("missing", "fleet: required field is missing"),
        ("unknown-field", "fleet.0.modelz: unknown field"),
        ("unknown-tenant", "arrivals.short.tenant: unknown tenant 'nobody'"),
        ("bad-setting", "settings.protected_utilization: Input should be less than or equal to 1"),
        ("bad-fault", "faults.0.backend: unknown backend 'nowhere'"),
        ("no-gateway", "no gateway config"),
    ],
)
def test_bad_scenarios_name_file_line_and_key_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, problem: str
) -> None:
    good = small(tmp_path).read_text()
    if case == "syntax":
        text, where = "fleet: [\n  {name: a\n", ":3:1:"
    elif case == "missing":
        text, where = "seed: 1\n", ":1:1:"
    elif case == "unknown-field":
        text, where = _edit(good, "  models:", "  modelz:")
    elif case == "unknown-tenant":
        text, where = _edit(good, "    tenant: orchid", "    tenant: nobody")
    elif case == "bad-setting":
        text, where = _edit(good, "seed: 3", "settings: {protected_utilization: 2}\nseed: 3")
        where = ":3:12:"
    elif case == "bad-fault":
        text = good + "faults:\n- {kind: device_group_lost, backend: nowhere, at_s: 1}\n"
        where = f":{good.count(chr(10)) + 2}:"
    else:
        text = "\n".join(line for line in good.splitlines() if not line.startswith("gateway:"))
        where = ":"
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    code, out, err = cli(capsys, str(path))
    assert code == 2 and out == ""
    assert f"{path}{where}" in err and problem in err, err


def test_a_missing_scenario_or_policy_directory_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(capsys, str(tmp_path / "absent.yaml"))
    assert code == 2 and "cannot read file" in err
    code, _, err = cli(capsys, str(small(tmp_path)), "--compare-policies", str(tmp_path / "nowhere"))
    assert code == 2 and "nowhere" in err
    broken = tmp_path / "broken-policies"
    shutil.copytree(ROOT / "policies", broken)
    (broken / "20-admission.yaml").write_text(
        "rules:\n  - id: x\n    stage: admission\n    condition: nope(\n"
    )
    code, _, err = cli(capsys, str(small(tmp_path)), "--policies", str(broken))
    assert code == 2 and "20-admission.yaml" in err
