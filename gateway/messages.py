"""The KServe message edge of the request path: decoding a request's bytes, the provenance
a response carries, and the error reply a stream sends for one failed request.

Every RPC decodes its own bytes (``decode``) after authenticating the caller, so a
message that is not valid protobuf (a model name that is not UTF-8, a truncated field)
answers INVALID_ARGUMENT with one bounded log line, never grpc's UNKNOWN and traceback.

Provenance (``orchid.*`` response parameters) is the caller's record of what ran:
model and version, route reason, approximation, whether the answer is complete, policy
version and rules, ladder step, predicted and charged accelerator-ms. It never carries
another tenant's data or payload.

- ``orchid.approximation``: the degradations that applied, comma-separated in the order
  ``fallback,reduced_output``, or ``none``.
- ``orchid.risk_class``: the request's resolved risk class (``gateway.core.risk``).
- ``orchid.evidence_population``, ``orchid.evidence_at``, ``orchid.evidence_owner``: on a
  degraded answer (fallback, or the output capped at the route's reduced length), the
  quality evidence it rests on: its evaluation population, its evaluation date (ISO 8601
  UTC, or ``undated`` for evidence a route file seeded without a date) and its owner.
- ``orchid.operation_id``: the caller's operation id, when it sent one; an answer a retry
  got from an earlier attempt of the same operation (``gateway.idempotent``) is that
  attempt's, with ``orchid.operation_reused`` true.
- ``orchid.complete``: false when the answer is partial: a stream's responses before
  its final one, a stream request that failed midway (its error reply), and any answer
  whose output limit policy or the overload ladder reduced below what the caller asked
  (the output may have been cut).

A stream's (ModelStreamInfer) objectives and how its results met them
(``gateway.core.streaming``), on a response given a ``StreamSummary``:

- ``orchid.first_result_ms``: arrival at the gateway to the first result (absent until one
  arrived); ``orchid.first_result_deadline_ms`` its objective; ``orchid.first_result_met``;
- ``orchid.max_gap_ms``: the longest time between two results so far, ``orchid.gaps`` how
  many gaps there were; ``orchid.gap_objective_ms`` the objective (absent without one),
  ``orchid.gap_objective_met`` (true when no gap was over it) and
  ``orchid.gaps_over_objective``.

A stream's partial responses carry the provenance of the request's admission, built once
when it starts (``partial_template``) and merged into each (``attach_partial``), with
``orchid.complete=false`` and ``orchid.gap_ms`` (the gap before this result); nothing is
settled per result. The charge (``orchid.charged_accelerator_ms``) and the stream's
objectives come on its final response (ask for it with
``triton_enable_empty_final_response``).
"""

from __future__ import annotations

import logging
import struct
from datetime import UTC, datetime
from typing import TYPE_CHECKING, TypeVar

from google.protobuf.message import DecodeError, Message
from tritonclient.grpc import service_pb2

from gateway.core.errors import GatewayError, InvalidArgument
from gateway.core.record import Approximation, Decision, RequestRecord
from gateway.core.streaming import StreamSummary
from gateway.status import bounded

if TYPE_CHECKING:
    from gateway.core.evidence import Evidence
    from gateway.exchange import Settled

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)


def decode(message_type: type[M], raw: bytes, *, quiet: bool = False) -> M:
    """Parse ``raw`` as ``message_type``; INVALID_ARGUMENT if it is not valid protobuf. Call it
    after authentication: each refusal writes one bounded log line (type and size, never
    the bytes), unless ``quiet`` (the unauthenticated health RPCs)."""
    request: M = message_type()
    try:
        request.ParseFromString(raw)
    except DecodeError:
        name = message_type.DESCRIPTOR.name
        if not quiet:
            log.info("refused a malformed %s (%d bytes): INVALID_ARGUMENT", name, len(raw))
        raise InvalidArgument(
            f"malformed {name}: the message is not valid protobuf (truncated, or a string field "
            "that is not UTF-8)"
        ) from None
    return request


def encode(message: Message) -> bytes:
    """A reply's wire bytes (the services' ``response_serializer``)."""
    data: bytes = message.SerializeToString()
    return data


def parse_infer_request(raw: bytes) -> service_pb2.ModelInferRequest:
    request: service_pb2.ModelInferRequest = decode(service_pb2.ModelInferRequest, raw)
    if not request.model_name:
        raise InvalidArgument("model_name is required")
    return request


def approximation(decision: Decision) -> str:
    """The degradations that applied: ``fallback``, ``reduced_output``, both (comma-separated,
    in that order) or ``none``."""
    applied = []
    if decision.approximation is Approximation.FALLBACK:
        applied.append(str(Approximation.FALLBACK))
    if decision.max_output_tokens is not None or decision.approximation is Approximation.REDUCED_OUTPUT:
        applied.append(str(Approximation.REDUCED_OUTPUT))
    return ",".join(applied) or str(Approximation.NONE)


def stream_provenance(stream: StreamSummary) -> dict[str, str | int | float | bool]:
    """A stream's objectives and how its results met them so far (see the module docstring)."""
    objectives = stream.objectives
    out: dict[str, str | int | float | bool] = {
        "orchid.first_result_deadline_ms": round(objectives.first_result_ms, 3),
        "orchid.first_result_met": stream.first_result_met,
        "orchid.max_gap_ms": round(stream.max_gap_ms, 3),
        "orchid.gaps": stream.gaps,
        "orchid.gap_objective_met": stream.gap_objective_met,
        "orchid.gaps_over_objective": stream.gaps_over_objective,
    }
    if stream.first_result_ms is not None:
        out["orchid.first_result_ms"] = round(stream.first_result_ms, 3)
    if objectives.gap_ms is not None:
        out["orchid.gap_objective_ms"] = round(objectives.gap_ms, 3)
    return out


def _static_provenance(
    record: RequestRecord, decision: Decision, evidence: Evidence | None
) -> dict[str, str | int | float | bool]:
    """What provenance says of a request that depends only on its route, version, policy and
    ladder (``_STATIC_KEY``), not on the request itself: built once, pre-serialised."""
    out: dict[str, str | int | float | bool] = {
        "orchid.model": decision.target_model,
        "orchid.model_version": record.identity.model_version,
        "orchid.route_reason": decision.route_reason,
        "orchid.approximation": approximation(decision),
        "orchid.policy_version": decision.policy_version,
        "orchid.rules": ",".join(decision.rules),
        # The step that decided (the requested model's pool); a fallback answer also says its
        # own pool's step: the fallback's pool at 0 says nothing about the primary's.
        "orchid.ladder_step": decision.ladder_step,
        "orchid.risk_class": record.identity.risk_class,
    }
    if decision.approximation is Approximation.FALLBACK:
        out["orchid.fallback_ladder_step"] = record.ladder_step
    if evidence is not None:
        out["orchid.evidence_population"] = evidence.key.population
        out["orchid.evidence_at"] = (
            datetime.fromtimestamp(evidence.evaluated_at, UTC).isoformat(timespec="seconds")
            if evidence.evaluated_at is not None
            else "undated"
        )
        out["orchid.evidence_owner"] = evidence.owner
    return out


def decision_provenance(
    record: RequestRecord, decision: Decision, evidence: Evidence | None
) -> dict[str, str | int | float | bool]:
    """What provenance says of a request from its admission alone (no outcome yet)."""
    out = _static_provenance(record, decision, evidence)
    out["orchid.predicted_accelerator_ms"] = round(record.demand.accelerator_ms, 3)
    out["orchid.request_id"] = record.identity.request_id
    if record.identity.operation_id:
        out["orchid.operation_id"] = record.identity.operation_id
    return out


def provenance(settled: Settled, stream: StreamSummary | None = None) -> dict[str, str | int | float | bool]:
    """The whole provenance of a settled request (``attach_provenance`` merges it in)."""
    out = decision_provenance(settled.record, settled.decision, settled.evidence)
    out["orchid.complete"] = settled.outcome.complete
    out["orchid.charged_accelerator_ms"] = round(settled.outcome.charged_accelerator_ms, 3)
    if settled.features is not None:
        out.update(settled.features.provenance())
    if stream is not None:
        out.update(stream_provenance(stream))
    return out


def partial_template(
    record: RequestRecord, decision: Decision, evidence: Evidence | None
) -> service_pb2.ModelInferResponse:
    """A stream request's partial-response provenance, built once when it starts: its
    admission's provenance and ``orchid.complete=false``; each partial response merges it
    (``attach_partial``). The charge and the stream's objectives come on the final response."""
    template = service_pb2.ModelInferResponse()
    values = decision_provenance(record, decision, evidence)
    values["orchid.complete"] = False
    _write(template, values)
    return template


def _write(response: service_pb2.ModelInferResponse, values: dict[str, str | int | float | bool]) -> None:
    for key, value in values.items():
        param = response.parameters[key]
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int):
            param.int64_param = value
        elif isinstance(value, float):
            param.double_param = value
        else:
            param.string_param = value


# ------------------------------------------------------------------ provenance as bytes
#
# A response's provenance is merged into it as serialised ``ModelInferResponse.parameters``
# map entries (``MergeFromString``: an entry replaces one of the same key, as ``_write`` would
# set it): the part that depends only on the route, version, policy and ladder is serialised
# once (``_static_bytes``), the per-request values (request id, predicted and charged ms,
# completeness, features, a stream's objectives) are encoded here, and the response takes
# both in one merge instead of a dozen map writes through the protobuf runtime.

_PARAMETERS_TAG = bytes(
    [(service_pb2.ModelInferResponse.DESCRIPTOR.fields_by_name["parameters"].number << 3) | 2]
)
_DOUBLE = struct.Struct("<d")
_U64 = (1 << 64) - 1
# At most this many static provenance templates are kept; a full cache starts over.
MAX_TEMPLATES = 4096
_templates: dict[tuple[object, ...], bytes] = {}


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _length_delimited(tag: bytes, data: bytes) -> bytes:
    size = len(data)
    return tag + (bytes((size,)) if size < 0x80 else _varint(size)) + data


def _parameter(value: str | int | float | bool) -> bytes:
    """An ``InferParameter`` with ``value`` in the field ``_write`` would set."""
    if isinstance(value, bool):
        return b"\x08\x01" if value else b"\x08\x00"
    if isinstance(value, int):
        return b"\x10" + _varint(value & _U64)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE.pack(value)
    return _length_delimited(b"\x1a", value.encode())


def encode_parameters(values: dict[str, str | int | float | bool]) -> bytes:
    """``values`` as serialised ``ModelInferResponse.parameters`` entries: what
    ``response.MergeFromString`` of them writes is what ``_write(response, values)`` writes."""
    return b"".join(
        _length_delimited(
            _PARAMETERS_TAG,
            _length_delimited(b"\x0a", key.encode()) + _length_delimited(b"\x12", _parameter(value)),
        )
        for key, value in values.items()
    )


def _key_field(key: str) -> bytes:
    return _length_delimited(b"\x0a", key.encode())


def _double_prefix(key: str) -> bytes:
    """An entry of ``key`` with a double value, less the value's 8 bytes (fixed length)."""
    body = _key_field(key) + b"\x12\x09\x21"
    return _PARAMETERS_TAG + _varint(len(body) + 8) + body


def _string_entry(key_field: bytes, value: str) -> bytes:
    body = key_field + _length_delimited(b"\x12", _length_delimited(b"\x1a", value.encode()))
    return _length_delimited(_PARAMETERS_TAG, body)


_PREDICTED = _double_prefix("orchid.predicted_accelerator_ms")
_CHARGED = _double_prefix("orchid.charged_accelerator_ms")
_REQUEST_ID = _key_field("orchid.request_id")
_OPERATION_ID = _key_field("orchid.operation_id")
_COMPLETE = {flag: encode_parameters({"orchid.complete": flag}) for flag in (False, True)}


def _static_bytes(settled: Settled) -> bytes:
    record, decision, evidence = settled.record, settled.decision, settled.evidence
    identity = record.identity
    fallback = decision.approximation is Approximation.FALLBACK
    key = (
        decision.target_model,
        identity.model_version,
        decision.route_reason,
        decision.approximation,
        decision.max_output_tokens is None,
        decision.policy_version,
        decision.rules,
        decision.ladder_step,
        identity.risk_class,
        record.ladder_step if fallback else None,
        evidence,
    )
    static = _templates.get(key)
    if static is None:
        if len(_templates) >= MAX_TEMPLATES:
            _templates.clear()
        static = _templates[key] = encode_parameters(_static_provenance(record, decision, evidence))
    return static


def attach_provenance(
    response: service_pb2.ModelInferResponse, settled: Settled, stream: StreamSummary | None = None
) -> None:
    """The whole provenance (``provenance``); with ``stream`` (a stream's ``GapTracker``
    summary, final or so far) also its objectives and how its results met them. The static
    part is a pre-serialised template; the rest is encoded per request; one merge."""
    record, outcome = settled.record, settled.outcome
    identity = record.identity
    parts = [
        _static_bytes(settled),
        _PREDICTED + _DOUBLE.pack(round(record.demand.accelerator_ms, 3)),
        _string_entry(_REQUEST_ID, identity.request_id),
        _COMPLETE[outcome.complete],
        _CHARGED + _DOUBLE.pack(round(outcome.charged_accelerator_ms, 3)),
    ]
    if identity.operation_id:
        parts.append(_string_entry(_OPERATION_ID, identity.operation_id))
    if settled.features is not None:
        parts.append(encode_parameters(settled.features.provenance()))
    if stream is not None:
        parts.append(encode_parameters(stream_provenance(stream)))
    response.MergeFromString(b"".join(parts))


def attach_partial(
    response: service_pb2.ModelInferResponse,
    template: service_pb2.ModelInferResponse,
    *,
    gap_ms: float | None = None,
) -> None:
    """What a stream's partial response carries, cheaply (no settlement, no provenance built per
    result): the request's ``partial_template`` merged in, and when given ``orchid.gap_ms``
    (the gap before this result, from ``GapTracker.result``)."""
    response.MergeFrom(template)
    if gap_ms is not None:
        response.parameters["orchid.gap_ms"].double_param = round(gap_ms, 3)


def flag(request: service_pb2.ModelInferRequest, name: str) -> bool:
    return name in request.parameters and bool(request.parameters[name].bool_param)


def flag_response(response: service_pb2.ModelInferResponse, name: str) -> bool:
    return name in response.parameters and bool(response.parameters[name].bool_param)


def stream_error(error: GatewayError, client_id: str) -> service_pb2.ModelStreamInferResponse:
    """The reply that ends one request on a stream: ``STATUS: message`` (bounded like a
    status message), the rule and retry-after as parameters, and ``orchid.complete=false``
    (whatever it sent before this reply was not a complete answer)."""
    reply = service_pb2.ModelStreamInferResponse(error_message=bounded(f"{error.status}: {error.message}"))
    reply.infer_response.id = client_id
    for key, value in error.trailing_metadata():
        reply.infer_response.parameters[key].string_param = value
    reply.infer_response.parameters["orchid.complete"].bool_param = False
    return reply
