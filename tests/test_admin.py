"""The admin service: its modules are generated from ``proto/`` at build time (not compiled at
import), and against the real gateway every admin RPC refuses a tenant credential with
PERMISSION_DENIED and a missing or unknown one with UNAUTHENTICATED (through
``gateway.status.to_status``, like the inference service)."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc_tools
import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

from gateway import admin
from tests.conftest import LUMEN_KEY, OPS_KEY, ORCHID_KEY, ROOT, ThreadedGateway

PROTO = "orchid/admin/v1/admin.proto"
COMPILE_AT_IMPORT = ("protos_and_services", "protos", "services")  # grpc's runtime protoc


def test_admin_modules_are_the_build_time_generated_ones() -> None:
    assert admin.admin_pb2.__name__ == "gateway._proto.admin_pb2"
    assert admin.admin_pb2_grpc.__name__ == "gateway._proto.admin_pb2_grpc"
    assert admin.SERVICE == "orchid.admin.v1.GatewayAdmin"
    # Nothing compiles protos at import time any more.
    for package in ("gateway", "orchid_tools"):
        for path in (ROOT / package).rglob("*.py"):
            if "_proto" in path.relative_to(ROOT).parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                compiles = (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "grpc"
                    and node.attr in COMPILE_AT_IMPORT
                )
                assert not compiles, f"{path}: protos are generated at build time (setup.py), not at import"


def test_generated_modules_match_the_proto(tmp_path: Path) -> None:
    """A .proto edited without reinstalling (scripts/bootstrap.sh) leaves stale modules."""
    out = tmp_path / "admin.pb"
    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    status = protoc.main(
        ["protoc", f"-I{ROOT / 'proto'}", f"-I{well_known}", f"--descriptor_set_out={out}", PROTO]
    )
    assert status == 0
    (compiled,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    _drop_json_names(compiled.message_type)  # a descriptor set spells them out; _pb2 does not
    generated = descriptor_pb2.FileDescriptorProto.FromString(admin.admin_pb2.DESCRIPTOR.serialized_pb)
    assert generated == compiled, "gateway/_proto is stale: run scripts/bootstrap.sh"


def _drop_json_names(messages: Any) -> None:
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        _drop_json_names(message.nested_type)


@pytest.fixture(scope="module")
def stub(gateway: ThreadedGateway) -> Iterator[Any]:
    with grpc.insecure_channel(gateway.address) as channel:
        yield admin.admin_pb2_grpc.GatewayAdminStub(channel)


CALLS: dict[str, Callable[[Any], Any]] = {
    "ReloadPolicies": lambda s: (s.ReloadPolicies, admin.admin_pb2.ReloadPoliciesRequest()),
    "PolicyStatus": lambda s: (s.PolicyStatus, admin.admin_pb2.PolicyStatusRequest()),
    "LadderStatus": lambda s: (s.LadderStatus, admin.admin_pb2.LadderStatusRequest()),
}


def _refusal(stub: Any, rpc: str, metadata: tuple[tuple[str, str], ...]) -> grpc.RpcError:
    method, request = CALLS[rpc](stub)
    with pytest.raises(grpc.RpcError) as refused:
        method(request, metadata=metadata, timeout=10)
    return refused.value


@pytest.mark.parametrize("rpc", sorted(CALLS))
@pytest.mark.parametrize("key", [ORCHID_KEY, LUMEN_KEY])
def test_a_tenant_credential_is_permission_denied(stub: Any, rpc: str, key: str) -> None:
    error = _refusal(stub, rpc, (("authorization", f"Bearer {key}"),))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error.details() == "this operation needs an admin credential"


@pytest.mark.parametrize("rpc", sorted(CALLS))
@pytest.mark.parametrize(
    "metadata",
    [(), (("authorization", "Bearer not-a-key"),), (("authorization", "Basic b3Bz"),)],
    ids=["missing", "unknown", "malformed"],
)
def test_no_valid_credential_is_unauthenticated(
    stub: Any, rpc: str, metadata: tuple[tuple[str, str], ...]
) -> None:
    error = _refusal(stub, rpc, metadata)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED


def test_an_admin_credential_is_served(stub: Any) -> None:
    ops = (("authorization", f"Bearer {OPS_KEY}"),)
    status = stub.PolicyStatus(admin.admin_pb2.PolicyStatusRequest(), metadata=ops, timeout=10)
    assert status.ready and status.version.startswith("sha256:")
    ladder = stub.LadderStatus(admin.admin_pb2.LadderStatusRequest(), metadata=ops, timeout=10)
    assert isinstance(ladder, admin.admin_pb2.LadderStatusResponse)
