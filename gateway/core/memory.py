"""Device memory: the live-memory bound's arithmetic, one truth for dispatch and the worksheet.

A device holds two kinds of state (the seed's "record memory by lifetime"):

* **resident**: the runtime reserve (runtime, kernels, workspaces, allocator reserve: the
  backend's ``runtime_reserve_gib``) and, for every model whose replica is on the device,
  its weights and per-replica workspace (``weights_bytes + workspace_reserve_bytes`` of
  its demand profile);
* **live**: the sequence state of the work on the device, ``live_cache_bytes_per_token``
  per live token: input plus output tokens of each item (``DemandProfile.peak_memory_bytes``,
  the record's ``demand.peak_memory_bytes``).

What a device has left for live state is ``device - runtime reserve - resident models``
(``DeviceMemory.live_room_bytes``), and its ceiling in tokens ``floor(left / bytes per
token)`` (``live_tokens``). The seed's 80 GiB device with a 6 GiB reserve holds 14e9
two-byte weights and, at 128 KiB per token, 392,584 live tokens. ``orchid-gateway
capacity`` prints that figure from a workload file with these two functions, and the
dispatch queue (``gateway.core.dispatch.DeviceSet``) bounds the live state of the work it
binds to each device by the same ``live_room_bytes``: the worksheet and the live bound
cannot disagree.

The bound's two refusals are made here, so their rules and messages are the same wherever
they are raised: work that cannot fit even on an idle device (``device_limit``,
INVALID_ARGUMENT: retrying the same request can never succeed on this deployment, as for an
input over ``max_input_tokens``), and work that waited for memory until its latest start
(``waited_too_long``, RESOURCE_EXHAUSTED with a retry-after: it fits once bound work ends).

Pure arithmetic; no clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.core.errors import InvalidArgument, ResourceExhausted
from gateway.core.profile import GIB, DemandProfile
from gateway.core.record import RequestRecord

# The seed's teaching device: the backends' defaults.
SEED_DEVICE_MEMORY_GIB = 80.0
SEED_RUNTIME_RESERVE_GIB = 6.0

# Work whose live state cannot fit on an idle device of its pool (INVALID_ARGUMENT).
DEVICE_LIMIT_RULE = "memory.device_limit"
# Work that waited for live memory to free until its latest start (RESOURCE_EXHAUSTED).
LIVE_TOKENS_RULE = "memory.live_tokens"


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """One device's memory and the part the runtime keeps for itself, in bytes."""

    device_bytes: int
    runtime_reserve_bytes: int = 0

    @classmethod
    def from_gib(cls, memory_gib: float, runtime_reserve_gib: float = 0.0) -> DeviceMemory:
        return cls(round(memory_gib * GIB), round(runtime_reserve_gib * GIB))

    def live_room_bytes(self, resident_bytes: int) -> int:
        """Bytes left for live sequence state beside ``resident_bytes`` of resident models
        (negative: they do not fit)."""
        return self.device_bytes - self.runtime_reserve_bytes - resident_bytes


def resident_bytes(profile: DemandProfile) -> int:
    """What one replica of a model keeps on each device it is placed on: weights and workspace."""
    return profile.weights_bytes + profile.workspace_reserve_bytes


def live_tokens(room_bytes: float, bytes_per_token: int) -> int | None:
    """The ceiling on live tokens in ``room_bytes``: ``floor(room / bytes per token)``, at least
    0; None when no live cache is declared (memory does not bound tokens)."""
    if bytes_per_token <= 0:
        return None
    if math.isinf(room_bytes):
        return None
    return max(0, math.floor(room_bytes / bytes_per_token))


def _gib(value: float) -> str:
    return f"{value / GIB:,.2f} GiB"


def device_limit(
    live_bytes: int, room_bytes: float, *, record: RequestRecord | None = None
) -> InvalidArgument:
    """The refusal of work whose live state exceeds what an idle device holds for it. With the
    record, the message counts tokens: items x (input + output) against the device's ceiling."""
    shape = record.shape if record is not None else None
    tokens = shape.items * (shape.input_tokens + shape.max_output_tokens) if shape is not None else 0
    if record is not None and shape is not None and tokens > 0:
        per_token = live_bytes // tokens
        ceiling = live_tokens(room_bytes, per_token)
        message = (
            f"model {record.identity.model!r} cannot hold this request on one device: "
            f"{shape.items} x ({shape.input_tokens:,} input + {shape.max_output_tokens:,} output) = "
            f"{tokens:,} live tokens; a device holds at most {ceiling:,} "
            "(send a shorter input, a lower orchid.max_output_tokens or fewer items)"
        )
    else:
        message = (
            f"the request's live state ({_gib(live_bytes)}) exceeds what one device holds for it "
            f"({_gib(max(0.0, room_bytes))})"
        )
    return InvalidArgument(message, rule=DEVICE_LIMIT_RULE)


def check_fits(record: RequestRecord, room_bytes: float) -> None:
    """Raise ``device_limit`` if the record's live state cannot fit on an idle device."""
    need = record.demand.peak_memory_bytes
    if need > room_bytes:
        raise device_limit(need, room_bytes, record=record)


def waited_too_long(retry_after_ms: float) -> ResourceExhausted:
    """The refusal of work whose latest start passed while the devices' live memory was held
    by bound work; it would fit once that work ends (``retry_after_ms`` from now, predicted)."""
    return ResourceExhausted(
        "the model's devices hold too much live sequence state to start this request in time",
        rule=LIVE_TOKENS_RULE,
        retry_after_ms=max(1, math.ceil(round(retry_after_ms, 6))),  # no float noise's extra ms
    )
