"""Helpers for tests of a fleet of gateway replicas on one Redis, against the real Triton.

A replica is a ``ThreadedGateway`` (in-process) or ``orchid-gateway serve`` (the harness's
``GatewayProcess``, which a test can kill -9). ``flood`` drives replicas open-loop with raw
gRPC and records every answer: status, deciding rule, charged accelerator-ms and whether the
gateway (not the client's deadline) answered.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import yaml
from tritonclient.grpc import service_pb2

from gateway.config import GatewayConfig, StateConfig
from orchid_tools.harness import GatewayProcess, example_config, send_open_loop
from tests.conftest import EXAMPLE_CONFIG, TIME_FACTOR, gateway_config
from tests.redis_server import free_port

INFER = "/inference.GRPCInferenceService/ModelInfer"
LUMEN_KEY = "orchid-demo-key-lumen"


def tenants_with_quota(workdir: Path, lumen_interactive: dict[str, Any]) -> Path:
    """The example tenants file with lumen's interactive quota replaced."""
    base = yaml.safe_load((EXAMPLE_CONFIG.parent / "tenants.yaml").read_text())
    base["quotas"]["tenants"]["lumen"] = {"interactive": lumen_interactive}
    path = workdir / "tenants.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


def fleet_config(
    triton_address: str, tenants_file: Path, state: StateConfig | None, *, max_inflight_per_device: int = 2
) -> GatewayConfig:
    changes: dict[str, Any] = {"tenants_file": tenants_file}
    if state is not None:
        changes["state"] = state
    config = gateway_config(triton_address, **changes)
    backend = config.backends[0].model_copy(update={"max_inflight_per_device": max_inflight_per_device})
    return config.model_copy(update={"backends": (backend,)})


def infer_request(input_tokens: int = 256, output_tokens: int = 64) -> bytes:
    request = service_pb2.ModelInferRequest(model_name="full-v18")
    tensor = request.inputs.add(name="INPUT_IDS", datatype="INT32")
    tensor.shape.extend([1, input_tokens])
    request.raw_input_contents.append(np.arange(input_tokens, dtype=np.int32).tobytes())
    request.parameters["orchid.max_output_tokens"].int64_param = output_tokens
    return request.SerializeToString()


@dataclass(frozen=True, slots=True)
class Answer:
    replica: int
    sent: float  # time.monotonic()
    done: float
    status: str
    rule: str
    charged_ms: float
    gateway_answered: bool  # a status from the gateway (OK, or an error with orchid-rule)


async def flood(
    addresses: list[str],
    *,
    rate_per_replica: float,
    seconds: float,
    deadline_s: float = 2.0,
    payload: bytes | None = None,
    key: str = LUMEN_KEY,
    marks: dict[str, float] | None = None,
) -> list[Answer]:
    """Send ``rate_per_replica`` requests/s to each address for ``seconds`` (uniform spacing)."""
    body = payload or infer_request()
    answers: list[Answer] = []
    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    calls = [c.unary_unary(INFER) for c in channels]
    t0 = time.monotonic() + 0.1  # the loop's clock: asyncio's loop.time() is time.monotonic()
    if marks is not None:
        marks["start"] = t0

    async def one(send: tuple[int, float]) -> None:
        replica = send[0]
        sent = time.monotonic()
        try:
            raw = await calls[replica](
                body, metadata=(("authorization", f"Bearer {key}"),), timeout=deadline_s
            )
            reply = service_pb2.ModelInferResponse.FromString(raw)
            charged = reply.parameters["orchid.charged_accelerator_ms"].double_param
            answers.append(Answer(replica, sent, time.monotonic(), "OK", "", charged, True))
        except grpc.aio.AioRpcError as error:
            trailing = dict(error.trailing_metadata() or ())
            rule = str(trailing.get("orchid-rule", ""))
            answers.append(Answer(replica, sent, time.monotonic(), error.code().name, rule, 0.0, bool(rule)))

    count = int(seconds * rate_per_replica)
    sends = sorted(
        ((replica, i / rate_per_replica) for replica in range(len(addresses)) for i in range(count)),
        key=lambda send: send[1],
    )
    try:
        await send_open_loop(sends, one, t0=t0, at=lambda send: send[1], lead_s=math.inf)
    finally:
        for channel in channels:
            await channel.close()
    if marks is not None:
        marks["end"] = t0 + seconds
    return answers


class ReplicaProcess(GatewayProcess):
    """``orchid-gateway serve`` as a replica of the fleet on ``state`` (the harness's process:
    its own session, so kill -9 takes it all), on the example's settings without jobs (replicas
    here share a directory, and a SQLite job store is one gateway's)."""

    def __init__(self, triton_address: str, tenants_file: Path, state: StateConfig, workdir: Path) -> None:
        backend = {
            "name": "local",
            "address": triton_address,
            "labels": {"cell": "eu-restricted", "device_group": "local-a"},
            "devices": 4,
            "max_inflight_per_device": 2,
            "time_scale": TIME_FACTOR,
        }
        config = example_config(
            [backend],
            without=("jobs",),
            tenants_file=str(tenants_file),
            state=state.model_dump(mode="json"),
        )
        port = free_port()
        super().__init__(config, workdir, name=f"replica-{port}", listen=f"127.0.0.1:{port}", log_level=None)
