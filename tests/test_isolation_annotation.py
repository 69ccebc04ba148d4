"""``annotate: {isolation: dedicated}`` has an effect (issue 13), against the real Triton.

The annotation is in ``gateway.policy.model.ENFORCED_ANNOTATIONS``; the pipeline enforces it:
a request so annotated runs only on a backend model reserved for its tenant (its own pool,
never batched with another tenant), else PERMISSION_DENIED with rule ``isolation.dedicated``.
Here a policy asks it of regulated work: the shared tenant is refused, the dedicated one runs
on its own instances, and standard work is unaffected."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from tritonclient.grpc import service_pb2_grpc

from gateway.backends.local import LocalTriton
from tests.conftest import ROOT, ThreadedGateway, bearer, gateway_config
from tests.test_ladder_effects import request

ORCHID = tuple(bearer("orchid-demo-key-orchid").items())
KESTREL = tuple(bearer("orchid-demo-key-kestrel").items())
RULE = """\
rules:
  - id: regulated-needs-dedicated
    stage: admission
    condition: request.risk_class == 'regulated'
    action:
      annotate: {isolation: dedicated}
"""


@pytest.fixture(scope="module")
def running(triton: LocalTriton, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedGateway]:
    policies = Path(tmp_path_factory.mktemp("policies")) / "policies"
    shutil.copytree(ROOT / "policies", policies)
    (policies / "50-isolation.yaml").write_text(RULE)
    gateway = ThreadedGateway(gateway_config(triton.address, policies_dir=policies))
    gateway.start()
    try:
        yield gateway
    finally:
        gateway.stop()


def test_isolation_dedicated_refuses_shared_capacity(running: ThreadedGateway) -> None:
    regulated = {"orchid.max_output_tokens": 8, "orchid.risk_class": "regulated"}
    with grpc.insecure_channel(running.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            stub.ModelInfer(request(**regulated), metadata=ORCHID, timeout=10)
        assert error.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert dict(error.value.trailing_metadata() or ()).get("orchid-rule") == "isolation.dedicated"
        assert "policy requires dedicated isolation" in (error.value.details() or "")
        # Standard work of the same tenant is not annotated, so it runs on the shared pool.
        stub.ModelInfer(request(**{"orchid.max_output_tokens": 8}), metadata=ORCHID, timeout=10)
        # The dedicated tenant's regulated work runs, on its reserved instances.
        reply = stub.ModelInfer(request(**regulated), metadata=KESTREL, timeout=10)
        assert "regulated-needs-dedicated" in reply.parameters["orchid.rules"].string_param
