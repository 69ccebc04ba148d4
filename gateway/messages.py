"""The KServe message edge of the request path: parsing a request, the provenance a
response carries, and the error reply a stream sends for one failed request.

Provenance (``orchid.*`` response parameters) is the caller's record of what ran:
model and version, route reason, approximation, policy version and rules, ladder
step, predicted and charged accelerator-ms. It never carries another tenant's
data or payload.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

from gateway.core.errors import GatewayError, InvalidArgument

if TYPE_CHECKING:
    from gateway.pipeline import Settled


def parse_infer_request(raw: bytes) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest()
    try:
        request.ParseFromString(raw)
    except DecodeError:
        raise InvalidArgument("malformed ModelInferRequest: the message is not valid protobuf") from None
    if not request.model_name:
        raise InvalidArgument("model_name is required")
    return request


def provenance(settled: Settled) -> dict[str, str | int | float | bool]:
    record, decision, outcome = settled.record, settled.decision, settled.outcome
    return {
        "orchid.model": decision.target_model,
        "orchid.model_version": record.identity.model_version,
        "orchid.route_reason": decision.route_reason,
        "orchid.approximation": str(decision.approximation),
        "orchid.complete": outcome.complete,
        "orchid.policy_version": decision.policy_version,
        "orchid.rules": ",".join(decision.rules),
        "orchid.ladder_step": record.ladder_step,
        "orchid.predicted_accelerator_ms": round(record.demand.accelerator_ms, 3),
        "orchid.charged_accelerator_ms": round(outcome.charged_accelerator_ms, 3),
        "orchid.request_id": record.identity.request_id,
    }


def attach_provenance(response: service_pb2.ModelInferResponse, settled: Settled) -> None:
    for key, value in provenance(settled).items():
        param = response.parameters[key]
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int):
            param.int64_param = value
        elif isinstance(value, float):
            param.double_param = value
        else:
            param.string_param = value


def flag(request: service_pb2.ModelInferRequest, name: str) -> bool:
    return name in request.parameters and bool(request.parameters[name].bool_param)


def flag_response(response: service_pb2.ModelInferResponse, name: str) -> bool:
    return name in response.parameters and bool(response.parameters[name].bool_param)


def stream_error(error: GatewayError, client_id: str) -> service_pb2.ModelStreamInferResponse:
    reply = service_pb2.ModelStreamInferResponse(error_message=f"{error.status}: {error.message}")
    reply.infer_response.id = client_id
    for key, value in error.trailing_metadata():
        reply.infer_response.parameters[key].string_param = value
    return reply
