"""A surge split across two replicas on one Redis, with real requests, against one replica
offered the same arrivals (issue 14, "ladder agreement").

The workload is the seed's mix on the 4 emulated devices at time factor 1 (a Triton of the
test's own: request times as the benchmarks see them), short requests (256/64 tokens, 200 ms
deadline) and long ones (4,096/128, 1,000 ms) from tenant orchid, whose answers may come from
the compact fallback: a lead-in at half the protected envelope, then a surge past it. The same
deterministic schedule is sent twice: once dealt alternately to two replicas sharing the
fleet state on Redis (each alone sees half the surge, not enough to climb), once entirely to
a single replica (in-memory state). Every answer is classified from the client: full
quality, degraded (a fallback or capped answer, ``orchid.approximation``) or refused (any
error, a missed deadline included).

The fleet must climb on the fleet's sum (each replica alone sees 0.8x of protected): both
replicas reach the single replica's top step, within one step; the two are never on
different steps for more than 1 s; and over the settled part of the surge the fleet's
degraded share and its refused share are each within three standard errors of the single
replica's (``share_bound``).

What this test found, each fixed where it lives: a replica's predicted wait counted only its
own bound work (``DeviceSet.remote_ends`` now holds the others'); a replica's relief was its
own half of the fleet's admitted work, read against the fleet's demand (admitted work is now
exchanged, ``PoolLoad.add_admitted``); replicas near a threshold sat a step apart for seconds
(the request path now acts on the highest step any replica holds, ``PoolLoad.fleet_step``);
and the plan's order of capping and fallback followed learned savings across a knife edge,
so a replica flipped between capping 46 % of the surge and diverting 20 %
(``overload.QUALITY_TIE``). Before, the fleet degraded 15-25 points more of the surge. Later,
a replica charged the time its request waited in Triton's queue behind the other replica's
work as device time (its own view of the bound work missed it): the fleet's learned prices
ran 1.5 % above the single replica's, which its ladder read as 1 % more demand, and the fleet
degraded 4-6 points more of every run (up to 11 under the full suite's load, past the bound).
A lease's grant now answers that wait from the fleet's bound work in Redis
(``gateway.state.device_leases.Lease``): prices within 1 %, and in four runs the fleet's
degraded share differed from the single replica's by -4.9 to +2.4 points (before, +4 to +6
in five runs alone).

The bound on each share's difference is computed from the run's own counts: three standard
errors of the difference of the two shares (``share_bound``), binomial or, where outcomes
cluster in time, by batch means over each second (whichever is larger). Each run's settled
surge is 674 arrivals (16 s x 1.6 x 26.3 requests/s); a degraded share near 30 % gives a
binomial standard error of the difference of sqrt(0.3 x 0.7 x 2 / 674) = 2.5 points, so a
bound of 7.5 points (at 40 %: 8.0). The measured spread agrees: in the eight runs at issue
11's last round whose shares were read, the fleet's degraded share differed from the single
replica's by 0.3-5.7 points, both directions (32.8 vs 27.6 %, 24.6 vs 30.3 %), and the round
before's three by 0.1-2.9, as draws of a difference with a 2.5-point standard error fall (the
largest of eight is typically about two of them: 5 points). The fixed bound was 5 points (two
standard errors: it failed 3 of that round's 13 runs), then 8 points, chosen from that
spread; this is the same order, derived from the run's own counts, and tighter where a share
is small (a refused share near 5 %: 3.6 points). The bound still catches what this test found
(15-25 points, six standard errors and more).
"""

from __future__ import annotations

import asyncio
import math
import statistics
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml
from tritonclient.grpc import service_pb2

from gateway.backends.local import LocalTriton
from gateway.config import GatewayConfig, StateConfig
from orchid_tools.harness import send_open_loop
from tests.conftest import EXAMPLE_CONFIG, ORCHID_KEY, ThreadedGateway
from tests.fleet import INFER, fleet_config, infer_request
from tests.redis_server import RedisServer, redis_server

__all__ = ["redis_server"]

# The seed's mix on 4 devices (x 4/24 of its 24), time factor 1: 97.43 % of protected at 1x.
SHORT_PER_S, LONG_PER_S = 140 * 4 / 24, 18 * 4 / 24
SHORT_DEADLINE_S, LONG_DEADLINE_S = 0.2, 1.0
LEAD_S, SURGE_S = 2.0, 20.0
LEAD_X, SURGE_X = 0.5, 1.6  # of the seed's normal demand
SETTLED_S = 4.0  # the surge's first seconds are the climb; shares are compared after them


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float
    long: bool


@dataclass(frozen=True, slots=True)
class Outcome:
    at_s: float
    kind: str  # "full" | "degraded" | "refused"
    reason: str  # the answer's route reason (``orchid.route_reason``), or the refusal


def schedule() -> list[Arrival]:
    """Arrival offsets: a quiet lead-in, then the surge; each class evenly spaced (no
    randomness), the two classes interleaved."""
    arrivals: list[Arrival] = []
    for start, seconds, x in ((0.0, LEAD_S, LEAD_X), (LEAD_S, SURGE_S, SURGE_X)):
        for rate, long in ((SHORT_PER_S * x, False), (LONG_PER_S * x, True)):
            arrivals.extend(Arrival(start + (i + 0.5) / rate, long) for i in range(int(seconds * rate)))
    return sorted(arrivals, key=lambda a: a.at_s)


async def drive(addresses: list[str], arrivals: list[Arrival]) -> list[Outcome]:
    """Arrival ``i`` goes to replica ``i % len(addresses)``; each answer classified."""
    bodies = {False: infer_request(256, 64), True: infer_request(4096, 128)}
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    calls = [c.unary_unary(INFER) for c in channels]
    outcomes: list[Outcome] = []
    t0 = time.monotonic() + 0.1

    async def one(send: tuple[int, Arrival]) -> None:
        index, arrival = send
        try:
            raw = await calls[index % len(calls)](
                bodies[arrival.long],
                metadata=(("authorization", f"Bearer {ORCHID_KEY}"),),
                timeout=LONG_DEADLINE_S if arrival.long else SHORT_DEADLINE_S,
            )
        except grpc.aio.AioRpcError as error:
            rule = dict(error.trailing_metadata() or ()).get("orchid-rule", "")
            outcomes.append(Outcome(arrival.at_s, "refused", f"{error.code().name} {rule}".strip()))
            return
        reply = service_pb2.ModelInferResponse.FromString(raw)
        approximation = reply.parameters["orchid.approximation"].string_param
        reason = reply.parameters["orchid.route_reason"].string_param or "primary"
        kind = "full" if approximation in ("", "none") else "degraded"
        outcomes.append(Outcome(arrival.at_s, kind, reason))

    try:
        await send_open_loop(enumerate(arrivals), one, t0=t0, at=lambda send: send[1].at_s, lead_s=math.inf)
    finally:
        for channel in channels:
            await channel.close()
    return outcomes


class StepSampler:
    """Reads each replica's ladder step on the full-v18 pool every 20 ms, in a thread."""

    def __init__(self, replicas: list[ThreadedGateway]) -> None:
        self.replicas = replicas
        self.samples: list[tuple[float, list[int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="step-sampler", daemon=True)

    def _step(self, running: ThreadedGateway) -> int:
        gw = running.server.gateway
        assert gw is not None

        def read() -> int:
            steps = [load.step for name, load in gw.loads.items() if name.endswith("/full-v18")]
            return max(steps, default=0)

        return int(running.call_soon(read))

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.samples.append((time.monotonic(), [self._step(r) for r in self.replicas]))

    def __enter__(self) -> StepSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def longest_disagreement_s(self) -> float:
        """The longest stretch over which the replicas' steps differed: one replica's step
        change not followed (or undone) by the other for that long."""
        longest, since = 0.0, None
        for t, steps in self.samples:
            if len(set(steps)) > 1:
                since = t if since is None else since
                longest = max(longest, t - since)
            else:
                since = None
        return longest

    def agreement(self) -> float:
        """The share of samples in which every replica was on the same step."""
        return sum(len(set(steps)) == 1 for _, steps in self.samples) / max(1, len(self.samples))

    def top(self, replica: int) -> int:
        return max((steps[replica] for _, steps in self.samples), default=0)


@pytest.fixture
def started() -> Iterator[list[ThreadedGateway]]:
    running: list[ThreadedGateway] = []
    yield running
    for r in running:
        r.stop()


def tenants_file(workdir: Path) -> Path:
    """The example tenants with orchid's interactive quota set above the surge: the ladder is
    what is compared here, not quota borrowing (with the class share split by weight, orchid
    would borrow lumen's idle share for part of the surge)."""
    base = yaml.safe_load((EXAMPLE_CONFIG.parent / "tenants.yaml").read_text())
    base["quotas"]["classes"]["interactive"] = {"accelerator_ms_per_s": 20_000}
    orchid = {"accelerator_ms_per_s": 10_000, "max_concurrent": 64}
    base["quotas"]["tenants"]["orchid"]["interactive"] = orchid
    path = workdir / "tenants.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


# Fleet and single replica shares (degraded, refused) must agree within this many standard
# errors of their difference (module docstring): a 0.3 % chance per share of failing a run
# whose two shares are draws of the same share.
STANDARD_ERRORS = 3.0
BATCH_S = 1.0  # the batches of the batch-means standard error


def share_bound(kind: str, fleet: list[Outcome], single: list[Outcome]) -> float:
    """STANDARD_ERRORS standard errors of the difference of the two runs' ``kind`` shares over
    the settled surge: the larger of two estimates of it, binomial (pooled: outcomes drawn
    independently from one share) and batch means over each second's arrivals (outcomes
    correlated within a second: a ladder spell, or a stall of the machine that makes every
    request then in flight miss its deadline)."""
    a, b = settled(fleet), settled(single)
    pooled = (sum(o.kind == kind for o in a) + sum(o.kind == kind for o in b)) / (len(a) + len(b))
    binomial = math.sqrt(pooled * (1.0 - pooled) * (1.0 / len(a) + 1.0 / len(b)))
    batches = math.sqrt(_batch_variance(a, kind) + _batch_variance(b, kind))
    return STANDARD_ERRORS * max(binomial, batches)


def _batch_variance(outcomes: list[Outcome], kind: str) -> float:
    """The squared standard error of the ``kind`` share by batch means: the variance of the
    per-second shares over their number (the schedule sends the same count every second)."""
    batches: dict[int, list[Outcome]] = {}
    for o in outcomes:
        batches.setdefault(int((o.at_s - LEAD_S - SETTLED_S) // BATCH_S), []).append(o)
    shares = [sum(o.kind == kind for o in batch) / len(batch) for batch in batches.values()]
    return statistics.variance(shares) / len(shares)


def real_time(config: GatewayConfig) -> GatewayConfig:
    """The config's backend priced at time factor 1 (the Triton it fronts runs at 1)."""
    backends = tuple(b.model_copy(update={"time_scale": 1.0}) for b in config.backends)
    return config.model_copy(update={"backends": backends})


def run(replicas: list[ThreadedGateway], arrivals: list[Arrival]) -> tuple[list[Outcome], StepSampler]:
    for r in replicas:
        r.start()
    # Warm-up: every replica's pools exist and the estimator has seen both shapes.
    warm = [Arrival(i * 0.1, long=i % 3 == 0) for i in range(6 * len(replicas))]
    asyncio.run(drive([r.address for r in replicas], warm))
    with StepSampler(replicas) as sampler:
        outcomes = asyncio.run(drive([r.address for r in replicas], arrivals))
    return outcomes, sampler


def settled(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o.at_s >= LEAD_S + SETTLED_S]


def shares(outcomes: list[Outcome]) -> dict[str, float]:
    part = settled(outcomes)
    return {
        kind: round(sum(o.kind == kind for o in part) / len(part), 3)
        for kind in ("full", "degraded", "refused")
    }


def reasons(outcomes: list[Outcome]) -> dict[str, int]:
    return dict(Counter(o.reason for o in settled(outcomes)).most_common())


@pytest.mark.slow
def test_a_real_surge_split_across_two_replicas_matches_one_replica(
    triton_real_time: LocalTriton, redis_server: RedisServer, tmp_path: Path, started: list[ThreadedGateway]
) -> None:
    tenants = tenants_file(tmp_path)
    arrivals = schedule()
    state = StateConfig.model_validate(
        {
            "backend": "redis",
            "url": redis_server.url,
            "key_prefix": f"split-surge-{uuid.uuid4().hex[:8]}:",
            "lease_ttl_ms": 1500,
            "call_timeout_ms": 200,
        }
    )
    fleet = [
        ThreadedGateway(real_time(fleet_config(triton_real_time.address, tenants, state))) for _ in range(2)
    ]
    started.extend(fleet)
    fleet_outcomes, fleet_steps = run(fleet, arrivals)
    for r in fleet:  # one run at a time on the Triton
        r.stop()
    started.clear()
    single = [ThreadedGateway(real_time(fleet_config(triton_real_time.address, tenants, None)))]
    started.extend(single)
    single_outcomes, single_steps = run(single, arrivals)

    assert len(fleet_outcomes) == len(single_outcomes) == len(arrivals)
    fleet_share, single_share = shares(fleet_outcomes), shares(single_outcomes)
    top = [fleet_steps.top(0), fleet_steps.top(1)]
    single_top = single_steps.top(0)
    print(
        f"\nsplit surge ({len(arrivals)} arrivals, {SURGE_X}x for {SURGE_S} s): top step {top} on the "
        f"two replicas, {single_top} on the single one; the replicas on the same step "
        f"{fleet_steps.agreement():.1%} of the time, apart at most "
        f"{fleet_steps.longest_disagreement_s():.2f} s\n"
        f"settled surge: fleet {fleet_share} {reasons(fleet_outcomes)}\n"
        f"               single {single_share} {reasons(single_outcomes)}\n"
        f"bounds: degraded {share_bound('degraded', fleet_outcomes, single_outcomes):.3f}, "
        f"refused {share_bound('refused', fleet_outcomes, single_outcomes):.3f}"
    )
    # Each replica alone is offered 0.61x of protected: it climbs only on the fleet's sum.
    assert single_top >= 3, f"the surge did not load one replica: step {single_top}"
    assert min(top) >= 3, f"the fleet did not climb on its sum: {top}"
    assert abs(top[0] - single_top) <= 1 and abs(top[1] - single_top) <= 1, (top, single_top)
    # Both on the same step, one following the other's changes within 1 s.
    assert fleet_steps.longest_disagreement_s() <= 1.0, (
        f"the replicas were on different steps for {fleet_steps.longest_disagreement_s():.2f} s"
    )
    for kind in ("degraded", "refused"):
        gap = abs(fleet_share[kind] - single_share[kind])
        bound = share_bound(kind, fleet_outcomes, single_outcomes)
        assert gap <= bound, (kind, f"gap {gap:.3f} > bound {bound:.3f}", fleet_share, single_share)
