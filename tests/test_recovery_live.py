"""After a fault the fleet comes back, on real traffic (issue 25, build item 4).

Three real Tritons in one cell, each one device group: 8 emulated devices with
``compact-v11`` beside ``full-v18`` on the same device locks, at time factor 2.0 (a short
request holds a device 113.6 ms, a long one 935.2 ms), behind one gateway process. Two
tenants, orchid (weight 2) and lumen (weight 1), in the seed's short/long mix (Poisson, a
fixed seed), scaled to 95 % of the fleet's protected envelope: about 77 req/s. Phases: 3 s of
warm-up at half load; 10 s normal; a surge (orchid 1.25x, lumen 2x) during which group-a's
Triton is SIGKILLed 4 s in and started again 2 s later (the restart itself takes 10-70 s on a
loaded machine; the surge lasts until it has been back 4 s); then 30 s back at the normal
load, of which the last ``RECOVERED_S`` (10 s, from 20 s after the surge) is the recovered
window.

The recovery bound, asserted on outcomes (answers' provenance, the gateway's /metrics):

* the share of answers degraded *by the overload ladder* in the recovered window is at most 2
  points above the normal phase's, and
* no pool's ladder step there (``orchid_ladder_step``, scraped every 0.25 s) is above the
  highest step any pool had in the normal phase;

and, so that these mean something: the restarted Triton reads ready on /metrics throughout
the recovered window, the surge did climb the ladder, and the ladder refuses no larger share
than in the normal phase.

"Degraded by the ladder" (``Answer.degraded_by_ladder``): ``orchid.approximation`` other than
``none`` *and* a route reason the ladder gives (``fallback:overload``,
``fallback:primary_shed``, or output capped on the primary). The issue's bound counts every
degraded answer; here that would also count ``fallback:primary_infeasible`` answers, which a
CPU-starved machine causes at step 0 (on the shared 2-core machine this was written on, a
recovered window with every step at 0 and balanced placement still had 3-7 % of such
answers, in bursts where other work took the cores). Both shares are in the printed report,
with the route reasons. The bound is one-sided: a recovered window cleaner than the normal
phase is not a stuck state.

What the test catches (``gateway/core/placement.py`` describes the loop): before placement
ranked pools by offered demand, a pool at step 5-6 diverted its primaries, had no primary work
in flight, won ``bind_pool``'s tie-break, took 75-95 % of the fleet's offered primary demand
and held step 6 after the surge: at e7be0fb, in four runs of four, for 10-20 s in three and
for the whole 30 s in the fourth (89 % of the recovered window's answers degraded against
0.9 % in the normal phase); the report's timeline shows it. With the fix (ed8f824, and at
0d09090) each pool's share after the surge stayed at 33 +- 2 % and every step was back at 0
about 10 s after the surge (one run: briefly at 3 again at 15 s).

Scaled to a small shared machine: the gateway runs as its own process so that its CPU is
measured apart from the load generator's; the report gives the cores used per phase by the
gateway (0.34-0.55), the load generator (0.09-0.15), the Tritons (0.15-0.33) and the whole
machine, and the send lag (how late the open-loop client sent). Phases are seconds, not
minutes: the ladder's windows are wall-clock (its longest span is 10 s). The run itself is
about 80 s; with three Triton starts and the restart, 165-210 s on that loaded machine.
``ORCHID_RECOVERY_KEEP=DIR`` keeps the report and the gateway's log.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from gateway.backends.local import TritonStartError
from orchid_tools.harness import example_config, scaled_classes
from tests.conftest import EXAMPLE_CONFIG, LUMEN_KEY, ORCHID_KEY
from tests.multi_triton import (
    ArrivalClass,
    DeviceGroup,
    GatewayProcess,
    Phase,
    Run,
    drive,
    emulator_repository,
    group_cpu_s,
    machine_busy,
    start_all,
    stop_all,
    warm_instances,
)

GROUPS = ("group-a", "group-b", "group-c")
DEVICES = 8
TIME_FACTOR = 2.0
PROTECTED_UTILIZATION = 0.70
LOAD = 0.95  # of the fleet's protected envelope
SHORT = (256, 64)  # input, output tokens: 56.8 accelerator-ms at time factor 1
LONG = (4096, 128)  # 467.6
# The seed's mix (req/s on its 24 devices at time factor 1: 16,767 accelerator-ms/s).
SEED_MIX = {"orchid-short": 100.0, "orchid-long": 12.0, "lumen-short": 40.0, "lumen-long": 6.0}
SEED_MIX_MS = 100 * 56.8 + 12 * 467.6 + 40 * 56.8 + 6 * 467.6
SEED = 25

WARMUP_S = 3.0
NORMAL_S = 10.0
SURGE_S = 16.0  # at least; it lasts until the restarted Triton has served for SURGE_AFTER_RESTART_S
KILL_AT_S = 4.0  # into the surge
DOWN_S = 2.0  # from the kill to the restart's start (the restart itself takes 10-30 s here)
SURGE_AFTER_RESTART_S = 4.0
AFTER_S = 30.0  # back at the normal load
RECOVERED_S = 10.0  # the last part of it, where the bound is asserted
TOLERANCE_POINTS = 2.0
KILLED = "group-a"
# Refusals the overload ladder decides (its plan's shedding, step 4's deferral, step 6).
LADDER_RULES = ("overload-", "ladder.")
SETUP_STARTED = [0.0]  # when the fixture began (the report says how long the setup took)


def arrival_classes() -> list[ArrivalClass]:
    """The seed's mix scaled to LOAD of the fleet's protected envelope at this time factor."""
    protected = len(GROUPS) * DEVICES * PROTECTED_UTILIZATION * 1000.0
    scale = LOAD * protected / (SEED_MIX_MS * TIME_FACTOR)
    out = []
    for name, rate in SEED_MIX.items():
        tenant, size = name.split("-")
        tokens = SHORT if size == "short" else LONG
        deadline_ms = (200.0 if size == "short" else 1000.0) * TIME_FACTOR
        key = ORCHID_KEY if tenant == "orchid" else LUMEN_KEY
        out.append(ArrivalClass(name, key, rate * scale, *tokens, deadline_s=deadline_ms / 1000.0))
    return out


def tenants_file(workdir: Path) -> Path:
    """The example tenants with lumen entitled to the fallback too, and the interactive share
    the fleet's raw device time (concurrency far above what the load needs)."""
    data = yaml.safe_load((EXAMPLE_CONFIG.parent / "tenants.yaml").read_text())
    data["tenants"]["lumen"]["models"] = ["full-v18", "compact-v11"]
    data["quotas"]["classes"]["interactive"] = {"accelerator_ms_per_s": len(GROUPS) * DEVICES * 1000}
    data["quotas"]["tenants"]["orchid"]["interactive"] = {"weight": 2, "max_concurrent": 512}
    data["quotas"]["tenants"]["lumen"]["interactive"] = {"weight": 1, "max_concurrent": 512}
    path = workdir / "tenants.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[list[DeviceGroup], GatewayProcess]]:
    SETUP_STARTED[:] = [time.monotonic()]
    repository = emulator_repository(tmp_path / "repo", DEVICES)
    groups = [DeviceGroup.create(name, repository, tmp_path / name, DEVICES, TIME_FACTOR) for name in GROUPS]
    gateway: GatewayProcess | None = None
    try:
        start_all(groups)
        config: dict[str, Any] = {
            **example_config(without=("jobs",)),
            "tenants_file": str(tenants_file(tmp_path)),
            "classes": scaled_classes(TIME_FACTOR),
            "backends": [g.backend(TIME_FACTOR) for g in groups],
        }
        config["limits"] = {**config.get("limits", {}), "drain_timeout_s": 2}
        gateway = GatewayProcess(config, tmp_path)
        gateway.start()
        for group in groups:
            asyncio.run(warm_instances(group.triton.address, DEVICES, (SHORT, LONG)))
        yield groups, gateway
    finally:
        if gateway is not None:
            gateway.stop()
        stop_all(groups)


def share(part: int, whole: int) -> float:
    return 100.0 * part / whole if whole else 0.0


def window(run: Run, start: float, end: float) -> dict[str, Any]:
    answers = [a for a in run.answers if start <= a.sent < end]
    ok = [a for a in answers if a.ok]
    samples = [s for s in run.samples if start <= s.t < end]
    pools = sorted({p for s in samples for p in s.steps})
    offered = {p: statistics.fmean(s.offered.get(p, 0.0) for s in samples) for p in pools} if samples else {}
    total_offered = sum(v for p, v in offered.items() if p.endswith("/full-v18")) or 1.0
    by_class = {
        c: round(share(sum(a.degraded for a in ok if a.klass == c), sum(a.klass == c for a in ok)), 1)
        for c in SEED_MIX
    }
    reasons: dict[str, int] = {}
    for a in ok:
        if a.degraded:
            reasons[a.route_reason] = reasons.get(a.route_reason, 0) + 1
    refusals: dict[str, int] = {}
    for a in answers:
        if not a.ok:
            key = a.rule or a.status
            refusals[key] = refusals.get(key, 0) + 1
    return {
        "requests": len(answers),
        "answered_pct": share(len(ok), len(answers)),
        "degraded_pct": share(sum(a.degraded for a in ok), len(ok)),
        "ladder_degraded_pct": share(sum(a.degraded_by_ladder for a in ok), len(ok)),
        "degraded_pct_by_class": by_class,
        "degraded_by_route_reason": reasons,
        "ladder_refused_pct": share(sum(a.rule.startswith(LADDER_RULES) for a in answers), len(answers)),
        "max_step": {p: max(s.steps.get(p, 0) for s in samples) for p in pools},
        "primary_offered_share_pct": {
            p.split("/")[0]: round(100.0 * v / total_offered, 1)
            for p, v in offered.items()
            if p.endswith("/full-v18")
        },
        "answer_steps_max": max((max(a.ladder_step, a.fallback_ladder_step) for a in ok), default=-1),
        "refusals": refusals,
        "send_lag_p99_ms": (
            statistics.quantiles([a.lag_ms for a in answers], n=100)[98] if len(answers) >= 100 else 0.0
        ),
    }


def line(run: Run, start: float, end: float) -> str:
    """One timeline bin: degraded and answered shares, each full-v18 pool's highest step and
    its share of the offered primary demand."""
    w = window(run, start, end)
    steps = " ".join(str(w["max_step"].get(f"{g}/full-v18", "-")) for g in GROUPS)
    offered = " ".join(f"{w['primary_offered_share_pct'].get(g, 0):3.0f}" for g in GROUPS)
    return (
        f"{w['degraded_pct']:5.1f} {w['ladder_degraded_pct']:5.1f} {w['answered_pct']:5.1f}"
        f" | {steps} | {offered}"
    )


class CpuMeter:
    """CPU seconds of the gateway, this process (the load generator), the Tritons and the
    whole machine, read at phase boundaries (a Triton killed in between is left out)."""

    def __init__(self, gateway: GatewayProcess, groups: list[DeviceGroup]) -> None:
        self.gateway = gateway
        self.groups = groups
        self.marks: list[tuple[float, dict[str, float]]] = []
        self.lock = threading.Lock()

    def read(self) -> dict[str, float]:
        busy, total = machine_busy()
        pids = {g.name: g.triton._process.pid for g in self.groups if g.triton._process is not None}
        return {
            "gateway": self.gateway.cpu_s(),
            "client": time.process_time(),
            **{f"triton:{name}:{pid}": group_cpu_s(pid) for name, pid in pids.items()},
            "machine_busy": busy,
            "machine_total": total,
        }

    def mark(self) -> None:
        with self.lock:
            self.marks.append((time.monotonic(), self.read()))

    @staticmethod
    def rates(a: tuple[float, dict[str, float]], b: tuple[float, dict[str, float]]) -> dict[str, float]:
        """Cores used between two marks (the machine: busy share of all its cores, x cores)."""
        seconds = b[0] - a[0]
        tritons = sum(b[1][k] - a[1][k] for k in b[1] if k.startswith("triton:") and k in a[1])
        cores = (b[1]["machine_total"] - a[1]["machine_total"]) / seconds / os.sysconf("SC_CLK_TCK")
        return {
            "gateway_cores": (b[1]["gateway"] - a[1]["gateway"]) / seconds,
            "client_cores": (b[1]["client"] - a[1]["client"]) / seconds,
            "tritons_cores": tritons / seconds,
            "machine_busy_cores": (b[1]["machine_busy"] - a[1]["machine_busy"])
            / (b[1]["machine_total"] - a[1]["machine_total"])
            * cores,
        }


@pytest.mark.slow
def test_the_fleet_recovers_after_a_triton_is_killed_mid_surge(
    fleet: tuple[list[DeviceGroup], GatewayProcess],
) -> None:
    groups, gateway = fleet
    setup_s = time.monotonic() - SETUP_STARTED[0]
    killed = next(g for g in groups if g.name == KILLED)
    classes = arrival_classes()
    meter = CpuMeter(gateway, groups)
    ready_at: list[float] = []
    restart_errors: list[str] = []

    def kill() -> None:
        killed.triton.kill()

    def restart() -> None:
        """Start the killed Triton again; it returns once Triton reports ready. Triton 2.51 on a
        starved machine has failed a restart (a Python stub's ``lock_exception``, the server
        never ready), so a failed attempt is retried once and reported."""
        for _ in range(2):
            try:
                killed.triton.start()
            except TritonStartError as error:
                restart_errors.append(str(error)[-2000:])
                killed.triton.stop()
                continue
            ready_at.append(time.monotonic())
            return

    def surge_over() -> bool:
        """The surge goes on until the restarted Triton has been back SURGE_AFTER_RESTART_S (or
        the restart has failed twice: the assertions below then say so)."""
        if len(restart_errors) >= 2:
            return True
        return bool(ready_at) and time.monotonic() - ready_at[0] >= SURGE_AFTER_RESTART_S

    surge = {name: 1.25 for name in SEED_MIX} | {"lumen-short": 2.0, "lumen-long": 2.0}
    phases = [
        Phase("warmup", WARMUP_S, 0.5),
        Phase("normal", NORMAL_S),
        Phase("surge", SURGE_S, per_class=surge, until=surge_over),
        Phase("after", AFTER_S),
    ]
    hooks = [
        ("normal", 0.0, meter.mark),
        ("surge", 0.0, meter.mark),
        ("surge", KILL_AT_S, kill),
        ("surge", KILL_AT_S + DOWN_S, restart),
        ("after", 0.0, meter.mark),
        ("after", AFTER_S - RECOVERED_S, meter.mark),
    ]
    run = asyncio.run(drive(gateway.address, classes, phases, seed=SEED, hooks=hooks, scrape=gateway.metrics))
    meter.mark()
    spans = {name: (start, end) for name, start, end in run.phases}
    for name, (start, end) in spans.items():
        assert any(start <= s.t < end for s in run.samples), f"no /metrics sample in {name}"
    normal = window(run, *spans["normal"])
    surge_w = window(run, *spans["surge"])
    after_start, end = spans["after"]
    settle = window(run, after_start, end - RECOVERED_S)
    recovered = window(run, end - RECOVERED_S, end)
    timeline = {f"{t:5.0f}": line(run, t, t + 2.0) for t in np.arange(spans["normal"][0], end, 2.0).tolist()}
    cpu = [CpuMeter.rates(a, b) for a, b in zip(meter.marks, meter.marks[1:], strict=False)]
    report = {
        "setup_s": round(setup_s, 1),
        "rates_per_s": {c.name: round(c.rate_per_s, 2) for c in classes},
        "events": {k: round(v, 2) for k, v in run.events.items()},
        "failed_restarts": len(restart_errors),
        "phases": {k: (round(a, 1), round(b, 1)) for k, (a, b) in spans.items()},
        "normal": normal,
        "surge": surge_w,
        "settle": settle,
        "recovered": recovered,
        "cpu (normal, surge, settle, recovered)": [{k: round(v, 3) for k, v in c.items()} for c in cpu],
        "timeline (2 s: degraded %, by ladder %, answered %, steps a b c, offered % a b c)": timeline,
    }
    text = yaml.safe_dump(report, sort_keys=False, width=200)
    print("\n" + text)
    keep = os.environ.get("ORCHID_RECOVERY_KEEP")  # a directory: the report and the gateway's log
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        (Path(keep) / "report.yaml").write_text(text)
        (Path(keep) / "gateway.log").write_text(gateway.log_path.read_text(errors="replace"))

    # The workload did what it is for.
    assert ready_at, f"{KILLED}'s Triton did not restart: {restart_errors}\n{text}"
    back = [s for s in run.samples if s.t >= end - RECOVERED_S]
    assert back and all(s.ready.get(KILLED, False) for s in back), f"{KILLED} not back in time:\n{text}"
    assert max(surge_w["max_step"].values()) >= 3, f"the surge did not climb the ladder:\n{text}"
    # The recovery bound.
    assert recovered["ladder_degraded_pct"] <= normal["ladder_degraded_pct"] + TOLERANCE_POINTS, text
    highest = max(normal["max_step"].values())
    above = {p: s for p, s in recovered["max_step"].items() if s > highest}
    assert not above, f"pools above the normal phase's highest step {highest}: {above}\n{text}"
    assert recovered["ladder_refused_pct"] <= normal["ladder_refused_pct"] + TOLERANCE_POINTS, text
