"""Demand estimation: shape + profile -> predicted ``Demand``.

Pure arithmetic over a ``DemandProfile`` (see ``profile``), scaled by a
correction factor that the edge learns from observed work. No clocks, no I/O.
"""

from __future__ import annotations

from gateway.profile import DemandProfile
from gateway.record import Demand, Shape


def predict(profile: DemandProfile, shape: Shape, *, correction: float = 1.0) -> Demand:
    prefill, decode = profile.phases(shape.input_tokens, shape.max_output_tokens, batch=shape.items)
    return Demand(
        prefill_ms=prefill * correction,
        decode_ms=decode * correction,
        host_cpu_ms=profile.host_cpu_ms,
        transfer_bytes=profile.transfer_bytes(shape.input_tokens, shape.max_output_tokens) * shape.items,
        peak_memory_bytes=profile.peak_memory_bytes(shape.input_tokens, shape.max_output_tokens)
        * shape.items,
        live_token_ms=profile.live_token_ms(shape.input_tokens, shape.max_output_tokens)
        * shape.items
        * correction,
        correction=correction,
    )
