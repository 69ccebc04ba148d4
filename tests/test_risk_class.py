"""Risk classes (issue 13): which class a request runs under, and that a prohibited class is
never degraded.

The resolution is pure (``gateway.core.risk``) and tested here directly; the end-to-end test
runs against the real example Triton with the pool's ladder pinned (as in
``test_ladder_effects``): at step 3 over the envelope a standard request is diverted to the
warm fallback for part of the traffic, a ``regulated`` one never is; at step 2 a standard
request gets the reduced output, a ``regulated`` one never does."""

from __future__ import annotations

from collections import Counter

import grpc
import pytest
from tritonclient.grpc import service_pb2_grpc

from gateway.backends.local import LocalTriton
from gateway.config import GatewayConfig
from gateway.core.errors import InvalidArgument, PermissionDenied
from gateway.core.risk import DEFAULT_RISK_CLASSES, resolve_risk_class
from tests.conftest import ThreadedGateway, gateway_config
from tests.test_ladder_effects import AUTH, POOL, outcomes, pin, request

DECLARED = DEFAULT_RISK_CLASSES  # standard < out_of_distribution < regulated < safety_critical


def test_the_class_is_the_highest_minimum_unless_the_caller_raises_it() -> None:
    assert (
        resolve_risk_class(DECLARED, tenant_default="standard", route_default="standard", requested=None)
        == "standard"
    )
    assert (
        resolve_risk_class(DECLARED, tenant_default="standard", route_default="regulated", requested=None)
        == "regulated"
    )
    assert (
        resolve_risk_class(
            DECLARED, tenant_default="regulated", route_default="standard", requested="safety_critical"
        )
        == "safety_critical"
    )
    assert (
        resolve_risk_class(
            DECLARED, tenant_default="regulated", route_default="standard", requested="regulated"
        )
        == "regulated"
    )


def test_a_caller_may_not_lower_its_class_or_name_an_undeclared_one() -> None:
    with pytest.raises(PermissionDenied) as denied:
        resolve_risk_class(
            DECLARED, tenant_default="regulated", route_default="standard", requested="standard"
        )
    assert str(denied.value) == (
        "risk class 'standard' is below 'regulated', the minimum for this credential: "
        "a caller may raise its risk class, never lower it"
    )
    with pytest.raises(PermissionDenied, match="the minimum for this model"):
        resolve_risk_class(
            DECLARED, tenant_default="standard", route_default="out_of_distribution", requested="standard"
        )
    with pytest.raises(InvalidArgument) as invalid:
        resolve_risk_class(
            DECLARED, tenant_default="standard", route_default="standard", requested="harmless"
        )
    assert "unknown risk class 'harmless'; declared: standard, out_of_distribution" in str(invalid.value)


def test_config_rejects_an_undeclared_class_and_duplicates(triton: LocalTriton) -> None:
    config = gateway_config(triton.address)
    with pytest.raises(ValueError, match="risk_classes must be unique"):
        GatewayConfig.model_validate({**config.model_dump(), "risk_classes": ["standard", "standard"]})


def test_a_prohibited_class_is_never_degraded_with_the_ladder_pinned(pinned: ThreadedGateway) -> None:
    gw = pinned.server.gateway
    assert gw is not None
    with grpc.insecure_channel(pinned.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        first = stub.ModelInfer(request(), metadata=AUTH, timeout=10)  # creates the pool's load
        assert POOL in gw.loads and first.parameters["orchid.ladder_step"].int64_param == 0

        # The caller's class is checked at the edge: an undeclared one is INVALID_ARGUMENT.
        with pytest.raises(grpc.RpcError) as error:
            stub.ModelInfer(request(**{"orchid.risk_class": "harmless"}), metadata=AUTH, timeout=10)
        assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown risk class 'harmless'" in (error.value.details() or "")

        # Step 3 at 122 % of the envelope: standard work is partly diverted to the fallback ...
        pin(pinned, 3, 1.22)
        standard = outcomes(stub, 24, **{"orchid.max_output_tokens": 16})
        assert standard["ok:fallback"] > 0, standard
        # ... a regulated request never is, and nothing is refused in its place.
        regulated = {"orchid.max_output_tokens": 16, "orchid.risk_class": "regulated"}
        assert outcomes(stub, 24, **regulated) == Counter({"ok:none": 24})
        reply = stub.ModelInfer(request(**regulated), metadata=AUTH, timeout=10)
        assert reply.parameters["orchid.ladder_step"].int64_param == 3
        assert "fallback-prohibited-risk" in reply.parameters["orchid.rules"].string_param
        assert reply.parameters["orchid.model"].string_param == "full-v18"

        # Step 2 at 130 %: standard work gets the reduced output, a safety-critical one never.
        pin(pinned, 2, 1.3)
        assert outcomes(stub, 4, **{"orchid.max_output_tokens": 64}) == Counter({"ok:reduced_output": 4})
        critical = {"orchid.max_output_tokens": 64, "orchid.risk_class": "safety_critical"}
        assert outcomes(stub, 8, **critical) == Counter({"ok:none": 8})
        reply = stub.ModelInfer(request(**critical), metadata=AUTH, timeout=10)
        assert list(reply.outputs[0].shape) == [1, 64]  # Triton generated the whole answer
