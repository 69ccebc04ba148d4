"""A dedicated tenant never shares a Triton model instance with another tenant, under
concurrent load against the real example Triton: Triton's own counters show every one of its
requests on its reserved backend model and none of anybody else's."""

from __future__ import annotations

import asyncio

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.grpc import InferInput

from gateway.backends.local import LocalTriton
from tests.conftest import LUMEN_KEY, ORCHID_KEY, ThreadedGateway, bearer

KESTREL_KEY = "orchid-demo-key-kestrel"


def executed(triton: LocalTriton, model: str) -> int:
    client = grpcclient.InferenceServerClient(triton.address)
    stats = client.get_inference_statistics(model)
    return int(stats.model_stats[0].inference_stats.success.count)


def test_dedicated_tenant_runs_only_on_its_own_instances(
    gateway: ThreadedGateway, triton: LocalTriton
) -> None:
    before = {m: executed(triton, m) for m in ("full-v18", "full-v18-kestrel")}
    counts = {"kestrel": 0, "others": 0}

    async def send(client: aioclient.InferenceServerClient, key: str, who: str, n: int) -> None:
        tensor = InferInput("INPUT_IDS", [1, 64], "INT32")
        tensor.set_data_from_numpy(np.arange(64, dtype=np.int32).reshape(1, 64))
        for _ in range(n):
            result = await client.infer("full-v18", [tensor], headers=bearer(key), client_timeout=10.0)
            response = result.get_response()
            assert response.parameters["orchid.model"].string_param == "full-v18"
            counts[who] += 1

    async def scenario() -> None:
        async with aioclient.InferenceServerClient(gateway.address) as client:
            await asyncio.gather(
                *(send(client, KESTREL_KEY, "kestrel", 6) for _ in range(4)),
                *(send(client, ORCHID_KEY, "others", 6) for _ in range(4)),
                *(send(client, LUMEN_KEY, "others", 6) for _ in range(2)),
            )

    asyncio.run(scenario())
    after = {m: executed(triton, m) for m in ("full-v18", "full-v18-kestrel")}
    # Exactly kestrel's requests ran on its reserved instances, and only the others' on the shared.
    assert after["full-v18-kestrel"] - before["full-v18-kestrel"] == counts["kestrel"] == 24
    assert after["full-v18"] - before["full-v18"] == counts["others"] == 36
