"""After a fault the fleet comes back (issue 25): recovery as a property, in virtual time.

Hypothesis generates fleets (2-3 device groups of 2-3 devices, the fallback beside the
primary on each group's devices), one or two tenants at 50-95 % of the protected envelope
(Poisson arrivals), a surge of 5 or 8 s and a fault during it (a device group lost, a group
flapping, long requests underpredicted, every request slow); ``orchid-gateway simulate``
runs the production runtime through it. After the trigger ends, the fleet must come back to
its *own* normal phase's behaviour within ``RECOVERY_S``: the same degraded and on-time shares
(2 points, plus two standard errors of the difference: ``tolerance_pct``) and no pool's ladder
step above the normal phase's highest.
While a device group is lost, admitted work stays on time, a tenant inside its weighted
share of the surviving envelope keeps it, and refusals are early (asserted with four or more
devices surviving: ``EARLY_REFUSAL_MIN_DEVICES`` says why).

The metastable loop of issue 25 (``gateway.core.placement`` describes it) needs groups of
six or more devices and a surge that outlasts the fault: cases of that size cost 10-18 s
each, so the generated fleets stay small and the loop's counterexample, found on the code
before the fix, runs as an explicit example every time; the seed-scale scenario
(``examples/orchid/simulate/surge-fault-recovery.yaml``) runs below. Small fleets did not
show the loop before the fix (100 generated cases passed there): the generated cases guard
recovery in general, the examples this loop.

The default run is derandomized (the same 100 cases every run: CI stays deterministic) and
does not shrink (a failure prints its case); ``ORCHID_RECOVERY_PROFILE=long`` runs 1,000
random cases and shrinks (docs/simulate.md).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from orchid_tools.simulate import simulate
from tests.conftest import ROOT

GATEWAY = ROOT / "examples" / "orchid" / "gateway.yaml"
PROTECTED = 0.70  # the example gateway's protected_utilization
SHORT = {"input_tokens": 256, "output_tokens": 64, "deadline_ms": 200}
LONG = {"input_tokens": 4096, "output_tokens": 128, "deadline_ms": 1000}

# During a device-group loss: missed answers plus late refusals (the seed-scale scenario
# holds 2 %; a group of one or two devices loses a larger part of its work per request), and
# what a tenant inside its weighted share of the surviving envelope gets answered in time.
LATE_PCT = 8.0  # measured worst with 4+ surviving devices; see EARLY_REFUSAL_MIN_DEVICES
# "Refusals are early" is asserted where at least this many devices survive. A known limit:
# on 2-3 surviving devices at 2-3x their protected capacity, fair queueing lets an in-share
# request go ahead of a flooder's queued work, which then misses its latest start and is
# refused late: 6.13 % and 10.72 % of the surge's requests in two long-profile cases (2 groups
# of 2, one lost in a 1.5x surge; the second with lumen at 2.3x), against <= 2 % on the
# seed-scale fleet (test below).
EARLY_REFUSAL_MIN_DEVICES = 4
IN_SHARE_ON_TIME_PCT = 95.0
# "Inside its share" with a margin: over a few seconds of Poisson arrivals a tenant offering
# its whole share is above it about half the time (one generated case: 97 % of its share,
# 92.8 % on time, its long requests behind a flooder's in the long lane).
IN_SHARE_MARGIN = 0.8

# Long work's share of a group's devices at normal load, of the protected envelope per device:
# the short lane (limits.short_lane_devices: 2) leaves long work one device of 2-3.
LONG_LANE_LOAD = 0.8

# Phases (virtual seconds): normal, the surge (the fault inside it), settling, judged.
NORMAL_S, RECOVERY_S, JUDGED_S = 4.0, 12.0, 4.0

settings.register_profile(
    "recovery-default",
    max_examples=100,
    derandomize=True,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],  # a failure prints its case; shrink it in the long run
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "recovery-long",
    # ORCHID_RECOVERY_EXAMPLES splits the run over processes (e.g. 2 x 500, each with its own
    # --hypothesis-seed) on a machine with cores to spare.
    max_examples=int(os.environ.get("ORCHID_RECOVERY_EXAMPLES", "1000")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROFILE = "recovery-long" if os.environ.get("ORCHID_RECOVERY_PROFILE") == "long" else "recovery-default"


@dataclass(frozen=True)
class Case:
    groups: int
    devices: int
    load: float  # normal demand, of the protected envelope
    long_share: float  # of the demand, in long requests
    lumen_share: float  # of the demand, from lumen (weight 1); 0: orchid alone
    surge: float  # everyone's multiplier in the surge
    flood: float  # lumen's multiplier in the surge
    fault: str  # lost | flap | underpredicted | slow
    seed: int
    surge_s: float = 5.0  # the surge's length; the fault lasts all of it but its first and last second


cases = st.builds(
    Case,
    groups=st.integers(2, 3),
    devices=st.integers(2, 3),
    load=st.floats(0.5, 0.9),
    long_share=st.sampled_from([0.0, 0.3, 0.6]),
    lumen_share=st.sampled_from([0.0, 0.25, 0.4]),
    surge=st.floats(1.0, 1.5),
    flood=st.floats(1.0, 3.0),
    fault=st.sampled_from(["lost", "flap", "underpredicted", "slow"]),
    seed=st.integers(0, 2**16),
    surge_s=st.sampled_from([5.0, 8.0]),
)


def scenario(case: Case) -> dict[str, Any]:
    tenants: dict[str, Any] = {
        "orchid": {"weight": 2, "share": 1.0 - case.lumen_share},
        "lumen": {"weight": 1, "share": case.lumen_share},
    }
    # Long work runs on the devices the short lane leaves it (one per group here): at normal
    # load it stays inside them, or it queues without bound and no phase is a steady "normal"
    # to come back to (a generated case once loaded that lane to 110 % at "normal" load).
    long_share = min(case.long_share, LONG_LANE_LOAD / (case.load * case.devices))
    arrivals: dict[str, Any] = {}
    for tenant, facts in tenants.items():
        for kind, shape, share in (("short", SHORT, 1.0 - long_share), ("long", LONG, long_share)):
            raw = case.load * PROTECTED * facts["share"] * share
            if raw > 0:
                arrivals[f"{tenant}-{kind}"] = {
                    "tenant": tenant,
                    "model": "full-v18",
                    "class": "interactive",
                    "raw_capacity_share": round(raw, 4),
                    **shape,
                }
    surge = {name: case.flood if name.startswith("lumen") else case.surge for name in arrivals}
    fault_at, fault_until = NORMAL_S + 1.0, NORMAL_S + case.surge_s - 1.0
    lost = f"g{case.groups - 1}"
    faults: list[dict[str, Any]]
    if case.fault == "lost":
        faults = [{"kind": "device_group_lost", "backend": lost, "at_s": fault_at, "until_s": fault_until}]
    elif case.fault == "flap":
        faults = [
            {"kind": "device_group_lost", "backend": lost, "at_s": t, "until_s": t + 1.0}
            for t in range(int(fault_at), int(fault_until), 2)
        ]
    else:
        faults = [
            {
                "kind": "underprediction",
                "model": "full-v18",
                "factor": 2.0,
                "at_s": fault_at,
                "until_s": fault_until,
                **({"longer_than_tokens": 0} if case.fault == "slow" else {}),
            }
        ]
    quota = {"weight": 2, "max_concurrent": 512}
    return {
        "gateway": str(GATEWAY),
        "seed": case.seed,
        "tenants": {
            "tenants": {
                name: {
                    "models": ["full-v18", "compact-v11"],
                    "classes": ["interactive"],
                    "cells": ["eu-restricted"],
                    "weight": facts["weight"],
                }
                for name, facts in tenants.items()
            },
            "quotas": {
                "classes": {"interactive": {"accelerator_ms_per_s": 24000}},
                "tenants": {
                    name: {"interactive": {**quota, "weight": facts["weight"]}}
                    for name, facts in tenants.items()
                },
            },
        },
        "fleet": [
            {
                "name": f"g{index}",
                "cell": "eu-restricted",
                "devices": case.devices,
                "shared_devices": True,
                "models": {"full-v18": {}, "compact-v11": {}},
            }
            for index in range(case.groups)
        ],
        "arrivals": arrivals,
        "phases": [
            {"name": "normal", "duration_s": NORMAL_S},
            {"name": "surge", "duration_s": case.surge_s, "multiplier": case.surge, "arrivals": surge},
            {"name": "settle", "duration_s": RECOVERY_S},
            {"name": "judged", "duration_s": JUDGED_S},
        ],
        "faults": faults,
    }


def run(case: Case, directory: Path) -> dict[str, dict[str, Any]]:
    path = directory / f"recovery-{case.seed}.yaml"
    path.write_text(yaml.safe_dump(scenario(case), sort_keys=False))
    return {phase["name"]: phase for phase in simulate(path)["phases"]}


def tolerance_pct(normal: dict[str, Any], judged: dict[str, Any], count: str) -> float:
    """How far the judged window's share of ``count`` answers may exceed the normal phase's: the
    issue's 2 points, plus two standard errors of the difference of the two shares (pooled
    binomial). Both windows are a few seconds of Poisson arrivals, so their loads differ by
    chance (one generated case: 15 % more offered in the judged window, 3 of 137 answers not
    on time against 0 of 149); a stuck fleet is tens of points away, and its step is judged
    exactly."""
    n1, n2 = max(1, normal["offered"]), max(1, judged["offered"])
    pooled = (normal[count] + judged[count]) / (n1 + n2)
    return 2.0 + 200.0 * math.sqrt(pooled * (1.0 - pooled) * (1.0 / n1 + 1.0 / n2))


def max_step(phase: dict[str, Any]) -> int:
    return max((pool["max_step"] for pool in phase["ladder"].values()), default=0)


def check(case: Case, phases: dict[str, dict[str, Any]]) -> None:
    normal, surge, judged = phases["normal"], phases["surge"], phases["judged"]
    figures = {name: (p["totals"], max_step(p)) for name, p in phases.items()}
    # Recovery: the fleet's own normal behaviour within RECOVERY_S of the trigger's end.
    before, after = normal["totals"], judged["totals"]
    missed_normal = {**before, "not_on_time": before["offered"] - before["on_time"]}
    missed_judged = {**after, "not_on_time": after["offered"] - after["on_time"]}
    degraded_points = tolerance_pct(before, after, "degraded")
    assert after["degraded_pct"] <= before["degraded_pct"] + degraded_points, figures
    assert max_step(judged) <= max_step(normal), {n: p["ladder"] for n, p in phases.items()}
    on_time_points = tolerance_pct(missed_normal, missed_judged, "not_on_time")
    assert after["on_time_pct"] >= before["on_time_pct"] - on_time_points, figures
    if case.fault not in ("lost", "flap"):
        # Underprediction is learned from observed work: until then admitted work runs longer
        # than it was priced, so on-time figures during it are the estimator's (tests/
        # test_estimation.py), not a promise of this property; recovery after it is.
        return
    # During the fault: admitted work on time, refusals early, in-share tenants keep theirs.
    totals = surge["totals"]
    assert totals["missed_pct"] <= 1.0, figures
    if (case.groups - 1) * case.devices >= EARLY_REFUSAL_MIN_DEVICES:
        assert totals["missed_pct"] + totals["rejected_late_pct"] <= LATE_PCT, figures
    surviving = (case.groups - 1) * case.devices * PROTECTED * 1000.0
    tenants = surge["tenants"]
    weights = {name: figures_["weight"] for name, figures_ in tenants.items()}
    for name, tenant in tenants.items():
        share = surviving * weights[name] / sum(weights.values())
        if tenant["offered_ms_per_s"] <= IN_SHARE_MARGIN * share:
            # Work that was running on the group when it was lost failed with it (the fault
            # itself, the report's "failed"); the rest must be answered in time.
            answered = tenant["offered"] - tenant["failed"]
            on_time_pct = 100.0 * tenant["on_time"] / answered if answered else 100.0
            # (95 %, less two answers where the tenant sent fewer than 100 in the phase)
            allowance = max(0.0, 200.0 / max(1, answered) - 2.0)
            assert on_time_pct >= IN_SHARE_ON_TIME_PCT - allowance, (name, tenants)


# Cases the long profile found, kept as regressions: a 3x2 fleet whose judged window drew more
# load than its normal phase by chance, and a 2x2 fleet losing a group in a 1.5x surge (late
# refusals 6.13 %; an in-share tenant with one refusal early and one late of its 25: 92 %).
SHRUNK_EXAMPLES = (
    # The judged window drew 15 % more load than the normal phase (see tolerance_pct).
    Case(
        groups=3,
        devices=2,
        load=0.8558097020214159,
        long_share=0.6,
        lumen_share=0.0,
        surge=1.490869193824996,
        flood=1.0,
        fault="lost",
        seed=2,
        surge_s=8.0,
    ),
    Case(
        groups=2,
        devices=2,
        load=0.75,
        long_share=0.0,
        lumen_share=0.25,
        surge=1.5,
        flood=1.0,
        fault="lost",
        seed=1,
        surge_s=5.0,
    ),
    Case(
        groups=2,
        devices=2,
        load=0.5,
        long_share=0.0,
        lumen_share=0.25,
        surge=1.5,
        flood=1.0,
        fault="lost",
        seed=18,
        surge_s=5.0,
    ),
)
# Counterexamples the property found on the code before the fix (kept as regressions): a pool
# of the surviving groups still at step 2-3 in the judged window, with the normal phase at 0.
PRE_FIX_COUNTEREXAMPLES = (
    Case(
        groups=3,
        devices=8,
        load=0.95,
        long_share=0.3,
        lumen_share=0.4,
        surge=1.25,
        flood=2.0,
        fault="lost",
        seed=23,
        surge_s=8.0,
    ),
)


@pytest.mark.slow
@settings(settings.get_profile(PROFILE))
@given(case=cases)
@example(case=PRE_FIX_COUNTEREXAMPLES[0])
@example(case=SHRUNK_EXAMPLES[0])
@example(case=SHRUNK_EXAMPLES[1])
@example(case=SHRUNK_EXAMPLES[2])
def test_after_a_fault_the_fleet_returns_to_its_normal_behaviour(case: Case, tmp_path_factory: Any) -> None:
    check(case, run(case, tmp_path_factory.mktemp("recovery")))


@pytest.mark.slow
def test_the_issues_scenario_recovers_within_20_s_of_the_surge() -> None:
    """The seed's 24 devices as three groups, two tenants at 99.8 % of protected, a surge with
    group-c lost in its middle (``surge-fault-recovery.yaml``). Before the fix, 77-93 % of the
    answers stayed degraded 0-40 s after the surge and one pool sat at step 5-6 throughout."""
    document = simulate(ROOT / "examples" / "orchid" / "simulate" / "surge-fault-recovery.yaml")
    phases = {phase["name"]: phase for phase in document["phases"]}
    normal, fault, recovered = phases["normal"], phases["surge-fault"], phases["recovered"]
    # "recovered" starts 20 s after the surge's end.
    assert recovered["start_s"] - phases["surge-after"]["end_s"] == 20.0
    assert recovered["totals"]["degraded_pct"] <= normal["totals"]["degraded_pct"] + 2.0
    assert max_step(recovered) <= max_step(normal), recovered["ladder"]
    assert fault["totals"]["missed_pct"] + fault["totals"]["rejected_late_pct"] <= 2.0, fault["totals"]
    assert document["expectations_held"], document["expectations"]  # the file's own expect: block
