"""A noisy neighbour, against the real example Triton: the tenant inside its share keeps it.

Tenant lumen (weight 1) floods ``full-v18`` at 2.75x the pool's raw capacity while tenant
orchid (weight 2) sends a steady 35 % of it (the scenario of bench/noisy_neighbour.py, on a
Triton of this module's own at time factor 0.15: requests are the route's longest input,
8,192 tokens, 256 out, priced at about 140 device-ms, and deadlines are the seed's 3.5x the
price). The time factor keeps the request rate (about 90/s in the flood) where the gateway,
Triton and the load generator together fit this 2-core machine's CPU: at the session
Triton's 0.05 it is 270/s, the gateway alone takes a core, and what the test then measures is
CPU starvation (late answers, Triton co-batching long requests whose instances were slow to
free), not isolation. The gateway runs as its own process (``orchid-gateway serve``), so the
load generator does not share its interpreter. Open loop: requests are sent at their
scheduled times whatever is outstanding.

What must hold, measured in the run:
* orchid gets >= 95 % of its requests answered on time and >= 90 % at full quality;
* lumen's refused requests are refused early for its excess (RESOURCE_EXHAUSTED with
  ``retry-after-ms``: the shedder, its quota, or a full queue), never late for orchid's sake;
* lumen is served no more accelerator-ms than its weighted share plus what orchid leaves
  idle (of what the ladder plans to fill: ``plan_utilization`` of the devices' raw time),
  within a tolerance for the prediction noise of one run.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from gateway.backends.local import LocalTriton
from gateway.config import load_routes
from gateway.core.overload import LadderConfig
from gateway.core.profile import DemandProfile
from orchid_tools.harness import GatewayProcess, example_config
from tests.conftest import LUMEN_KEY, ORCHID_KEY, ROOT, emulator_parameters, own_triton

INFER = "/inference.GRPCInferenceService/ModelInfer"
INPUT_TOKENS, OUTPUT_TOKENS = 8192, 256
DEVICES = 4
BEFORE_S, FLOOD_S, AFTER_S = 1.0, 12.0, 2.0
NOISY_TIME_FACTOR = 0.15
SEED = 11


def price_ms() -> float:
    """Device-ms of one request on full-v18 at this module's time factor, from the route."""
    routes = load_routes(ROOT / "routes")
    profile: DemandProfile = routes.profiles[routes.models["full-v18"].profile]
    return profile.accelerator_ms(INPUT_TOKENS, OUTPUT_TOKENS) * NOISY_TIME_FACTOR


@pytest.fixture(scope="module")
def triton_noisy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalTriton]:
    with own_triton(tmp_path_factory.mktemp("noisy-triton"), time_factor=NOISY_TIME_FACTOR) as server:
        yield server


@pytest.fixture(scope="module")
def gateway_process(triton_noisy: LocalTriton, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``orchid-gateway serve`` in front of the module's Triton, on the example's tenants,
    routes and policies."""
    backend = {
        "name": "local",
        "address": triton_noisy.address,
        "labels": {"cell": "eu-restricted", "device_group": "local-a"},
        "devices": DEVICES,
        "max_inflight_per_device": 2,
        "time_scale": NOISY_TIME_FACTOR,
    }
    workdir = tmp_path_factory.mktemp("noisy")
    with GatewayProcess(example_config([backend]), workdir, log_level=None) as gateway:
        yield gateway.address


def emulator_device_ms() -> Callable[[int], float]:
    """Device-ms the capacity emulator holds an instance for one of these requests alone,
    by output tokens: its own cost model (``fixed_ms + prefill_ms_per_token x input +
    decode_ms_per_token x output``, times the time factor) with the parameters of full-v18's
    ``config.pbtxt``, read independently of the gateway's routes, estimator and charges."""
    declared = emulator_parameters("full-v18")
    fixed, prefill, decode = (
        float(declared[key]) for key in ("fixed_ms", "prefill_ms_per_token", "decode_ms_per_token")
    )
    return lambda output_tokens: (fixed + prefill * INPUT_TOKENS + decode * output_tokens) * NOISY_TIME_FACTOR


def infer_request() -> bytes:
    request = service_pb2.ModelInferRequest(model_name="full-v18")
    tensor = request.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([1, INPUT_TOKENS])
    request.raw_input_contents.append(np.arange(INPUT_TOKENS, dtype=np.int32).tobytes())
    request.parameters["orchid.max_output_tokens"].int64_param = OUTPUT_TOKENS
    return request.SerializeToString()


def schedule(rate: float, start: float, end: float, rng: np.random.Generator) -> list[float]:
    times, t = [], start
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t >= end:
            return times
        times.append(t)


def drive(address: str, sends: list[tuple[float, str]], deadline_s: float) -> list[dict[str, object]]:
    """Send every request at its scheduled time (open loop) and collect the outcomes.

    Synchronous gRPC futures: the sending thread only sleeps to each send time and hands the
    call to gRPC's C core, whose threads complete it, so the load generator takes a small
    part of this machine's CPU beside the gateway and Triton it measures."""
    payload = infer_request()
    keys = {"orchid": ORCHID_KEY, "lumen": LUMEN_KEY}
    results: list[dict[str, object]] = []
    all_done = threading.Event()

    def finished(at: float, tenant: str, sent: float, future: grpc.Future) -> None:
        outcome: dict[str, object] = {"tenant": tenant, "at": at, "latency_s": time.monotonic() - sent}
        error = future.exception()
        if error is None:
            reply = service_pb2.ModelInferResponse.FromString(future.result())
            outcome["status"] = "OK"
            outcome["approximation"] = reply.parameters["orchid.approximation"].string_param
            outcome["output_tokens"] = int(reply.outputs[0].shape[-1])  # what Triton generated
            outcome["model"] = reply.parameters["orchid.model"].string_param
        else:
            assert isinstance(error, grpc.Call)
            trailing = {k: v for k, v in (error.trailing_metadata() or ())}
            outcome["status"] = error.code().name
            outcome["rule"] = trailing.get("orchid-rule", "")
            outcome["retry_after"] = "retry-after-ms" in trailing
        results.append(outcome)  # list.append is atomic; callbacks run on gRPC's threads
        if len(results) == len(sends):
            all_done.set()

    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(INFER)
        t0 = time.monotonic() + 0.2
        for at, tenant in sends:
            delay = t0 + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # the open-loop schedule, not synchronisation
            sent = time.monotonic()
            future = call.future(
                payload, metadata=(("authorization", f"Bearer {keys[tenant]}"),), timeout=deadline_s
            )
            future.add_done_callback(functools.partial(finished, at, tenant, sent))
        # Every call carries a deadline, so every one completes; the bound only guards a hang.
        assert all_done.wait(timeout=deadline_s + 60.0), f"{len(results)} of {len(sends)} answered"
    return results


@pytest.mark.slow
def test_a_flooding_neighbour_costs_the_in_share_tenant_nothing(gateway_process: str) -> None:
    price = price_ms()
    raw_rate = DEVICES * 1000.0 / price  # requests/s the pool's devices can run at all
    deadline_s = 3.5 * price / 1000.0  # the seed's teaching request: 200 ms for 56.8 ms of work
    rng = np.random.default_rng(SEED)
    end = BEFORE_S + FLOOD_S + AFTER_S
    orchid = schedule(0.35 * raw_rate, 0.0, end, rng)
    lumen = schedule(2.75 * raw_rate, BEFORE_S, BEFORE_S + FLOOD_S, rng)
    sends = sorted([(t, "orchid") for t in orchid] + [(t, "lumen") for t in lumen])
    results = drive(gateway_process, sends, deadline_s)

    mine = [r for r in results if r["tenant"] == "orchid"]
    on_time = [r for r in mine if r["status"] == "OK"]
    full = [r for r in on_time if r["approximation"] == "none"]
    report = Counter(f"{r['status']}:{r.get('rule', r.get('approximation'))}" for r in mine)
    assert len(on_time) >= 0.95 * len(mine), report
    assert len(full) >= 0.90 * len(mine), report

    flooder = [r for r in results if r["tenant"] == "lumen"]
    refused = [r for r in flooder if r["status"] != "OK"]
    flood_report = Counter(f"{r['status']}:{r.get('rule', r.get('approximation'))}" for r in flooder)
    assert len(refused) > len(flooder) / 2, flood_report  # 2.75x raw capacity cannot all run
    early = [r for r in refused if r["status"] == "RESOURCE_EXHAUSTED" and r["retry_after"]]
    # The flooder's excess is refused early with retry guidance; the few exceptions are its
    # own requests whose predicted start slipped (late) or that it could never finish in time.
    assert len(early) >= 0.9 * len(refused), flood_report

    # Served accelerator-ms, by an independent ruler: the device time the emulator held for
    # each answer (its own cost model from full-v18's config.pbtxt, on the tokens Triton
    # actually generated), not the gateway's charge. Lumen at most its share plus what orchid
    # left idle of what the ladder plans to fill (plan_utilization of the devices' raw time;
    # the example config keeps the default).
    device_ms = emulator_device_ms()

    def held_ms(outcome: dict[str, object]) -> float:
        tokens = outcome["output_tokens"]
        assert isinstance(tokens, int)
        return device_ms(tokens)

    envelope_ms = DEVICES * LadderConfig().plan_utilization * 1000.0 * FLOOD_S
    orchid_ms = sum(
        held_ms(r)
        for r in on_time
        if BEFORE_S <= float(r["at"]) < BEFORE_S + FLOOD_S  # type: ignore[arg-type]
        and r["model"] == "full-v18"
    )
    lumen_ms = sum(
        held_ms(r)
        for r in flooder
        if r["status"] == "OK" and r["model"] == "full-v18"  # the fallback runs on its own devices
    )
    share_plus_idle = max(envelope_ms / 3.0, envelope_ms - orchid_ms)
    assert lumen_ms <= 1.15 * share_plus_idle, (lumen_ms, share_plus_idle, orchid_ms)
