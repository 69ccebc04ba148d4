"""Every ladder step's effect, end to end against the real example Triton.

The ladder's *decision* is tested as a pure state machine in test_overload.py. Here the
pool's ladder is pinned to a step (its periodic update switched off) so that each step's
*effect* on real requests can be observed: output capped at step 2, part of the eligible
work served by the fallback at step 3, batch work deferred at step 4, the excess of online
work refused early at steps 5 and 6 while the rest is served."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.backends.local import LocalTriton
from gateway.core.overload import FlowDemand, LadderState, LadderStep, LoadEvidence, plan_flows
from tests.conftest import ORCHID_KEY, TIME_FACTOR, ThreadedGateway

AUTH = (("authorization", f"Bearer {ORCHID_KEY}"),)
POOL = "local/full-v18"
PROTECTED = 2800.0  # 4 instances x 0.70 x 1000 ms/s


def request(n: int = 64, **params: Any) -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(model_name="full-v18")
    tensor = req.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([1, n])
    req.raw_input_contents.append(np.arange(n, dtype=np.int32).tobytes())
    for key, value in params.items():
        if isinstance(value, bool):
            req.parameters[key].bool_param = value
        elif isinstance(value, int):
            req.parameters[key].int64_param = value
        else:
            req.parameters[key].string_param = value
    return req


def pin(
    running: ThreadedGateway, step: int, utilization: float, *, lumen: float = 0.0, pool: str = POOL
) -> None:
    """Pin the pool's ladder at ``step`` and its flows' demand (orchid's interactive flow at
    ``utilization`` of the envelope, lumen's at ``lumen``), planned by the production planner."""
    gw = running.server.gateway
    assert gw is not None

    def apply() -> None:
        load = gw.loads[pool]
        now = time.monotonic()
        load.ladder.state = LadderState(LadderStep(step), False, "pinned by the test", False, now)
        load.evidence = LoadEvidence(
            now=now,
            evidence_at=now,
            offered_ms_per_s=(utilization + lumen) * PROTECTED,
            protected_capacity_ms_per_s=PROTECTED,
            healthy_devices=4,
            configured_devices=4,
        )
        orchid = load.flow("interactive", "orchid", weight=2.0, class_weight=1.0)
        demands = [FlowDemand(orchid.key, utilization * PROTECTED, 2.0, 1.0)]
        if lumen:
            demands.append(FlowDemand(("interactive", "lumen"), lumen * PROTECTED, 1.0, 1.0))
        plans = plan_flows(
            demands,
            {},
            capacity_ms_per_s=PROTECTED,
            step=LadderStep(step),
            reduce_saving=load.reduce_saving,
            fallback_saving=load.saving,
        )
        orchid.plan = plans[orchid.key]

    running.call_soon(apply)


def outcomes(stub: service_pb2_grpc.GRPCInferenceServiceStub, n: int, **params: Any) -> Counter[str]:
    seen: Counter[str] = Counter()
    for _ in range(n):
        try:
            reply = stub.ModelInfer(request(**params), metadata=AUTH, timeout=10)
            seen[f"ok:{reply.parameters['orchid.approximation'].string_param}"] += 1
        except grpc.RpcError as error:
            trailing = dict(error.trailing_metadata() or ())
            assert int(trailing.get("retry-after-ms", "0")) > 0, "a shed request says when to retry"
            seen[f"{error.code().name}:{trailing.get('orchid-rule')}"] += 1
    return seen


def test_each_step_has_its_effect(pinned: ThreadedGateway, monkeypatch: pytest.MonkeyPatch) -> None:
    core = pinned.server.gateway
    assert core is not None
    settled: list[Any] = []
    original = core.listener.settled
    monkeypatch.setattr(core.listener, "settled", lambda s: (settled.append(s), original(s)))
    with grpc.insecure_channel(pinned.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        first = stub.ModelInfer(request(), metadata=AUTH, timeout=10)  # creates the pool's load
        assert first.parameters["orchid.ladder_step"].int64_param == 0

        # Step 2 inside the envelope: the step alone degrades nothing; there is no excess.
        pin(pinned, 2, 0.95)
        assert outcomes(stub, 10, **{"orchid.max_output_tokens": 64}) == Counter({"ok:none": 10})

        # Step 2 just over the envelope: only a share of requests gets the reduced output,
        # just enough to bring demand back inside.
        pin(pinned, 2, 1.05)
        seen2 = outcomes(stub, 20, **{"orchid.max_output_tokens": 64})
        assert 1 <= seen2["ok:reduced_output"] <= 12 and seen2["ok:none"] >= 8, seen2
        assert sum(seen2.values()) == 20

        # Step 2 at 130 % of the envelope: every request the route has evidence for is capped at
        # the route's reduced length (quality evidence 0.89 >= floor 0.84).
        pin(pinned, 2, 1.3)
        reply = stub.ModelInfer(request(**{"orchid.max_output_tokens": 64}), metadata=AUTH, timeout=10)
        assert reply.parameters["orchid.approximation"].string_param == "reduced_output"
        assert reply.parameters["orchid.ladder_step"].int64_param == 2
        assert "overload-reduce-output" in reply.parameters["orchid.rules"].string_param
        assert list(reply.outputs[0].shape) == [1, 32]  # Triton really generated 32 tokens
        # ... and it is priced as what ran, 32 tokens: the estimator compares like with like.
        record = settled[-1].record
        assert record.shape.max_output_tokens == 32
        decode_per_token = 0.41875 * TIME_FACTOR * record.demand.correction  # full-v18's profile
        assert record.demand.decode_ms == pytest.approx(32 * decode_per_token, rel=0.01)

        # Step 3 at 122 % of the envelope: part of the eligible work goes to the warm fallback.
        pin(pinned, 3, 1.22)
        seen = outcomes(stub, 24, **{"orchid.max_output_tokens": 16})
        assert seen["ok:fallback"] > 0 and seen["ok:none"] > 0, seen
        assert sum(seen.values()) == seen["ok:fallback"] + seen["ok:none"]  # nothing refused

        # Step 4: batch work is deferred with a computed retry-after; online work still runs.
        pin(pinned, 4, 1.15)
        assert outcomes(stub, 3, **{"orchid.class": "batch"}) == Counter(
            {"RESOURCE_EXHAUSTED:ladder.defer_batch": 3}
        )
        assert (
            outcomes(stub, 3, **{"orchid.max_output_tokens": 16})["RESOURCE_EXHAUSTED:ladder.defer_batch"]
            == 0
        )

        # Step 5 at twice the envelope: about half of new online work is refused early (callers
        # who opted out of the fallback), the rest served.
        no_fallback = {"orchid.max_output_tokens": 16, "orchid.allow_fallback": False}
        pin(pinned, 5, 2.0)
        seen = outcomes(stub, 40, **no_fallback)
        shed = seen["RESOURCE_EXHAUSTED:overload-reject-interactive"]
        assert 12 <= shed <= 28, seen
        assert seen["ok:none"] + shed == 40

        # A shed request that may use the fallback is judged by the fallback's own pool: it is
        # answered there (degraded, and saying why), not refused.
        seen = outcomes(stub, 20, **{"orchid.max_output_tokens": 16})
        assert seen["ok:fallback"] >= 5 and seen["ok:none"] + seen["ok:fallback"] == 20, seen

        # Step 5 with a tenant inside its share beside: orchid borrows what lumen leaves idle.
        # Step 6 lends nothing: orchid is held to its own weighted share (2/3), more is refused.
        pin(pinned, 5, 2.0, lumen=0.2)
        seen5 = outcomes(stub, 60, **no_fallback)
        pin(pinned, 6, 2.0, lumen=0.2)
        seen6 = outcomes(stub, 60, **no_fallback)
        shed5 = seen5["RESOURCE_EXHAUSTED:overload-reject-interactive"]
        shed6 = seen6["RESOURCE_EXHAUSTED:overload-reject-interactive"]
        # Admitted shares: step 5 (1 - 0.2) / 2.0 = 40 %, step 6 (2/3) / 2.0 = 33 %.
        assert 60 - shed5 == pytest.approx(24, abs=2) and 60 - shed6 == pytest.approx(20, abs=2)
        assert shed5 < shed6 < 60, (seen5, seen6)


def test_step_5_sheds_the_excess_of_new_streams_as_of_online_work(pinned: ThreadedGateway) -> None:
    """A new stream is new work: at step 5 the excess of a flow's new streams is refused early by
    the ladder's own rule with retry guidance, the rest admitted (issue 28: streams were never
    shed). The stream pool has no fallback."""
    from tests.test_protocol import _stream_tokens

    def stream() -> str:
        replies = _stream_tokens(
            pinned.address,
            dict(AUTH),
            "full-v18-stream",
            16,
            2,
            parameters={"orchid.max_output_tokens": 2},
        )
        if any(isinstance(r, Exception) for r in replies):
            (error,) = replies
            return str(error)
        return "ok"

    assert stream() == "ok"  # creates the stream pool's load
    pin(pinned, 5, 2.0, pool="local/full-v18-stream")
    seen = Counter(stream() for _ in range(30))
    shed = sum(n for text, n in seen.items() if "shedding new streaming work" in text)
    assert "RESOURCE_EXHAUSTED" in next(text for text in seen if text != "ok"), seen
    # Admitted share at twice the envelope: 1 / 2.0 = 50 %.
    assert 8 <= shed <= 22 and seen["ok"] + shed == 30, seen


def test_step_1_stops_shadow_traffic(pinned: ThreadedGateway, triton: LocalTriton) -> None:
    """The route mirrors 5 % of eligible requests to the candidate full-v19 (answers discarded,
    own instances, same cell); from ladder step 1 the mirror stops."""
    import tritonclient.grpc as grpcclient

    def candidate_inferences() -> int:
        stats = grpcclient.InferenceServerClient(triton.address).get_inference_statistics("full-v19")
        return int(stats.model_stats[0].inference_count)

    gw = pinned.server.gateway
    assert gw is not None
    with grpc.insecure_channel(pinned.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        if POOL not in gw.loads:  # run alone: create the pool's load first
            stub.ModelInfer(request(), metadata=AUTH, timeout=10)
        pin(pinned, 0, 0.5)
        before_sent, before = gw.shadows.sent, candidate_inferences()
        replies = [
            stub.ModelInfer(request(**{"orchid.max_output_tokens": 8}), metadata=AUTH, timeout=10)
            for _ in range(60)
        ]
        assert all(
            r.parameters["orchid.model"].string_param == "full-v18" for r in replies
        )  # answers unchanged
        sent = gw.shadows.sent - before_sent
        assert 2 <= sent <= 4  # 5 % of 60
        deadline = time.monotonic() + 5
        while candidate_inferences() - before < sent and time.monotonic() < deadline:
            time.sleep(0.05)
        assert candidate_inferences() - before == sent  # they really ran on the candidate

        pin(pinned, 1, 0.86)
        before_sent = gw.shadows.sent
        for _ in range(60):
            stub.ModelInfer(request(**{"orchid.max_output_tokens": 8}), metadata=AUTH, timeout=10)
        assert gw.shadows.sent == before_sent  # step 1: no shadow traffic
