"""Hot reload against a serving gateway: a good edit changes orchid.policy_version on the next
responses, a broken edit does not and is reported by the admin RPC with file:line:col."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.admin import admin_pb2, admin_pb2_grpc
from gateway.backends.local import LocalTriton
from tests.conftest import OPS_KEY, ORCHID_KEY, ROOT, ThreadedGateway, gateway_config

ORCHID = (("authorization", f"Bearer {ORCHID_KEY}"),)
OPS = (("authorization", f"Bearer {OPS_KEY}"),)


@pytest.fixture(scope="module")
def served(
    triton: LocalTriton, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ThreadedGateway, Path]]:
    policies = tmp_path_factory.mktemp("live") / "policies"
    shutil.copytree(ROOT / "policies", policies)
    running = ThreadedGateway(gateway_config(triton.address, policies_dir=policies, policy_watch_s=0.1))
    running.start()
    try:
        yield running, policies
    finally:
        running.stop()


def version(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> str:
    request = service_pb2.ModelInferRequest(model_name="full-v18")
    tensor = request.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([1, 8])
    request.raw_input_contents.append(np.zeros(8, dtype=np.int32).tobytes())
    reply = stub.ModelInfer(request, metadata=ORCHID, timeout=10)
    return str(reply.parameters["orchid.policy_version"].string_param)


def wait_for(predicate: object, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def test_edit_broken_edit_and_admin_reload(served: tuple[ThreadedGateway, Path]) -> None:
    running, policies = served
    store = running.server.policy
    with grpc.insecure_channel(running.address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        admin = admin_pb2_grpc.GatewayAdminStub(channel)
        first = version(stub)
        assert first.startswith("sha256:") and first == store.version

        # A good edit (a new shadow rule) is picked up by the watcher.
        quota = policies / "30-quota.yaml"
        quota.write_text(
            quota.read_text()
            + "\n  - id: shadow-tiny-requests\n    stage: admission\n    mode: shadow\n"
            + "    condition: shape.input_tokens < 4\n    action:\n      deny: {status: INVALID_ARGUMENT}\n"
        )
        assert wait_for(lambda: store.version != first)
        second = version(stub)
        assert second != first

        # A broken edit: the version stays, the failure is counted and reported with file:line:col.
        failures = store.failures
        (policies / "20-admission.yaml").write_text(
            (policies / "20-admission.yaml").read_text().replace("budget.slack_ms < 0.0", "budget.slack_ms <")
        )
        assert wait_for(lambda: store.failures > failures)
        assert version(stub) == second
        with pytest.raises(grpc.RpcError) as rejected:
            admin.ReloadPolicies(admin_pb2.ReloadPoliciesRequest(), metadata=OPS, timeout=10)
        assert rejected.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "20-admission.yaml:" in rejected.value.details()
        status = admin.PolicyStatus(admin_pb2.PolicyStatusRequest(), metadata=OPS, timeout=10)
        assert status.version == second and status.ready
        assert any("20-admission.yaml:" in d for d in status.last_diagnostics)

        # Non-admins may not reload.
        with pytest.raises(grpc.RpcError) as denied:
            admin.ReloadPolicies(admin_pb2.ReloadPoliciesRequest(), metadata=ORCHID, timeout=10)
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED

        # Repair it and reload through the admin RPC.
        shutil.copy(ROOT / "policies" / "20-admission.yaml", policies / "20-admission.yaml")
        reply = admin.ReloadPolicies(admin_pb2.ReloadPoliciesRequest(), metadata=OPS, timeout=10)
        assert reply.ok and reply.version == store.version
        ladder = admin.LadderStatus(admin_pb2.LadderStatusRequest(), metadata=OPS, timeout=10)
        assert [p.pool for p in ladder.pools] == ["local/full-v18"]
