"""The seed's mixed-shape case against the real example Triton.

Seven 256-token requests and one 4,096-token request arrive together. Padded into one
batch they would execute over 32,768 token positions for 5,888 useful ones (5.565x); the
gateway keeps them in separate shape buckets, so no short request is padded to, or waits
behind, the long one."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import tritonclient.grpc.aio as aioclient
from tritonclient.grpc import InferInput

from gateway.core.profile import DemandProfile, batch_accelerator_ms, padding
from tests.conftest import OPS_KEY, TIME_FACTOR, ThreadedGateway, bearer

FULL = DemandProfile(fixed_ms=4.4, prefill_ms_per_token=0.1, decode_ms_per_token=0.41875)
SHAPES = [(256, 64)] * 7 + [(4096, 128)]


def tokens(n: int, salt: int) -> list[InferInput]:
    tensor = InferInput("INPUT_IDS", [1, n], "INT32")
    tensor.set_data_from_numpy(((np.arange(n) + salt) % 32000).astype(np.int32).reshape(1, n))
    return [tensor]


def test_arithmetic_of_the_mixed_batch() -> None:
    report = padding([n for n, _ in SHAPES])
    assert (report.useful_tokens, report.padded_tokens) == (5888, 32768)
    mixed = batch_accelerator_ms(FULL, SHAPES)
    bucketed = batch_accelerator_ms(FULL, SHAPES[:7]) + batch_accelerator_ms(FULL, SHAPES[7:])
    assert round(mixed, 1) == 3334.8 and round(bucketed, 1) == 678.0


def test_short_requests_are_not_padded_to_the_long_one(gateway: ThreadedGateway) -> None:
    async def one(
        client: aioclient.InferenceServerClient, n: int, out: int, salt: int
    ) -> tuple[int, float, Any]:
        started = time.monotonic()
        result = await client.infer(
            "full-v18",
            tokens(n, salt),
            headers=bearer(OPS_KEY),
            parameters={"orchid.max_output_tokens": out, "orchid.class": "batch"},
            client_timeout=10.0,
        )
        return n, (time.monotonic() - started) * 1000.0, result.get_response().parameters

    async def scenario() -> list[tuple[int, float, Any]]:
        async with aioclient.InferenceServerClient(gateway.address) as client:
            return await asyncio.gather(*(one(client, n, out, i) for i, (n, out) in enumerate(SHAPES)))

    results = asyncio.run(scenario())
    shorts = [r for r in results if r[0] == 256]
    long = next(r for r in results if r[0] == 4096)
    # Had the shorts been padded into the long one's batch, each would have held a device for
    # the padded batch's cost (3,334.8 accelerator-ms x the time factor); they are charged by
    # their own shape instead (with a wide margin: the machine is shared and noisy).
    padded_batch_ms = batch_accelerator_ms(FULL, SHAPES) * TIME_FACTOR
    for _, _, params in shorts:
        assert params["orchid.charged_accelerator_ms"].double_param < padded_batch_ms
        assert params["orchid.model"].string_param == "full-v18"
    assert long[2]["orchid.charged_accelerator_ms"].double_param < padded_batch_ms
