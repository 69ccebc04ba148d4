"""Telemetry and provenance off the hot path (issue 31 item 4): their outputs unchanged.

``/metrics`` is byte-for-byte what it was when each metric was a prometheus_client
``Counter``/``Histogram`` fed per request (issue 31: the request path now feeds plain
accumulators that the collector reads at scrape time).

The golden files in ``tests/data`` were generated with the earlier implementation
(``python -m tests.test_metrics_golden`` rewrites them: only do that for a deliberate change
of the exposition). Two sequences:

* ``metrics_golden_events.txt``: a fixed sequence of listener events (decisions, failures,
  settled requests, streams, ladder steps) with fixed values: every sample exact, only the
  ``_created`` timestamps normalised;
* ``metrics_golden_gateway.txt``: a fixed sequence of requests through an in-process gateway
  on ``MemoryBackend`` (the example stack, as ``bench/request_path.py``): the series, their
  order and every count exact; values that follow the wall clock (latencies, charges, the
  pools' rates) normalised.

Provenance is merged into a response as pre-serialised ``parameters`` entries
(``gateway.messages.attach_provenance``): what it writes is what writing each value of
``provenance(settled)`` into the map wrote, on an empty response and over one that already
holds those keys (hypothesis over the values).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import sys
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY, generate_latest
from tritonclient.grpc import service_pb2

from gateway import clock
from gateway.config import TelemetryConfig, hash_api_key, load_gateway_config
from gateway.core.errors import GatewayError
from gateway.core.evidence import Evidence, EvidenceKey
from gateway.core.record import (
    Approximation,
    Budget,
    Decision,
    Demand,
    Identity,
    Mode,
    Outcome,
    RequestRecord,
    Shape,
    Verdict,
)
from gateway.core.streaming import StreamObjectives, StreamSummary
from gateway.core.upstream import FeatureSnapshot
from gateway.exchange import CallContext, Settled
from gateway.messages import _write, attach_provenance, encode_parameters, provenance
from gateway.policy.decision_log import DecisionLog
from gateway.policy.snapshot import PolicyResult
from gateway.server import assemble_gateway, load_configuration, load_policies
from gateway.statusboard import StatusBoard
from gateway.telemetry import ListenerGroup, Telemetry
from orchid_tools.harness import memory_example
from orchid_tools.simulate import minted_key

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
EVENTS_GOLDEN = DATA / "metrics_golden_events.txt"
GATEWAY_GOLDEN = DATA / "metrics_golden_gateway.txt"

_CREATED = re.compile(r"^(\w+_created(?:\{.*\})?) \S+$", re.MULTILINE)

# Families whose values follow the wall clock in a live run (their series and counts do not).
_TIMED = (
    "orchid_queue_dwell_seconds",
    "orchid_first_result_seconds",
    "orchid_completion_seconds",
    "orchid_charged_accelerator_ms",
    # The estimator's correction learns from observed (timed) work.
    "orchid_predicted_accelerator_ms",
    "orchid_observed_over_predicted",
    "orchid_pool_",
    "orchid_feature_upstream_reserve_ms",
)
# Whether a live request met its deadline follows the machine's speed: kept out.
_UNTIMED_OUTCOME = ("orchid_deadline_misses", "orchid_validated_successes")


def _quiet_logger() -> logging.Logger:
    logger = logging.getLogger("orchid.test.golden-decisions")
    logger.setLevel(logging.WARNING)
    return logger


def _telemetry(*, tenant_labels: bool) -> Telemetry:
    telemetry = Telemetry(
        TelemetryConfig(tenant_labels=tenant_labels, trace_sample_ratio=0.0),
        decision_log=DecisionLog(_quiet_logger()),
    )
    # The process-wide registry (process collectors, the policy store's metrics) is not ours.
    telemetry.metrics.registry.unregister(REGISTRY)
    return telemetry


def _exposition(telemetry: Telemetry) -> str:
    return _CREATED.sub(r"\1 <created>", generate_latest(telemetry.metrics.registry).decode())


# ------------------------------------------------------------------ fixed events


def _record(
    request_id: str,
    tenant: str,
    request_class: str,
    model: str,
    bucket: str,
    *,
    deadline_ms: float,
    prefill_ms: float,
    tokens: int = 256,
    items: int = 1,
) -> RequestRecord:
    return RequestRecord(
        identity=Identity(request_id, tenant, request_class, model, "1", "ModelInfer", Mode.ONLINE, "eu"),
        shape=Shape(items=items, input_tokens=tokens, max_output_tokens=8, bucket=bucket),
        demand=Demand(prefill_ms=prefill_ms, decode_ms=0.0),
        budget=Budget(deadline_ms, 0.0, 12.0, 2.0, 15.0, 0.0),
    )


def _stream(first: float | None, gaps: tuple[float, ...], over: int, met: bool) -> StreamSummary:
    return StreamSummary(
        objectives=StreamObjectives(first_result_ms=50.0, completion_ms=900.0, gap_ms=40.0),
        results=len(gaps) + (1 if first is not None else 0),
        first_result_ms=first,
        last_result_ms=first,
        max_gap_ms=max(gaps, default=0.0),
        mean_gap_ms=0.0,
        gaps_over_objective=over,
        elapsed_ms=100.0,
        finished=True,
        gaps_ms=gaps,
    )


def drive_events(telemetry: Telemetry) -> None:
    """A fixed sequence of every event the listener takes, with values that hit bucket bounds,
    the +Inf bucket, zero demand (no ratio), misses and successes, several tenants."""
    policy = PolicyResult(policy_version="sha256:golden", allowed=True)
    classes = ("interactive", "batch", "interactive", "bulk")
    models = ("full-v18", "lite-v3", "full-v18")
    tenants = ("orchid", "acme", "orchid", "umbra", "acme")
    buckets = ("short", "long", "short")
    for i in range(60):
        request_class, model = classes[i % 4], models[i % 3]
        tenant, bucket = tenants[i % 5], buckets[i % 3]
        prefill = 0.0 if i % 11 == 0 else 1.5 + (i % 7) * 0.75
        record = _record(
            f"r{i}",
            tenant,
            request_class,
            model,
            bucket,
            deadline_ms=200.0 if i % 6 else 4.0,
            prefill_ms=prefill,
            tokens=64 * (1 + i % 5),
            items=1 + i % 2,
        )
        if i % 9 == 4:
            rule = ("tenant-rate", "shed-bulk")[i % 2]
            rejected = Decision(Verdict.REJECT, model, "rule", rules=(rule,), status="RESOURCE_EXHAUSTED")
            telemetry.decided(record, rejected, policy)
            telemetry.failed("RESOURCE_EXHAUSTED", rule)
            continue
        verdict = Verdict.FALLBACK if i % 8 == 3 else Verdict.ADMIT
        served = "lite-v3" if verdict is Verdict.FALLBACK else model
        decision = Decision(
            verdict,
            served,
            "fallback" if verdict is Verdict.FALLBACK else "primary",
            approximation=Approximation.FALLBACK if verdict is Verdict.FALLBACK else Approximation.NONE,
        )
        telemetry.decided(record, decision, policy)
        queue_ms = (0.0, 1.0, 2.5, 10.0, 37.5, 200.0, 45000.0)[i % 7]
        completion_ms = (0.4, 5.0, 20.0, 99.0, 500.0)[i % 5]
        observed = prefill * (0.5, 1.0, 1.25, 3.0, 12.0)[i % 5]
        outcome = Outcome(
            True,
            "OK",
            backend_model=served,
            queue_ms=queue_ms,
            first_result_ms=completion_ms / 2,
            completion_ms=completion_ms,
            observed_accelerator_ms=observed,
            charged_accelerator_ms=observed * 1.1,
        )
        settled = Settled(record, decision, outcome)
        telemetry.settled(settled)
        if i % 5 == 2:
            telemetry.stream_settled(
                settled,
                _stream(
                    None if i % 15 == 2 else 12.0 + i,
                    tuple(0.001 * (j + 1) * (i + 3) for j in range(i % 4)),
                    i % 3,
                    i % 2 == 0,
                ),
            )
        if i % 13 == 0:
            telemetry.ladder(f"pool-{i % 2}", i % 7)
        if i % 17 == 5:
            telemetry.failed("DEADLINE_EXCEEDED", "")
    telemetry.failed("UNAVAILABLE", "")


def events_exposition() -> str:
    out = []
    for tenant_labels in (True, False):
        telemetry = _telemetry(tenant_labels=tenant_labels)
        drive_events(telemetry)
        out.append(f"### tenant_labels={tenant_labels}\n" + _exposition(telemetry))
    return "".join(out)


# ------------------------------------------------------------------ a live gateway


async def _gateway_run() -> str:
    config = load_gateway_config(REPO / "examples" / "orchid" / "gateway.yaml")
    tenants, routes = load_configuration(config)
    orchid = tenants.tenants["orchid"].model_copy(
        update={"key_sha256": (hash_api_key(minted_key("orchid")),)}
    )
    tenants = tenants.model_copy(update={"tenants": {**tenants.tenants, "orchid": orchid}})
    _, handle = memory_example(config, routes)
    telemetry = _telemetry(tenant_labels=True)
    board = StatusBoard()
    gateway = await assemble_gateway(
        config,
        tenants,
        routes,
        {"local": handle},
        load_policies(config),
        listener=ListenerGroup(telemetry, board),
    )
    telemetry.bind(gateway)
    board.bind(gateway)
    good = (("authorization", f"Bearer {minted_key('orchid')}"),)
    bad = (("authorization", "Bearer not-a-key"),)

    def request(model: str, tokens: int, max_output: int | None) -> bytes:
        message = service_pb2.ModelInferRequest(model_name=model)
        message.inputs.add(name="INPUT_IDS", datatype="INT32", shape=[1, tokens])
        message.raw_input_contents.append(np.arange(tokens, dtype=np.int32).tobytes())
        if max_output is not None:
            message.parameters["orchid.max_output_tokens"].int64_param = max_output
        return message.SerializeToString()

    sequence = [
        (request("full-v18", 256, 1), good),
        (request("full-v18", 64, 4), good),
        (request("full-v18", 1024, None), good),
        (request("no-such-model", 16, 1), good),
        (request("full-v18", 256, 1), bad),
    ]
    for step in range(24):
        raw, metadata = sequence[step % len(sequence)]
        with contextlib.suppress(GatewayError):
            await gateway.infer(
                raw, CallContext(metadata=metadata, time_remaining_s=None, received_at=clock.now())
            )
    return _exposition(telemetry)


def _normalise_timed(text: str) -> str:
    lines = []
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if line.startswith("#"):
            name = line.split(" ")[2]
        if name.startswith(_UNTIMED_OUTCOME):
            continue
        if not line.startswith("#") and name.startswith(_TIMED) and not name.endswith(("_count", "_created")):
            line = line.rsplit(" ", 1)[0] + " <timed>"
        lines.append(line)
    return "\n".join(lines) + "\n"


def gateway_exposition() -> str:
    return _normalise_timed(asyncio.run(_gateway_run()))


# ------------------------------------------------------------------ the tests


def test_event_sequence_exposition_is_the_golden_one() -> None:
    assert events_exposition() == EVENTS_GOLDEN.read_text()


def test_live_gateway_exposition_is_the_golden_one() -> None:
    assert gateway_exposition() == GATEWAY_GOLDEN.read_text()


# ------------------------------------------------------------------ provenance


def _parameters(response: service_pb2.ModelInferResponse) -> dict[str, tuple[str | None, object]]:
    return {
        key: (
            value.WhichOneof("parameter_choice"),
            getattr(value, value.WhichOneof("parameter_choice") or "", None),
        )
        for key, value in response.parameters.items()
    }


_VALUES = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=300),
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=150), _VALUES, max_size=8), st.booleans())
def test_encoded_parameters_merge_as_written(
    values: dict[str, str | int | float | bool], prefilled: bool
) -> None:
    written, merged = service_pb2.ModelInferResponse(id="x"), service_pb2.ModelInferResponse(id="x")
    if prefilled:  # an entry of the same key is replaced, whatever field it held
        for response in (written, merged):
            for key in values:
                response.parameters[key].uint64_param = 7
            response.parameters["other"].string_param = "kept"
    _write(written, values)
    merged.MergeFromString(encode_parameters(values))
    assert _parameters(merged) == _parameters(written)
    assert merged.id == "x"


@settings(max_examples=120, deadline=None)
@given(
    fallback=st.booleans(),
    reduced=st.booleans(),
    evidence=st.sampled_from([None, 1_700_000_000.0, "undated"]),
    operation=st.sampled_from(["", "op-1"]),
    features=st.booleans(),
    stream=st.booleans(),
    complete=st.booleans(),
    step=st.integers(min_value=0, max_value=6),
    predicted=st.floats(min_value=0.0, max_value=1e6),
    charged=st.floats(min_value=0.0, max_value=1e6),
)
def test_attached_provenance_is_the_provenance_written(
    fallback: bool,
    reduced: bool,
    evidence: float | str | None,
    operation: str,
    features: bool,
    stream: bool,
    complete: bool,
    step: int,
    predicted: float,
    charged: float,
) -> None:
    record = _record(
        "r-1", "orchid", "interactive", "full-v18", "short", deadline_ms=200.0, prefill_ms=predicted
    )
    identity = record.identity
    record = RequestRecord(
        identity=Identity(
            identity.request_id,
            identity.tenant,
            identity.request_class,
            identity.model,
            "2",
            identity.operation,
            identity.mode,
            identity.privacy_cell,
            risk_class="elevated" if step % 2 else "standard",
            operation_id=operation,
        ),
        shape=record.shape,
        demand=record.demand,
        budget=record.budget,
        ladder_step=step,
    )
    decision = Decision(
        Verdict.FALLBACK if fallback else Verdict.ADMIT,
        "lite-v3" if fallback else "full-v18",
        "fallback" if fallback else "primary",
        approximation=Approximation.FALLBACK if fallback else Approximation.NONE,
        rules=("shed-bulk", "cap") if reduced else (),
        policy_version="sha256:p",
        max_output_tokens=4 if reduced else None,
        ladder_step=step,
    )
    proof = (
        None
        if evidence is None
        else Evidence(
            EvidenceKey("full-v18", "2", "eu-support"),
            0.9,
            500,
            "quality-team",
            evaluated_at=evidence if isinstance(evidence, float) else None,
        )
    )
    snapshot = FeatureSnapshot(
        "v12", 1_700_000_000.5 if step % 2 else None, ("a", "b") if step > 3 else (), True
    )
    outcome = Outcome(True, "OK", complete=complete, charged_accelerator_ms=charged)
    settled = Settled(record, decision, outcome, evidence=proof, features=snapshot if features else None)
    summary = _stream(12.5, (0.01, 0.05), 1, True) if stream else None
    for _ in range(2):  # the template's first build, then the cached one
        written, attached = service_pb2.ModelInferResponse(), service_pb2.ModelInferResponse()
        _write(written, provenance(settled, summary))
        attach_provenance(attached, settled, summary)
        assert _parameters(attached) == _parameters(written)


if __name__ == "__main__":
    DATA.mkdir(exist_ok=True)
    EVENTS_GOLDEN.write_text(events_exposition())
    GATEWAY_GOLDEN.write_text(gateway_exposition())
    sys.stdout.write(f"wrote {EVENTS_GOLDEN} and {GATEWAY_GOLDEN}\n")
