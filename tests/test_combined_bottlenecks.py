"""The seed's combined bottlenecks (issue 25, build item 3): each a shipped simulator scenario
(``examples/orchid/simulate/combined-*.yaml``) whose ``expect:`` section the simulator checks,
with the figures that tie it to the capacity worksheet (``combination.*``) checked here from
the fixture, never copied from the seed; plus the simulator features they need: a device
group that comes back cold, models loaded through the emulated repository API, a slow
upstream stage, and the expectations themselves.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml
from tritonclient.grpc import service_pb2

from gateway.backends.memory import MemoryBackend, MemoryModel
from gateway.backends.triton import ModelControlError
from gateway.core.errors import ConfigError, Unavailable
from gateway.core.profile import DemandProfile
from orchid_tools.capacity import compute_worksheet, load_workload
from orchid_tools.cli import main
from orchid_tools.simulate import Scenario, check_expectations, load_scenario, simulate
from orchid_tools.virtual_time import VirtualTimeLoop
from tests.conftest import ROOT

SCENARIOS = ROOT / "examples" / "orchid" / "simulate"
WORKLOAD = ROOT / "examples" / "orchid" / "workload.yaml"
COMBINED = {
    "shadow": SCENARIOS / "combined-shadow.yaml",
    "rollout": SCENARIOS / "combined-rollout-long.yaml",
    "cold": SCENARIOS / "combined-group-loss-cold.yaml",
    "surge": SCENARIOS / "combined-surge-fallback.yaml",
    "upstream": SCENARIOS / "combined-upstream-dwell.yaml",
}


@pytest.fixture(scope="module")
def sheet() -> Any:
    return compute_worksheet(load_workload(WORKLOAD))


def failed(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in document["expectations"] if not e["held"]]


# --------------------------------------------------------------------------- the scenarios


def run_checked(name: str) -> dict[str, Any]:
    document = simulate(COMBINED[name])
    assert document["expectations"], "a combined scenario must state what the fleet must hold"
    assert document["expectations_held"], failed(document)
    return document


def test_normal_traffic_plus_shadow_holds(sheet: Any) -> None:
    document = run_checked("shadow")
    normal = document["phases"][0]
    # The same traffic the worksheet prices, at a third of the fleet.
    fleet_share = document["envelope"]["devices"] / sheet.value("execution.fleet")
    assert normal["offered_pct_of_protected"] == pytest.approx(
        sheet.value("execution.protected_pct"), abs=0.1
    )
    assert (
        normal["totals"]["shadow_device_ms_per_s"] <= sheet.value("combination.shadow.demand") * fleet_share
    )


@pytest.mark.slow
def test_version_overlap_plus_long_sequences_during_a_rollout_holds() -> None:
    document = run_checked("rollout")
    (rollout,) = document["rollouts"]
    assert rollout["phase"] == "complete", rollout.get("reason")
    assert rollout["promoted_at_s"] is not None
    overlap = next(p for p in document["phases"] if p["name"] == "overlap")
    assert set(overlap["ladder"]) == {"fleet-a/full-v18", "fleet-a/full-v19"}  # both versions serve


@pytest.mark.slow
def test_device_group_loss_plus_cold_load_holds(sheet: Any) -> None:
    document = run_checked("cold")
    (fault,) = document["faults"]
    back = fault["until_s"]
    for model, ready in fault["ready_at_s"].items():
        assert ready == pytest.approx(back + sheet.value(f"combination.cold_load.{model}"), abs=1e-3)


@pytest.mark.slow
def test_surge_plus_fallback_holds(sheet: Any) -> None:
    document = run_checked("surge")
    surge = next(p for p in document["phases"] if p["name"] == "surge")
    assert surge["offered_pct_of_protected"] == pytest.approx(sheet.value("overload.surge_pct"), abs=0.1)


@pytest.mark.slow
def test_feature_latency_plus_batch_dwell_holds() -> None:
    document = run_checked("upstream")
    slow = next(p for p in document["phases"] if p["name"] == "slow-80ms")
    assert slow["classes"]["short"]["rejected_late"] == slow["classes"]["short"]["missed"] == 0


# --------------------------------------------------------------------------- tied to the worksheet


def scenario(name: str) -> Scenario:
    return load_scenario(COMBINED[name])[0]


def bound(s: Scenario, phase: str, figure: str, kind: str = "max") -> float:
    return float(
        next(getattr(e, kind)[figure] for e in s.expect if e.phase == phase and figure in getattr(e, kind))
    )


def test_cold_load_times_are_the_worksheets(sheet: Any) -> None:
    """Each fleet model's load_s in the loss and rollout scenarios is the worksheet's cold
    load: weights over the declared bandwidth plus the rollout's warm-up shapes."""
    for name in ("cold", "rollout"):
        for backend in scenario(name).fleet:
            for model, spec in backend.models.items():
                if spec.load_s:
                    as_model = spec.profile or model
                    assert spec.load_s == pytest.approx(
                        sheet.value(f"combination.cold_load.{as_model}"), abs=5e-4
                    ), (name, model)
    rollout = yaml.safe_load((ROOT / "rollouts" / "full-v19.yaml").read_text())
    declared = load_workload(WORKLOAD).combinations
    assert declared is not None and declared.device_group_loss is not None
    assert [(s.input_tokens, s.output_tokens, s.repeat) for s in declared.device_group_loss.warmup] == [
        (s["input_tokens"], s["output_tokens"], s.get("repeat", 1)) for s in rollout["warmup"]["shapes"]
    ]


def test_scenario_bounds_are_the_worksheets(sheet: Any) -> None:
    shadow = scenario("shadow")
    share = sum(b.devices for b in shadow.fleet) / sheet.value("execution.fleet")
    modeled = sheet.value("combination.shadow.demand") * share
    assert bound(shadow, "normal", "shadow_device_ms_per_s") == pytest.approx(modeled, abs=0.01)
    assert bound(shadow, "normal", "shadow_device_ms_per_s", "min") == pytest.approx(modeled / 2, abs=0.01)
    surge = scenario("surge")
    for phase in ("surge", "peak"):
        assert bound(surge, phase, "degraded_pct") == pytest.approx(
            sheet.value("combination.surge_fallback.fallback_request_pct"), abs=0.005
        )
    upstream = scenario("upstream")
    workload = load_workload(WORKLOAD)
    assert workload.deadline is not None and workload.combinations is not None
    assert upstream.arrivals["short"].upstream_ms == workload.deadline.elapsed_ms
    dwell = workload.combinations.upstream_dwell
    assert dwell is not None
    extras = sorted(f.extra_ms for f in upstream.faults if f.extra_ms is not None)
    assert extras == sorted(dwell.extra_ms)
    # The worksheet's verdicts the expectations encode: +40 ms keeps the dwell cap, +80 ms
    # leaves no slack on full-v18 but some on compact-v11.
    assert sheet.value("combination.upstream_dwell.slack_ms.40ms") >= dwell.dwell_cap_ms
    assert sheet.value("combination.upstream_dwell.slack_ms.80ms") < 0
    assert sheet.value("combination.upstream_dwell.fallback_slack_ms.80ms") >= 0


def test_worksheet_combinations_from_the_fixture(sheet: Any) -> None:
    """The combination figures follow from the fixture's own figures."""
    offered = sheet.value("execution.offered_demand")
    per_device = sheet.value("execution.per_device")
    fleet = sheet.value("execution.fleet")
    assert sheet.value("combination.shadow.demand") == pytest.approx(0.05 * offered)
    assert sheet.value("combination.shadow.protected_pct") == pytest.approx(
        105 * offered / (fleet * per_device), abs=1e-9
    )
    surviving = sheet.value("combination.device_group_loss.surviving_devices")
    assert surviving == fleet * 2 / 3
    assert sheet.value("combination.device_group_loss.protected_pct") == pytest.approx(
        100 * offered / (surviving * per_device)
    )
    weights = sheet.value("memory.full-v18.weights_gib")
    compact = sheet.value("memory.compact-v11.weights_gib")
    assert sheet.value("combination.version_overlap.resident_gib") == pytest.approx(
        2 * weights + compact, abs=0.01
    )
    slack = sheet.value("scheduling.max_batch_wait_ms")
    assert sheet.value("combination.upstream_dwell.slack_ms.80ms") == pytest.approx(slack - 80)
    assert sheet.value("combination.surge_fallback.raw_pct") == pytest.approx(
        sheet.value("overload.surge_demand") / (fleet * 1000) * 100
    )


def test_a_rollout_whose_two_versions_do_not_fit_is_refused_and_the_route_keeps_serving(
    tmp_path: Path,
) -> None:
    """On 64 GiB devices full-v18, compact-v11 and full-v19 leave no live room: the gateway
    refuses the rollout (its two-version memory check, as `rollout start` would answer), the
    report says why, and the current version serves on."""
    data = yaml.safe_load(COMBINED["rollout"].read_text())
    data["gateway"] = str(SCENARIOS / data["gateway"])
    data["fleet"][0]["device_memory_gib"] = 64
    data["phases"] = [{"name": "only", "duration_s": 2, "multiplier": 0.5}]
    data["rollouts"] = [{"file": str(ROOT / "rollouts" / "full-v19.yaml"), "at_s": 0.5}]
    data.pop("expect")
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    document = simulate(path)
    (rollout,) = document["rollouts"]
    assert "do not both fit" in rollout["refused"]
    (only,) = document["phases"]
    assert only["totals"]["canary"] == 0 and only["totals"]["on_time_pct"] == 100.0


# --------------------------------------------------------------------------- a broken variant fails


@pytest.mark.slow
def test_cold_group_expectation_fails_when_the_gateway_may_route_to_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """If a loading model answered the gateway's readiness path (its spec) as ready while still
    refusing work, the gateway would route to the cold group: the cold phase's ``failed``
    expectation catches it."""
    real = MemoryBackend.model_spec

    async def spec_while_loading(self: MemoryBackend, model: str, *, logical: str) -> Any:
        state = self._models[model]
        saved, state.state = state.state, "READY"
        try:
            return await real(self, model, logical=logical)
        finally:
            state.state = saved

    monkeypatch.setattr(MemoryBackend, "model_spec", spec_while_loading)
    document = simulate(COMBINED["cold"])
    broken = {(e["phase"], e["figure"]) for e in failed(document)}
    assert ("cold", "failed_pct") in broken


@pytest.mark.slow
def test_shadow_expectation_fails_when_shadow_ignores_the_ladder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shadow that kept running at step 1 (the seed's first ladder action) fails the
    surge-held phase's bound."""
    import gateway.shadow
    from gateway.core.overload import effects

    monkeypatch.setattr(gateway.shadow, "overload_effects", lambda step: effects(0))
    document = simulate(COMBINED["shadow"])
    assert ("surge-held", "shadow_device_ms_per_s") in {(e["phase"], e["figure"]) for e in failed(document)}


@pytest.mark.slow
def test_surge_expectation_fails_without_a_warm_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fallback that is never warm cannot carry the peak's excess: its expectations fail."""
    real = MemoryBackend.is_warm
    monkeypatch.setattr(MemoryBackend, "is_warm", lambda self, m: m != "compact-v11" and real(self, m))
    document = simulate(COMBINED["surge"])
    assert ("peak", "fallback_saving_ms_per_s") in {(e["phase"], e["figure"]) for e in failed(document)}


@pytest.mark.slow
def test_rollout_expectation_fails_when_the_candidate_cannot_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """A candidate whose load fails is rolled back before it serves: no overlap, and the
    overlap phase's canary bound fails."""

    async def refuse(self: MemoryBackend, model: str, *, timeout_s: float) -> None:
        raise ModelControlError(f"loading {model!r} failed: out of memory")

    monkeypatch.setattr(MemoryBackend, "load_model", refuse)
    document = simulate(COMBINED["rollout"])
    assert document["rollouts"][0]["phase"] == "rolled_back"
    assert ("overlap", "canary_pct") in {(e["phase"], e["figure"]) for e in failed(document)}


@pytest.mark.slow
def test_upstream_expectation_fails_when_the_gateway_ignores_the_callers_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gateway that judged a request by its class's full 200 ms instead of what upstream
    work left of the caller's deadline would run short requests on full-v18 with no slack
    left for its execution and failure reserves (the worksheet's -12 ms): the slow-80ms
    phase's short-class bound fails; the long class, whose deadline is untouched, holds."""
    from gateway.chain.resolve import Resolve

    real = Resolve.deadline_ms

    def at_least_the_class_default(call: Any, request_class: Any) -> float:
        return max(float(request_class.default_deadline_ms), real(call, request_class))

    monkeypatch.setattr(Resolve, "deadline_ms", staticmethod(at_least_the_class_default))
    document = simulate(COMBINED["upstream"])
    broken = {(e["phase"], e["scope"], e["figure"]) for e in failed(document)}
    assert ("slow-80ms", "class short", "degraded_pct") in broken
    assert not any(scope == "class long" for _, scope, _ in broken)


# --------------------------------------------------------------------------- the emulated backend


def model(name: str, load_s: float = 0.0, loaded: bool = True) -> MemoryModel:
    return MemoryModel(
        name=name,
        profile=DemandProfile(fixed_ms=1.0, prefill_ms_per_token=0.01, decode_ms_per_token=0.1),
        instances=1,
        load_s=load_s,
        loaded=loaded,
    )


def request(name: str) -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(model_name=name, id="1")
    tensor = req.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([1, 4])
    req.raw_input_contents.append(bytes(16))
    return req


def in_virtual_time(body: Any) -> Any:
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(body())
    finally:
        loop.close()


def test_a_group_restored_cold_serves_only_after_each_models_load() -> None:
    async def body() -> list[tuple[float, bool, bool]]:
        backend = MemoryBackend("g", [model("big", load_s=5.0), model("small", load_s=1.0)], devices=1)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        backend.set_healthy(False)
        backend.set_healthy(True, cold=True)
        assert backend.healthy  # the server answers: the models are what is not ready
        seen = []
        for at in (0.5, 1.5, 5.5):
            await asyncio.sleep(t0 + at - loop.time())
            seen.append((at, backend.is_warm("small"), backend.is_warm("big")))
            if not backend.is_warm("big"):
                assert not await backend.model_ready("big")
                with pytest.raises(Unavailable):
                    await backend.model_spec("big", logical="big")
                with pytest.raises(Unavailable):
                    await backend.infer(request("big"), timeout_s=1.0, logical="big")
        response = await backend.infer(request("big"), timeout_s=1.0, logical="big")
        assert response.model_name == "big"
        stats = await backend.statistics("big")
        assert stats.model_stats[0].inference_stats.success.count == 1  # counters started again
        await backend.close()
        return seen

    assert in_virtual_time(body) == [(0.5, False, False), (1.5, True, False), (5.5, True, True)]


def test_a_load_the_loss_interrupts_fails_and_starts_again_when_the_group_is_back() -> None:
    async def body() -> tuple[str, bool, bool]:
        backend = MemoryBackend("g", [model("cand", load_s=2.0, loaded=False)], devices=1)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        loading = loop.create_task(backend.load_model("cand", timeout_s=10.0))
        await asyncio.sleep(1.0)
        backend.set_healthy(False)
        with pytest.raises(ModelControlError) as caught:
            await loading
        backend.set_healthy(True)  # back warm: the interrupted load starts again
        await asyncio.sleep(t0 + 2.5 - loop.time())
        halfway = backend.is_warm("cand")
        await asyncio.sleep(t0 + 3.5 - loop.time())
        done = backend.is_warm("cand")
        await backend.close()
        return str(caught.value), halfway, done

    message, halfway, done = in_virtual_time(body)
    assert "lost while loading" in message
    assert (halfway, done) == (False, True)


def test_a_warm_restore_is_ready_at_once() -> None:
    async def body() -> bool:
        backend = MemoryBackend("g", [model("big", load_s=5.0)], devices=1)
        backend.set_healthy(False)
        backend.set_healthy(True)
        warm = backend.is_warm("big")
        await backend.close()
        return warm

    assert in_virtual_time(body)


def test_repository_load_and_unload() -> None:
    async def body() -> list[Any]:
        backend = MemoryBackend(
            "g",
            [model("cur"), model("cand", load_s=2.0, loaded=False), model("slow", load_s=3.0, loaded=False)],
            devices=1,
        )
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        out: list[Any] = [await backend.repository_index(), backend.is_warm("cand")]
        await backend.load_model("cand", timeout_s=10.0)
        out.append(round(loop.time() - t0, 6))
        out.append(backend.is_warm("cand"))
        await backend.unload_model("cur", timeout_s=10.0)
        out.append(await backend.repository_index())
        with pytest.raises(ModelControlError, match="not ready after"):
            await backend.load_model("slow", timeout_s=0.5)
        await backend.close()
        return out

    index, warm_before, took, warm_after, after = in_virtual_time(body)
    assert index == [("cand", "1", "UNAVAILABLE"), ("cur", "1", "READY"), ("slow", "1", "UNAVAILABLE")]
    assert (warm_before, took, warm_after) == (False, 2.0, True)
    assert after == [("cand", "1", "READY"), ("cur", "1", "UNAVAILABLE"), ("slow", "1", "UNAVAILABLE")]


# --------------------------------------------------------------------------- expectations


def phase(name: str, **totals: float) -> dict[str, Any]:
    return {"name": name, "totals": totals, "classes": {}, "tenants": {}, "ladder": {"p/m": {"max_step": 2}}}


def expect(entries: list[dict[str, Any]]) -> Scenario:
    base = yaml.safe_load(COMBINED["shadow"].read_text())
    base["expect"] = entries
    return Scenario.model_validate(base)


def test_expectations_hold_fail_and_compare_phases() -> None:
    document = {
        "phases": [
            phase("normal", degraded_pct=0.0, on_time_pct=100.0),
            phase("surge", degraded_pct=3.0, on_time_pct=99.0),
            phase("surge-held", degraded_pct=1.0, on_time_pct=98.0),
        ]
    }
    checked = check_expectations(
        expect(
            [
                {"phase": "surge", "min": {"on_time_pct": 99.0}, "max": {"degraded_pct": 2.5, "max_step": 2}},
                {"phase": "surge-held", "versus": "normal", "max_above": {"degraded_pct": 1.0}},
                {"phase": "surge-held", "versus": "normal", "max_above": {"max_step": 0}},
                {"phase": "surge", "scope": "class short", "max": {"missed_pct": 0}},
            ]
        ),
        document,
    )
    verdicts = [(e["phase"], e["figure"], e["held"]) for e in checked]
    assert verdicts == [
        ("surge", "on_time_pct", True),
        ("surge", "degraded_pct", False),
        ("surge", "max_step", True),
        ("surge-held", "degraded_pct", True),
        ("surge-held", "max_step", True),
        ("surge", "missed_pct", False),  # nothing to judge in that scope: it does not hold
    ]
    assert checked[3]["limit"] == 1.0 and checked[3]["versus"] == "normal"


def test_cli_check_exits_1_when_an_expectation_fails(tmp_path: Path) -> None:
    data = yaml.safe_load(COMBINED["shadow"].read_text())
    data["gateway"] = str(SCENARIOS / data["gateway"])
    data["phases"] = [{"name": "normal", "duration_s": 2}]
    data["expect"] = [{"phase": "normal", "min": {"on_time_pct": 100.5}}]
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["simulate", str(path)]) == 0
    assert main(["simulate", str(path), "--check"]) == 1


@pytest.mark.parametrize(
    ("change", "where", "problem"),
    [
        (
            {"faults": [{"kind": "device_group_lost", "backend": "fleet-a", "at_s": 1, "cold": True}]},
            "faults.0.cold",
            "until_s",
        ),
        ({"faults": [{"kind": "slow_upstream", "at_s": 1}]}, "faults.0.extra_ms", "extra_ms"),
        (
            {"faults": [{"kind": "device_group_lost", "backend": "fleet-a", "at_s": 1, "extra_ms": 5}]},
            "faults.0.extra_ms",
            "slow_upstream faults only",
        ),
        (
            {"expect": [{"phase": "normal", "pool": "p/m", "max": {"on_time_pct": 1}}]},
            "expect.0.pool",
            "max_step",
        ),
        ({"rollouts": [{"file": "x.yaml", "at_s": 99}]}, "rollouts.0.at_s", "after the last phase"),
        (
            {"expect": [{"phase": "normal", "max": {"on_tme_pct": 1}}]},
            "expect.0.max.on_tme_pct",
            "unknown figure",
        ),
        ({"expect": [{"phase": "nromal", "max": {"on_time_pct": 1}}]}, "expect.0.phase", "unknown phase"),
        ({"expect": [{"phase": "normal", "max_above": {"max_step": 0}}]}, "expect.0.versus", "versus"),
        (
            {
                "arrivals": {
                    "short": {
                        "tenant": "orchid",
                        "model": "full-v18",
                        "rate_per_s": 1,
                        "input_tokens": 8,
                        "upstream_ms": 5,
                    }
                }
            },
            "arrivals.short.upstream_ms",
            "deadline_ms",
        ),
    ],
)
def test_bad_new_keys_are_located(tmp_path: Path, change: dict[str, Any], where: str, problem: str) -> None:
    data = yaml.safe_load(COMBINED["shadow"].read_text())
    data.pop("expect")
    data.update(change)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ConfigError) as caught:
        load_scenario(path)
    assert where in str(caught.value) and problem in str(caught.value)


def test_a_slow_upstream_stage_spends_the_callers_deadline(tmp_path: Path) -> None:
    """+150 ms upstream on a 200 ms deadline leaves less than any execution: refused early,
    never sent to a device; the other class is untouched."""
    data = yaml.safe_load(COMBINED["upstream"].read_text())
    data["gateway"] = str(SCENARIOS / data["gateway"])
    data["phases"] = [{"name": "normal", "duration_s": 2}, {"name": "slow", "duration_s": 2}]
    data["faults"] = [{"kind": "slow_upstream", "arrivals": ["short"], "extra_ms": 150, "at_s": 2}]
    data.pop("expect")
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    document = simulate(path)
    normal, slow = document["phases"]
    assert normal["classes"]["short"]["on_time_pct"] == 100.0
    assert slow["classes"]["short"]["rejected_early_pct"] == 100.0
    assert slow["classes"]["short"]["wasted_device_ms"] == 0.0
    assert slow["classes"]["long"]["on_time_pct"] == 100.0
    assert document["faults"][0]["extra_ms"] == 150
